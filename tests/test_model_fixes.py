"""moetune.model.fixes.registry: each transformers bug a fix works around is still in the installed
transformers (probes: a fixed release fails them, and the fix is removed), and the fixed
model computes what transformers' own code computes, with its state dict untouched."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from moetune.model.census import tiny_multimodal_config
from moetune.model.derive import checkpoint_class, ensure_backbone
from moetune.model.fixes.registry import MODEL_FIXES, apply_fixes

pytestmark = pytest.mark.filterwarnings("ignore")
IMAGE_TOKEN = 100  # inside the tiny text vocabulary (128), so image tokens embed


def _build(model_type: str, **changes: Any) -> Any:
    """transformers' multimodal class of the census' tiny config, random weights (seeded)."""
    from transformers import CONFIG_MAPPING

    values = tiny_multimodal_config(model_type)
    values.pop("model_type")
    values.update(changes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CONFIG_MAPPING[model_type](**values)
        torch.manual_seed(0)
        return checkpoint_class(config)._from_config(config, dtype=torch.float32).eval()


def _llama4() -> Any:
    """Llama 4 whose vision tower takes one 28×28 image (2×2 patches, pixel-shuffled to one
    feature): the census config's tower is consistent only for counting, not for a forward."""
    vision = tiny_multimodal_config("llama4")["vision_config"]
    vision.update(intermediate_size=256, image_size=28)  # hidden 64 / pixel_shuffle_ratio²
    return _build("llama4", vision_config=vision, image_token_index=IMAGE_TOKEN)


def _image_batch() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1, 2, IMAGE_TOKEN, 3, 4, 5]])
    torch.manual_seed(1)
    return {"input_ids": ids, "pixel_values": torch.randn(1, 3, 28, 28)}


def test_the_fixes_are_registered_by_top_level_model_type() -> None:
    assert {"llama4", "qwen3_omni_moe_thinker", "step3p5", "step3p7"} <= set(MODEL_FIXES)
    assert "llama4_text" not in MODEL_FIXES  # Llama4ForCausalLM trains as shipped


def test_probe_llama4_multimodal_forward_and_backbone_are_still_broken() -> None:
    model = _llama4()
    with pytest.raises(AttributeError, match="image_outputs"):
        model(input_ids=_image_batch()["input_ids"])  # text only: the same failure
    assert model.base_model_prefix == "model" and "model" not in dict(model.named_children())
    assert model.base_model is model  # no backbone; ensure_backbone's is the causal LM:
    out = ensure_backbone(model).base_model(input_ids=_image_batch()["input_ids"])
    assert "logits" in out and "last_hidden_state" not in out


def test_llama4_fix_keeps_class_name_and_state_dict_and_applies_once() -> None:
    model = _llama4()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert apply_fixes(model) == 2  # the multimodal class and its causal LM
    assert apply_fixes(model) == 0 and apply_fixes(model.language_model) == 0
    assert type(model).__name__ == "Llama4ForConditionalGeneration"
    assert not type(model).is_custom_code()  # its module is transformers' own
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_llama4_backbone_merges_images_as_transformers_forward_does() -> None:
    model = _llama4()
    apply_fixes(model)
    batch = _image_batch()
    with torch.no_grad():
        out = model(**batch, labels=batch["input_ids"])
        hidden = model.base_model(**batch).last_hidden_state
        text_only = model(input_ids=batch["input_ids"]).logits
        image = model.get_image_features(pixel_values=batch["pixel_values"], return_dict=True)
    head = model.get_output_embeddings()
    assert (head(hidden) - out.logits).abs().max().item() < 1e-5  # TRL's fused head path
    assert (text_only - out.logits).abs().max().item() > 1e-2  # the image reached the LM
    assert torch.equal(out.image_outputs.last_hidden_state, image.last_hidden_state)
    assert torch.isfinite(out.loss) and out.loss.item() > 0


def test_probe_llama4_tower_still_takes_no_bfloat16_pixels_and_the_fix_casts_them() -> None:
    model = _llama4()
    pixels = _image_batch()["pixel_values"].to(torch.bfloat16)  # Llama4ImageProcessor's dtype
    with torch.no_grad(), pytest.raises(RuntimeError, match="BFloat16"):
        model.get_image_features(pixel_values=pixels)
    apply_fixes(model)
    ids = _image_batch()["input_ids"]
    with torch.no_grad():
        half = model(input_ids=ids, pixel_values=pixels).logits
        full = model(input_ids=ids, pixel_values=pixels.float()).logits
        hidden = model.base_model(input_ids=ids, pixel_values=pixels).last_hidden_state
    assert torch.equal(half, full)  # the same pixels, cast to the tower's float32
    assert (model.get_output_embeddings()(hidden) - full).abs().max().item() < 1e-5


def test_probe_omni_thinker_config_still_lacks_vision_start_token_id() -> None:
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as omni

    assert not hasattr(omni.Qwen3OmniMoeThinkerConfig(), "vision_start_token_id")
    assert omni.Qwen3OmniMoeTalkerConfig.vision_start_token_id == 151652  # the fix's value
    model = _build("qwen3_omni_moe_thinker")
    ids = torch.tensor([[1, 2, 3, 4]])
    with pytest.raises(AttributeError, match="vision_start_token_id"):
        model(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_omni_fix_fills_the_field_and_a_masked_text_row_scores_as_unmasked() -> None:
    model = _build("qwen3_omni_moe_thinker")
    assert apply_fixes(model) >= 1 and apply_fixes(model) == 0
    assert model.config.vision_start_token_id == 151652
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        masked = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        plain = model(input_ids=ids).logits  # the path that never read the field
    assert masked.shape == (1, 4, model.config.text_config.vocab_size)
    assert (masked - plain).abs().max().item() < 1e-5  # text rows: 1-D positions either way


def test_omni_fix_keeps_a_vision_start_token_id_the_config_states() -> None:
    model = _build("qwen3_omni_moe_thinker", vision_start_token_id=7)
    assert apply_fixes(model) == 0 and model.config.vision_start_token_id == 7


def _step3p5(**changes: Any) -> Any:
    """Step-3.5's causal LM from the census' tiny config, every layer full attention, and
    no window (its config class's default) unless `changes` state one."""
    from transformers import CONFIG_MAPPING

    from moetune.model.census import shrunk_config

    values = {**shrunk_config("step3p5"), "sliding_window": None, **changes}
    values.pop("model_type")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = CONFIG_MAPPING["step3p5"](**values)
        torch.manual_seed(0)
        return checkpoint_class(config)._from_config(config, dtype=torch.float32).eval()


def test_probe_step3p5_builds_a_sliding_mask_with_no_sliding_layer() -> None:
    model = _step3p5()
    assert "sliding_attention" not in model.config.layer_types
    with pytest.raises(ValueError, match="sliding_window"):
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))


def test_step3p5_fix_fills_a_window_no_layer_reads() -> None:
    model, stated = _step3p5(), _step3p5(sliding_window=2)  # same seed, same weights
    assert apply_fixes(model) == 1 and apply_fixes(model) == 0
    assert model.config.sliding_window == model.config.max_position_embeddings
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, stated(input_ids=ids).logits)


def test_step3p5_fix_keeps_a_window_the_config_states() -> None:
    model = _step3p5(sliding_window=2)
    assert apply_fixes(model) == 0 and model.config.sliding_window == 2
