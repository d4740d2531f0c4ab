"""Qwen3-Omni's thinker trains as `Qwen3OmniMoeThinkerForConditionalGeneration` (the fix
for model_type "qwen3_omni_moe_thinker"), working around a transformers 5.24 bug:
`get_rope_index` reads `config.vision_start_token_id` on every call that has an attention
mask, and `Qwen3OmniMoeThinkerConfig` has no such field (its talker's config has), so a
thinker config.json without it – one saved by the thinker's own `save_pretrained` – fails
with AttributeError before the first layer, text rows included.

The fix fills the field on the loaded model's config objects that lack it, with transformers'
own value for that token in the same vocabulary (`Qwen3OmniMoeTalkerConfig`'s default,
`<|vision_start|>`); a config.json that states it keeps its own. The checkpoint's files are
not touched: a merged export writes config.json as it was.
"""

from __future__ import annotations

from typing import Any

from moetune.model.fixes.registry import register_fix

FIELD = "vision_start_token_id"


@register_fix("qwen3_omni_moe_thinker")
def fix_omni_thinker(model: Any) -> int:
    """Fill the missing field on each thinker config the model's modules read; how many."""
    # lazy: heavy to import (transformers)
    from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as omni

    value = omni.Qwen3OmniMoeTalkerConfig.vision_start_token_id
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    lacking = [
        c
        for c in configs.values()
        if isinstance(c, omni.Qwen3OmniMoeThinkerConfig) and not hasattr(c, FIELD)
    ]
    for config in lacking:
        setattr(config, FIELD, value)
    return len(lacking)
