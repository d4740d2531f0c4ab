"""Step-3.5 (model_type "step3p5") and Step-3.7 ("step3p7", its image-text checkpoint) train
with the config they were saved with, working around a transformers 5.24 bug in
`Step3p7TextModel.forward`: it builds the sliding-window mask on every call, whether or not a
layer is a `"sliding_attention"` one, and `create_sliding_window_causal_mask` raises
"Could not find a `sliding_window` argument in the config" when `sliding_window` is None –
which is `Step3p7TextConfig`'s default, with every layer `"full_attention"`. A config.json
saved from the defaults (sizes shrunk, layers all full) fails before its first layer.

The fix fills `sliding_window` on the loaded model's text configs whose layers are all full
attention and that state none, with the model's context length: the mask it then builds
is the causal mask, and no layer reads it. A config with sliding layers and no window is
refused before the build (model.sanity); one that states a window keeps it. The checkpoint's
files are not touched: a merged export writes config.json as it was.
"""

from __future__ import annotations

from typing import Any

from moetune.model.fixes.registry import register_fix

FIELD = "sliding_window"
SLIDING = "sliding_attention"


@register_fix("step3p5")
@register_fix("step3p7")
def fix_step3p7(model: Any) -> int:
    """Fill the window on each all-full-attention text config lacking one; how many."""
    # lazy: heavy to import (transformers)
    from transformers.models.step3p7.configuration_step3p7 import Step3p7TextConfig

    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    lacking = [
        c
        for c in configs.values()
        if isinstance(c, Step3p7TextConfig) and needs_window(c)
    ]  # fmt: skip
    for config in lacking:
        setattr(config, FIELD, config.max_position_embeddings)
    return len(lacking)


def needs_window(config: Any) -> bool:
    """No window stated and no layer that would use one (the mask is built all the same)."""
    return getattr(config, FIELD, None) is None and SLIDING not in (config.layer_types or ())
