"""Multimodal MoE checkpoints of the *installed* transformers train in their own layout.

For every multimodal type the census lists, a tiny checkpoint saved by transformers' own
multimodal class (towers one layer deep) trains five steps with LoRA on the language model
alone, on text rows: every expert reached, router and towers unchanged; the adapter loads
with plain `PeftModel.from_pretrained` on the multimodal class, and the merged export is
the whole checkpoint again with the towers' tensors and the config as they were.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from moetune.model.census import multimodal_model_types, tiny_multimodal_config
from moetune.model.derive import checkpoint_class

pytestmark = pytest.mark.filterwarnings("ignore")
MULTIMODAL = multimodal_model_types()
# Known failures, each with its cause (strict: a fix is noticed). None in transformers 5.24:
# Llama 4's and Qwen3-Omni thinker's classes train through moetune.model.fixes.registry.
CANNOT_TRAIN: dict[str, str] = {}
# refused before the build, each with the cause its error names (checkpoint_class)
REFUSED = {"qwen3_omni_moe": "no forward of its own", "diffusion_gemma": "takes no labels"}
# over ~20 s a type on the shared CPUs (the build of their towers or text model alone)
SLOW = {"gemma4", "glm5_next", "hy_v4_vl", "inkling2", "inkling2_loop", "inkling_mm_model",
        "mistral_large4"}  # fmt: skip


def _case(model_type: str) -> Any:
    marks = [pytest.mark.slow] if model_type in SLOW else []
    if model_type in CANNOT_TRAIN:
        marks.append(pytest.mark.xfail(strict=True, reason=CANNOT_TRAIN[model_type]))
    return pytest.param(model_type, marks=marks)


def save_tiny_multimodal(model_type: str, out: Path) -> Path:
    """A tiny random checkpoint of transformers' own multimodal class + the demo tokenizer."""
    from transformers import CONFIG_MAPPING

    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    values = tiny_multimodal_config(model_type)
    values.pop("model_type")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CONFIG_MAPPING[model_type](**values)
        text = config.get_text_config()
        for name in ("pad", "eos", "bos"):
            setattr(text, f"{name}_token_id", getattr(tok, f"{name}_token_id"))
        torch.manual_seed(0)
        model = checkpoint_class(config)._from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def _meta(base: Path) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        return checkpoint_class(config)._from_config(config)


def _language_keys(base: Path, meta: Any) -> tuple[set[str], set[str], set[str]]:
    """The language model's decoder-layer tensors: their module paths, their saved
    checkpoint keys, and the saved keys of the routed experts – the meta build's parameters
    through transformers' own save-time names (a type with a conversion mapping saves
    `model.layers.N…` / `experts.N.w1` / `moe.gate_proj`, not module paths)."""
    from moetune.model import get_family, load_spec
    from moetune.model.layers import layers_prefix
    from moetune.model.saved_names import saved_names

    spec = load_spec(str(base))
    prefix = layers_prefix(meta, spec, get_family(spec.model_type))
    modules = {k for k in meta.state_dict() if k.startswith(f"{prefix}.")}
    experts = {k for k in modules if ".experts." in k and ".shared_experts." not in k}
    return modules, saved_names(meta, modules), saved_names(meta, experts)


def _check_names(meta: Any, adapter_dir: Path, saved: dict[str, Any], modules: set[str]) -> None:
    """Every adapter key lands (through peft's own mapping) on a language module, and a
    LoRA on a Linear is keyed by the name the checkpoint saves that Linear's weight under."""
    from peft import LoraConfig

    from moetune.model.saved_names import loaded_key_map, saved_names

    config = LoraConfig.from_pretrained(str(adapter_dir))
    where = loaded_key_map(meta, config, sorted(saved))
    assert set(where.values()) == set(saved)  # peft claims every tensor of the file
    for module_key, file_key in where.items():
        owner = _owner(module_key)
        assert any(k.startswith(f"{owner}.") for k in modules), module_key  # no tower LoRA
        names = saved_names(meta, {f"{owner}.weight"} & modules)
        if len(names) == 1 and (name := names.pop()).endswith(".weight"):  # a Linear saved whole
            assert _owner(file_key) == name.removesuffix(".weight"), file_key


def _owner(adapter_key: str) -> str:
    """The module an adapter key adapts, as the checkpoint names it."""
    stem = adapter_key.removeprefix("base_model.model.").rpartition(".lora_")[0]
    return stem.replace(".base_layer", "")


def test_the_list_is_the_installed_librarys() -> None:
    assert {"qwen3_vl_moe", "glm4v_moe", "gemma4", "qwen3_5_moe"} <= set(MULTIMODAL)
    assert "qwen3_omni_moe" in MULTIMODAL  # its language model sits under thinker_config
    assert not {t for t in MULTIMODAL if t.endswith(("_text", "_vision"))}


def test_an_omni_checkpoint_without_a_forward_is_refused_with_transformers_cause() -> None:
    from transformers import CONFIG_MAPPING

    from moetune.errors import UnknownFamilyError

    values = tiny_multimodal_config("qwen3_omni_moe")
    values.pop("model_type")
    with pytest.raises(UnknownFamilyError) as err:
        checkpoint_class(CONFIG_MAPPING["qwen3_omni_moe"](**values))
    assert "no forward of its own" in err.value.cause and "thinker" in err.value.fix


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_a_class_that_cannot_train_as_a_language_model_is_refused_with_its_cause(
    model_type: str,
) -> None:
    from transformers import CONFIG_MAPPING

    from moetune.errors import UnknownFamilyError

    values = tiny_multimodal_config(model_type)
    values.pop("model_type")
    with pytest.raises(UnknownFamilyError) as err:
        checkpoint_class(CONFIG_MAPPING[model_type](**values))
    assert REFUSED[model_type] in err.value.cause


@pytest.mark.parametrize("model_type", [_case(t) for t in MULTIMODAL if t not in REFUSED])
def test_five_steps_train_the_language_model_in_the_checkpoints_own_layout(
    model_type: str, tmp_path: Path
) -> None:
    from peft import PeftModel

    from moetune.export import ExportOptions, resolve_source, run_export
    from moetune.train.trainer import train
    from test_train_helpers import one_thread, reverse_rows, run_config, write_jsonl

    base = save_tiny_multimodal(model_type, tmp_path / "model")
    data = write_jsonl(tmp_path / "train.jsonl", reverse_rows(12))
    cfg = run_config(base, data, tmp_path / "run", max_steps=5, save_steps=5, seq_len=16)
    with one_thread():
        result = train(cfg, progress=False)
    assert (result.steps, result.coverage, result.router_changed) == (5, 1.0, False)

    meta = _meta(base)
    modules, language, experts = _language_keys(base, meta)
    adapter_dir = Path(result.adapter_dir)
    saved = _tensors(adapter_dir)
    _check_names(meta, adapter_dir, saved, modules)
    assert any(".experts" in k for k in saved)

    with one_thread(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoConfig

        cls = checkpoint_class(AutoConfig.from_pretrained(base))
        reloaded = PeftModel.from_pretrained(cls.from_pretrained(base), str(adapter_dir))
    lora = {k: v for k, v in reloaded.state_dict().items() if ".lora_" in k}
    assert len(lora) == len(saved)  # every tensor loads back (peft's init would not match)
    for key, value in lora.items():
        assert any(v.shape == value.shape and torch.equal(v, value) for v in saved.values()), key

    out = tmp_path / "merged"
    run_export(resolve_source(adapter_dir, str(base)), "merged", out, ExportOptions())
    before, after = _tensors(base), _tensors(out)
    assert before.keys() == after.keys()  # the whole multimodal checkpoint, in its layout
    assert language < before.keys()
    towers = [k for k in before if k not in language]  # towers, embeddings, head
    assert towers and all(torch.equal(before[k], after[k]) for k in towers)
    changed = [k for k in language if not torch.equal(before[k], after[k])]
    assert experts & set(changed)
    config_in, config_out = (_config(d) for d in (base, out))
    assert config_in == config_out and config_in["model_type"] == model_type


def _config(folder: Path) -> dict[str, Any]:
    """config.json less what save_pretrained itself fills in (its version, default labels)."""
    return _strip(json.loads((folder / "config.json").read_text()))


def _strip(values: Any) -> Any:
    if not isinstance(values, dict):
        return values
    dropped = ("transformers_version", "label2id", "id2label")
    return {k: _strip(v) for k, v in values.items() if k not in dropped}
