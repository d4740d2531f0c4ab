"""Which MoE model types the installed transformers ships, and a tiny config of each.

Nothing here is a hand list of families: the model types come from transformers' own
config registry, and a type is a decoder MoE when a tiny build of its causal-LM class has
routed experts. A newer transformers brings its new families in by itself.
"""

from __future__ import annotations

import inspect
import re
from functools import lru_cache
from typing import Any

from moetune.errors import MoetuneError
from moetune.model.derive import derive
from moetune.model.hf_config import quiet_transformers
from moetune.model.multimodal import text_dict, text_keys
from moetune.model.textlm import modeling_module

# tiny values by field name (set where the config has the field)
_TINY: dict[str, int] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 128, "max_position_embeddings": 256,
    "intermediate_size": 48, "moe_intermediate_size": 32, "intermediate_size_mlp": 48,
    "shared_expert_intermediate_size": 32, "ffn_hidden_size": 48, "expert_ffn_hidden_size": 32,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2,
    "moe_top_k": 2, "top_k": 2, "n_group": 1, "topk_group": 1, "num_group": 1,
    "num_expert_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
    "linear_value_head_dim": 16, "mamba_num_heads": 4, "mamba_n_heads": 4,
    "mamba_head_dim": 16, "mamba_d_head": 16, "ssm_state_size": 16, "mamba_d_state": 16,
    "n_groups": 1, "mamba_n_groups": 1, "time_step_rank": 8, "mamba_dt_rank": 8,
    "sliding_window": 32, "attention_chunk_size": 32, "num_nextn_predict_layers": 0,
}  # fmt: skip
_TOP_K = ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k",
          "top_k")  # fmt: skip
# fields a default config leaves unset that its model needs (filled only when None)
_FILL: dict[str, int] = {
    "head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "indexer_n_heads": 2,
    "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
    "indexer_compress_ratio": 4, "sliding_window": 32,
}  # fmt: skip
_LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers")
_SIZE_NAME = re.compile(r"(size|dim|rank|width)s?$")
MAX_LAYERS = 4


def _shrink_int(key: str, value: int) -> int:
    """A tiny value for an integer size field the table does not name."""
    if key in _TOP_K:
        return min(value, 2)
    if key in _TINY:
        return _TINY[key] if value > 0 else value
    if "vocab" in key:
        return _TINY["vocab_size"]
    if key.endswith("_token_id"):
        return value if value < _TINY["vocab_size"] else _TINY["vocab_size"] - 1
    if _SIZE_NAME.search(key) and value > 64:
        return 32 if "head" not in key else 16
    if key.endswith("heads") and value > 4:
        return 4
    return value


def _cut(per_layer: list[Any] | str, layers: int) -> list[Any] | str:
    """The first `layers` entries, the last ones swapped for kinds the cut would lose (a
    hybrid model keeps one layer of each mixer or MLP kind)."""
    kept = list(per_layer[:layers])
    if not all(isinstance(k, str) for k in per_layer):  # indices or flags: a plain cut
        return kept
    missing = [k for k in dict.fromkeys(per_layer) if k not in kept][: max(0, layers - 1)]
    if missing:
        kept[layers - len(missing) :] = missing
    return "".join(kept) if isinstance(per_layer, str) else kept


def shrink(values: dict[str, Any], max_layers: int = MAX_LAYERS) -> dict[str, Any]:
    """A tiny copy of a config dict: sizes shrunk, layer lists cut to at most 4 layers."""
    old_layers = next((values[k] for k in _LAYER_FIELDS if isinstance(values.get(k), int)), 0)
    layers = min(old_layers, max_layers) if old_layers else 0
    out: dict[str, Any] = {}
    for key, value in values.items():
        if value is None:
            out[key] = _FILL.get(key)
        elif isinstance(value, bool):
            out[key] = value
        elif key in _LAYER_FIELDS and isinstance(value, int):
            out[key] = layers
        elif isinstance(value, int):
            out[key] = _shrink_int(key, value)
        elif (
            isinstance(value, list | str)
            and old_layers > layers
            and len(value) == old_layers
            and (isinstance(value, list) or "pattern" in key)  # not a name of that length
        ):
            out[key] = _cut(value, layers)  # per-layer lists / patterns
        elif (
            isinstance(value, list)
            and key.endswith("layers")
            and all(isinstance(i, int) for i in value)
        ):
            out[key] = [i for i in value if i < layers]  # layer-index lists
        elif key.endswith("_token_id") and isinstance(value, list):
            out[key] = [_shrink_int(key, v) for v in value if isinstance(v, int)]
        elif isinstance(value, dict) and key in ("attn_config", "ffn_config"):
            out[key] = shrink(value)  # dbrx's nested sub-configs
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            out[key] = _per_layer(value, layers)
        else:
            out[key] = value
    if "kv_lora_rank" in out and "num_key_value_heads" in out:
        out["num_key_value_heads"] = out["num_attention_heads"]  # MLA: a kv head per query head
    if values.get("head_dim") and values.get("head_dim") == values.get("qk_rope_head_dim"):
        out["head_dim"] = out["qk_rope_head_dim"]  # MLA families rotate head_dim channels
    return out


def _per_layer(values: dict[str, Any], layers: int) -> dict[str, Any]:
    """A per-layer dict (dots3's `per_layer_config`) cut to `layers`, each layer's own
    overrides shrunk too: full-size head counts there break the cross-field checks."""
    kept = {k: v for k, v in values.items() if int(k) < layers}
    return {k: shrink(v) if isinstance(v, dict) else v for k, v in kept.items()}


def shrunk_config(model_type: str) -> dict[str, Any]:
    """A tiny config.json dict for any `model_type`: transformers' defaults shrunk
    (multimodal: its text_config too). model.tiny.tiny_config holds the hand-written ones."""
    # lazy: heavy to import (transformers)
    from transformers import CONFIG_MAPPING

    with quiet_transformers():
        defaults = CONFIG_MAPPING[model_type]().to_dict()
    out = shrink(defaults)
    if isinstance(defaults.get("text_config"), dict):
        out["text_config"] = shrink(defaults["text_config"])
    for key, value in defaults.items():  # a language model one level down (omni thinkers)
        if isinstance(value, dict) and isinstance(value.get("text_config"), dict):
            out[key] = {**value, "text_config": shrink(value["text_config"])}
    _merge(out, _OVERRIDES.get(model_type, {}))
    for key in ("transformers_version", "architectures"):
        out.pop(key, None)
    out["model_type"] = model_type
    return out


def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


# Per model type, what the generic shrink cannot infer: cross-field rules a config
# validator enforces, or defaults that build a dense model.
_OVERRIDES: dict[str, dict[str, Any]] = {
    "doge": {"is_moe": True, "num_experts": 16},
    "dbrx": {"attn_config": {"rope_theta": 500000.0, "clip_qkv": 8.0}},
    "dots1": {"n_shared_experts": 1},
    "dots3_note_text": {"num_key_value_heads": 4, "head_dim": 16},
    # its defaults leave the MoE sizes None (no default build at all)
    "diffusion_gemma_text": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32},
    "diffusion_gemma": {"text_config": {"num_experts": 4, "top_k_experts": 2,
                                        "moe_intermediate_size": 32}},
    "gemma4_text": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                    "moe_intermediate_size": 32},
    "gemma4": {"text_config": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                               "moe_intermediate_size": 32}},
    "hy_v4_vl_text": {"rope_parameters": {"mrope_section": [2, 1, 1]}},
    "hy_v4_vl": {"text_config": {"rope_parameters": {"mrope_section": [2, 1, 1]}}},
    "glm4v_moe": {"text_config": {"rope_parameters": {"mrope_section": [2, 1, 1]}}},
    "glm4v_moe_text": {"rope_parameters": {"mrope_section": [2, 1, 1]}},
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv", "full_attention"],
                 "num_dense_layers": 1},
    "granitemoehybrid": {"mamba_d_head": 32},
    "glm5_next": {"text_config": {"num_key_value_heads": 4, "index_kpool": 4}},
    "glm5_next_text": {"num_key_value_heads": 4, "index_kpool": 4},
    "inkling2": {"vision_config": {"text_hidden_size": 64}},
    "inkling2_loop": {"vision_config": {"text_hidden_size": 64}},
    # the SAM feature map enters the vision encoder as its patch embeddings
    "unlimited_ocr": {"vision_config": {"sam_config": {"downsample_channels": [32, 64]}}},
    # the adapter reads the tower's merged patches: hidden_size x merge_size**2 wide
    "muse_spark": {"audio_config": {"out_hidden_size": 64},
                   "vision_config": {"out_hidden_size": 64}, "out_hidden_size": 64 * 2 * 2},
}  # fmt: skip


@lru_cache(maxsize=1)
def census() -> dict[str, str]:
    """model_type -> "moe" | "multimodal" (a text_config that is one) | why it is not
    buildable as a decoder MoE, over every config type the installed transformers has
    whose config or modeling code mentions experts."""
    # lazy: heavy to import (transformers)
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out: dict[str, str] = {}
    for model_type in sorted(CONFIG_MAPPING_NAMES):  # shipped ones, not registered remote code
        if _mentions_experts(model_type):
            out[model_type] = _status(model_type)
    return out


def moe_model_types() -> list[str]:
    """Decoder MoE model types of the installed transformers (text models)."""
    return [t for t, s in census().items() if s == "moe"]


def multimodal_model_types() -> list[str]:
    """Top-level multimodal types whose language model is a decoder MoE."""
    return [t for t, s in census().items() if s == "multimodal"]


_EXPERT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts",
                  "num_local_experts")  # fmt: skip


def _mentions_experts(model_type: str) -> bool:
    # lazy: heavy to import (transformers)
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    classes = [cls, *(getattr(cls, "sub_configs", None) or {}).values()]
    if any(_config_fields(c) & set(_EXPERT_FIELDS) for c in classes if isinstance(c, type)):
        return True
    module = modeling_module(cls)
    return module is not None and "use_experts_implementation" in inspect.getsource(module)


def _config_fields(cls: type) -> set[str]:
    fields: set[str] = set()
    for klass in cls.__mro__:
        fields |= set(getattr(klass, "__annotations__", {}))
        fields |= set(getattr(klass, "attribute_map", None) or {})
    return fields


def _status(model_type: str) -> str:
    try:
        derived = derive(shrunk_config(model_type), model_type)
    except MoetuneError as exc:
        return exc.cause
    except Exception as exc:  # a config class that cannot even be instantiated by default
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if not derived.spec.is_moe:
        return "builds without routed experts at its defaults"
    return "multimodal" if derived.spec.model_type != model_type else "moe"


# tower fields whose width must be the language model's hidden size (the projector's output)
_TEXT_WIDTHS = ("out_hidden_size", "text_hidden_size", "output_dim", "thinker_hidden_size")
_TOWER_DEPTHS = ("depth", "encoder_layers")


def tiny_multimodal_config(model_type: str) -> dict[str, Any]:
    """`shrunk_config` of a multimodal type with its towers tiny too (one layer each, every
    sub-config transformers leaves unset filled in): a checkpoint of transformers' own
    multimodal class that builds and trains in seconds."""
    # lazy: heavy to import (transformers)
    from transformers import CONFIG_MAPPING

    out = shrunk_config(model_type)
    with quiet_transformers():
        for name, sub in (getattr(CONFIG_MAPPING[model_type], "sub_configs", None) or {}).items():
            if out.get(name) is None and isinstance(sub, type):  # e.g. gemma4's vision tower
                out[name] = shrink(sub().to_dict())
    keep = text_keys(out)
    hidden = text_dict(out).get("hidden_size", _TINY["hidden_size"])
    return _tiny_towers(out, keep, hidden)


def _tiny_towers(values: dict[str, Any], keep: tuple[str, ...], hidden: int) -> dict[str, Any]:
    out = dict(values)
    for key, value in values.items():
        if not (key.endswith("_config") and isinstance(value, dict)):
            continue
        if keep and key == keep[0]:  # the language model (or the sub-model holding it)
            out[key] = value if len(keep) == 1 else _tiny_towers(value, keep[1:], hidden)
        else:
            out[key] = _tiny_tower(value, hidden)
    return out


def _tiny_tower(values: dict[str, Any], hidden: int) -> dict[str, Any]:
    """A tower (or a talker, its sub-configs included) cut to one layer."""
    out = shrink(values, max_layers=1)
    for key, value in out.items():
        if key.endswith("_config") and isinstance(value, dict):
            out[key] = _tiny_tower(value, hidden)
        elif key in _TOWER_DEPTHS and isinstance(value, int):
            out[key] = 1
        elif key in _TEXT_WIDTHS and isinstance(value, int):
            out[key] = hidden
        elif key.endswith(("indexes", "indices")) and isinstance(value, list):
            out[key] = [i for i in value if isinstance(i, int) and i < 1]
    return out
