"""Llama 4's multimodal checkpoint trains as `Llama4ForConditionalGeneration` (the fix for
model_type "llama4"), working around three transformers 5.24 bugs in that class:

- its `forward` builds its output from `outputs.image_outputs`, but its language model
  (`Llama4ForCausalLM`) returns a `MoeCausalLMOutputWithPast`, which has no such field:
  every call raises AttributeError, with images or without;
- it names `base_model_prefix = "model"` and holds no `model` (vision tower, projector and
  causal LM sit side by side), so it has no backbone that returns the last hidden state:
  TRL's fused LM head calls `base_model` for one and gets the whole model, or the causal LM
  (`model.derive.ensure_backbone`), whose output is logits;
- its vision tower runs on pixels in its own dtype, but `Llama4ImageProcessor` normalises
  them in bfloat16 and `get_image_features` casts nothing: a float32 model's image rows
  raise "expected scalar type Float but found BFloat16" in the patch embedding.

Both instances get a same-named subclass (parameters and state dict untouched): the causal
LM's output gains the `image_outputs` slot (None: it sees embeddings, not images); the
multimodal forward encodes the images itself (cast to the tower's dtype) and fills the slot
with the vision tower's output; its `base_model` is a view that merges the projected image
features into the token embeddings as transformers' forward does, then runs the text
decoder (the same cast on its images).
"""

from __future__ import annotations

from typing import Any

from moetune.model.fixes.registry import register_fix, same_name_subclass

_FIXED = "_moetune_llama4_fix"  # class flag: already the fixed subclass


@register_fix("llama4")
def fix_llama4(model: Any) -> int:
    """Swap in the fixed subclasses; how many instances changed (0: already fixed)."""
    swapped = 0
    for module, body in ((model, _MULTIMODAL), (model.language_model, _CAUSAL_LM)):
        fixed = same_name_subclass(type(module), body, _FIXED)
        swapped += fixed is not type(module)
        module.__class__ = fixed
    return swapped


def _causal_lm_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """`Llama4ForCausalLM.forward`, its output with the slot the multimodal forward reads."""
    # lazy: heavy to import (transformers)
    from transformers.models.llama4.modeling_llama4 import Llama4ForCausalLM

    out = Llama4ForCausalLM.forward(self, *args, **kwargs)
    if not isinstance(out, tuple):
        out.image_outputs = None  # an attribute, not a key: to_tuple() stays as shipped
    return out


def _multimodal_forward(
    self: Any,
    input_ids: Any = None,
    pixel_values: Any = None,
    *args: Any,
    mm_encoder_outputs: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Any:
    """transformers' forward on images it encoded here, their encoding kept in the output."""
    # lazy: heavy to import (transformers)
    from transformers.models.llama4.modeling_llama4 import Llama4ForConditionalGeneration

    encoded = _encoded(self, pixel_values, mm_encoder_outputs)
    out = Llama4ForConditionalGeneration.forward(
        self, input_ids, None, *args, mm_encoder_outputs=encoded, **kwargs
    )
    if not isinstance(out, tuple) and encoded.get("image") is not None:
        out["image_outputs"] = encoded["image"]
    return out


def _encoded(model: Any, pixel_values: Any, given: dict[str, Any] | None) -> dict[str, Any]:
    """The encoder outputs by modality: those given, the images' encoded where missing."""
    encoded = dict(given or {})
    if encoded.get("image") is None and pixel_values is not None:
        pixels = pixel_values.to(model.vision_model.dtype)  # the processor's are bfloat16
        encoded["image"] = model.get_image_features(pixel_values=pixels, return_dict=True)
    return encoded


def _merged(model: Any, input_ids: Any, embeds: Any, image: Any) -> Any:
    """The token embeddings with each image token's replaced by its projected vision
    feature, as `Llama4ForConditionalGeneration.forward` computes them."""
    features = image.last_hidden_state
    flat = features.view(-1, features.size(-1))
    projected = model.multi_modal_projector(flat).to(embeds.device, embeds.dtype)
    mask = model.get_placeholder_mask(input_ids, inputs_embeds=embeds, image_features=projected)
    return embeds.masked_scatter(mask, projected)


class Backbone:
    """The multimodal backbone transformers' class lacks: token embeddings with the image
    features merged in, through the text decoder (its output has `last_hidden_state`)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def __call__(
        self,
        input_ids: Any = None,
        pixel_values: Any = None,
        *,
        inputs_embeds: Any = None,
        mm_encoder_outputs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        image = _encoded(self.model, pixel_values, mm_encoder_outputs).get("image")
        if inputs_embeds is None:
            inputs_embeds = self.model.get_input_embeddings()(input_ids)
        if image is not None:
            inputs_embeds = _merged(self.model, input_ids, inputs_embeds, image)
        return self.model.language_model.model(inputs_embeds=inputs_embeds, **kwargs)

    def get_image_features(self, *args: Any, **kwargs: Any) -> Any:
        """The model's own (generate encodes images through `base_model`)."""
        return self.model.get_image_features(*args, **kwargs)


_CAUSAL_LM = {"forward": _causal_lm_forward}
_MULTIMODAL = {"forward": _multimodal_forward, "base_model": property(Backbone)}
