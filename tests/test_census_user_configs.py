"""Tiny configs built as a new user builds them – the config class's defaults with only the
sizes shrunk, saved by transformers – train, or are refused in one line before the build.

The census' own tiny configs (model.census) set every field consistently; these keep the
defaults it overrides, which is how mistral4, bailing_hybrid and step3p5 (and step3p7 and
diffusion_gemma as image-text checkpoints) once ended in a traceback (issue 37, item 6).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.errors import ConfigError, UnknownFamilyError
from moetune.model import spec_from_config

pytestmark = pytest.mark.filterwarnings("ignore")
# the obvious sizes shrunk; every other field stays the class's default
SIZES = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
         "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
         "vocab_size": 128}  # fmt: skip
# mistral4's head dims shrunk in proportion (128 → 8: head_dim, as qk dims 64 → 8)
MISTRAL4 = {"n_routed_experts": 4, "num_experts_per_tok": 2, "q_lora_rank": 32,
            "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
            "head_dim": 8}  # fmt: skip
STEP3P5 = {"n_routed_experts": 4, "num_experts_per_tok": 2, "share_expert_dim": 32,
           "head_dim": 16, "num_sliding_attention_heads": 4}  # fmt: skip


def user_config(model_type: str, **fields: Any) -> Any:
    """The config class's defaults, `SIZES` and `fields` set (what a new user writes)."""
    from transformers import CONFIG_MAPPING

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[model_type](**{**SIZES, **fields})


def save(config: Any, out: Path, cls: Any = None) -> Path:
    """A random fp32 checkpoint of `config` (its multimodal class, or the causal LM) and the
    demo tokenizer, as transformers' save_pretrained writes them."""
    from moetune.demo.tokenizer import build_tokenizer
    from moetune.model.derive import checkpoint_class

    tok = build_tokenizer()
    for name in ("pad", "eos", "bos"):
        setattr(config.get_text_config(), f"{name}_token_id", getattr(tok, f"{name}_token_id"))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = (cls or checkpoint_class(config))._from_config(config, dtype=torch.float32)
        model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _train(base: Path, tmp_path: Path) -> Any:
    from moetune.train.trainer import train
    from test_train_helpers import one_thread, reverse_rows, run_config, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(8))
    cfg = run_config(base, data, tmp_path / "run", max_steps=2, save_steps=2, seq_len=16)
    with one_thread():
        return train(cfg, progress=False)


def _config_json(config: Any, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    return out


def test_mistral4_head_dim_off_its_rotary_width_is_refused_in_one_line(tmp_path: Path) -> None:
    """transformers builds it, and the first forward fails in the rotary embedding ("size
    of tensor a (4) must match ... b (2)"): refused from config.json alone, exit 2."""
    base = _config_json(user_config("mistral4", **MISTRAL4), tmp_path / "model")
    result = CliRunner().invoke(app, ["inspect", str(base)])
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    said = " ".join(result.stderr.split())
    assert "head_dim × partial_rotary_factor = 8 × 0.5 = 4" in said
    assert "qk_rope_head_dim=8" in said and "set head_dim to 16" in said
    fixed = user_config("mistral4", **{**MISTRAL4, "head_dim": 16}).to_dict()
    assert spec_from_config(fixed, "mistral4").is_moe  # the fix it names builds


def test_bailing_hybrid_experts_not_split_by_its_groups_is_refused(tmp_path: Path) -> None:
    """4 experts with the default 8 routing groups: transformers builds it and the router's
    view fails ("shape '[-1, 8, 0]' is invalid"); refused before the build, naming both."""
    config = user_config("bailing_hybrid", num_experts=4, num_experts_per_token=2)
    with pytest.raises(ConfigError) as err:
        spec_from_config(config.to_dict(), "bailing_hybrid")
    assert "num_experts=4, not a multiple of num_expert_group=8" in err.value.cause
    assert "num_expert_group" in err.value.fix
    ids = {"pad_token_id": 0, "eos_token_id": 1}  # the defaults' lie past the tiny vocabulary
    fixed = {**config.to_dict(), "num_expert_group": 1, "topk_group": 1, **ids}
    assert spec_from_config(fixed, "bailing_hybrid").num_experts == 4


@pytest.mark.parametrize(
    ("model_type", "fields", "said"),
    [
        ("deepseek_v3", {"n_routed_experts": 8, "n_group": 2, "topk_group": 4},
         "topk_group=4 of n_group=2 groups"),
    ],
)  # fmt: skip
def test_routing_fields_that_disagree_are_refused(
    model_type: str, fields: dict[str, int], said: str
) -> None:
    with pytest.raises(ConfigError) as err:
        spec_from_config(user_config(model_type, **fields).to_dict(), model_type)
    assert said in err.value.cause


def test_step3p5_saved_from_its_defaults_trains(tmp_path: Path) -> None:
    """No layer slides and no window is set (the defaults): transformers' forward still
    builds the sliding mask and fails; the fix fills the window and config.json stays."""
    base = save(user_config("step3p5", **STEP3P5), tmp_path / "model")
    result = _train(base, tmp_path)
    assert (result.steps, result.coverage, result.router_changed) == (2, 1.0, False)
    assert json.loads((base / "config.json").read_text())["sliding_window"] is None


def test_step3p5_with_sliding_layers_and_no_window_is_refused() -> None:
    layer_types = ["sliding_attention", "full_attention"] * 2
    config = user_config("step3p5", **STEP3P5, layer_types=layer_types)
    with pytest.raises(ConfigError) as err:
        spec_from_config(config.to_dict(), "step3p5")
    assert "2 sliding_attention layers but sliding_window is null" in err.value.cause


def _image_text(model_type: str, **text: Any) -> Any:
    """The census' tiny image-text config (towers one layer), its text config's `text`
    fields set back to what a new user's config leaves them."""
    from transformers import CONFIG_MAPPING

    from moetune.model.census import tiny_multimodal_config

    values = tiny_multimodal_config(model_type)
    values.pop("model_type")
    values["text_config"].update(text)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return CONFIG_MAPPING[model_type](**values)


def test_step3p7_image_text_checkpoint_without_a_window_trains(tmp_path: Path) -> None:
    from moetune.model.multimodal import multimodal_class

    config = _image_text("step3p7", sliding_window=None)
    base = save(config, tmp_path / "model", multimodal_class(config))
    result = _train(base, tmp_path)
    assert (result.steps, result.coverage, result.router_changed) == (2, 1.0, False)


def test_diffusion_gemma_block_diffusion_checkpoint_is_refused_before_the_build(
    tmp_path: Path,
) -> None:
    """Its forward denoises a canvas and takes no labels: nothing a language-model loss can
    train. Refused before the weights load, pointing at its text model (which trains)."""
    from moetune.model.multimodal import multimodal_class

    config = _image_text("diffusion_gemma")
    base = save(config, tmp_path / "model", multimodal_class(config))
    with pytest.raises(UnknownFamilyError) as err:
        _train(base, tmp_path)
    assert "DiffusionGemmaForBlockDiffusion.forward takes no labels" in err.value.cause
    assert "'diffusion_gemma_text'" in err.value.fix


def test_step3p5_without_a_window_traces_as_it_steps() -> None:
    """The planner's trace builds the model the trainer runs, fix included: fake == real."""
    from moetune.bench.census import traced_and_real

    config = user_config("step3p5", **STEP3P5, pad_token_id=0, eos_token_id=1)
    spec = spec_from_config(config.to_dict(), "step3p5")
    assert spec.hf_config.get("sliding_window") is None
    fake, real = traced_and_real(spec)
    assert fake == real > 0


def test_glm4v_moe_text_mrope_sections_off_its_rotary_width_are_refused() -> None:
    """Its modeling code's default sections (8, 12, 12) split 32 rotary frequencies; at
    head_dim 16 there are 4, and the first forward fails in `split_with_sizes`."""
    config = user_config("glm4v_moe_text", n_routed_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError) as err:
        spec_from_config(config.to_dict(), "glm4v_moe_text")
    assert "mrope_section=[8, 12, 12] summing to 32, but 4 rotary" in err.value.cause
    assert "summing to 4" in err.value.fix


def test_mimo_v2_flash_with_as_many_kv_heads_as_heads_is_refused() -> None:
    """Its sliding layers double num_key_value_heads: 4 heads, 4 kv heads leaves those
    layers 8 kv heads for 4 query heads (no query head per group)."""
    config = user_config("mimo_v2_flash", n_routed_experts=4, num_experts_per_tok=2)
    with pytest.raises(ConfigError) as err:
        spec_from_config(config.to_dict(), "mimo_v2_flash")
    assert "fewer query heads than key/value heads" in err.value.cause
    assert "num_attention_heads=4, num_key_value_heads=4" in err.value.cause
    ids = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}
    fixed = {**config.to_dict(), "num_key_value_heads": 2, **ids}
    assert spec_from_config(fixed, "mimo_v2_flash").is_moe


@pytest.mark.parametrize("model_type", ["deepseek_v2", "longcat_flash", "mistral4"])
def test_latent_attention_with_fewer_kv_heads_than_heads_is_refused(model_type: str) -> None:
    """Latent attention makes a key/value head per query head; num_key_value_heads=2 of 4
    (a usual GQA shrink) fails the first forward ("size of tensor a (4) ... b (8)")."""
    fields = {"n_routed_experts": 4, "num_experts_per_tok": 2, "num_key_value_heads": 2}
    with pytest.raises(ConfigError) as err:
        spec_from_config(user_config(model_type, **fields).to_dict(), model_type)
    assert "num_key_value_heads=2 for num_attention_heads=4" in err.value.cause
    assert "set num_key_value_heads to num_attention_heads (4)" in err.value.fix
