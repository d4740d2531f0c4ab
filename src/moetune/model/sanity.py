"""Model configs that cannot be real are refused before anything is built.

transformers fills a missing size field with its class default (a 4096-wide, 32-layer
model for a config.json that forgot `hidden_size`) and builds whatever it is given (a
100-million-layer meta build hangs). Both are caught here, naming the field, and so are
fields that contradict each other (a tiny config shrunk from a class's defaults, some sizes
left as they were): transformers builds it, and the first forward fails deep in a layer.
"""

from __future__ import annotations

import inspect
from typing import Any

from moetune.errors import ConfigError
from moetune.model.multimodal import text_dict

# fields every decoder config must state itself, and the largest value a real model has
# had (with room): a value past these is a typo, not a model
REQUIRED = ("num_hidden_layers", "hidden_size", "vocab_size", "num_attention_heads")
# the experts count under its names across families: a config class that keeps one must be
# told it (Qwen3MoeConfig would otherwise build 128 experts for a config.json that forgot it)
EXPERT_COUNTS = ("num_experts", "n_routed_experts", "num_local_experts")
LIMITS = {
    "num_hidden_layers": 10_000, "hidden_size": 1_000_000, "vocab_size": 50_000_000,
    "num_attention_heads": 100_000, "num_key_value_heads": 100_000,
    "intermediate_size": 10_000_000, "moe_intermediate_size": 10_000_000,
    "num_experts": 1_000_000, "n_routed_experts": 1_000_000, "num_local_experts": 1_000_000,
    "num_experts_per_tok": 1_000_000,
}  # fmt: skip


def check_config(raw: dict[str, Any], config: Any, name: str) -> None:
    """ConfigError naming the field when a size is missing, not positive or absurd."""
    _check_present(text_dict(raw), config, name)
    for field, limit in LIMITS.items():
        value = _read(config, field)
        if value is None:
            continue
        if not 1 <= value <= limit:
            bound = "at least 1" if value < 1 else f"at most {limit:,} (no real model has more)"
            raise ConfigError(
                f"{name}: config.json has {field}={value:,}; it must be {bound}",
                f"correct {field} in config.json",
            )
    for check in CONSISTENCY:
        found = check(config)
        if found:
            raise ConfigError(f"{name}: config.json has {found[0]}", found[1])


def _check_present(raw: dict[str, Any], config: Any, name: str) -> None:
    aliases = getattr(config, "attribute_map", None) or {}  # standard name -> the config's
    stored = config.to_dict()  # fields the config keeps (not ones it derives, e.g. layers
    missing = [  # from nemotron_h's hybrid pattern)
        f for f in REQUIRED
        if aliases.get(f, f) in stored and f not in raw and aliases.get(f, f) not in raw
    ]  # fmt: skip
    missing += _missing_experts(raw, config, stored, aliases)
    if missing:
        raise ConfigError(
            f"{name}: config.json does not state {', '.join(missing)} (transformers would "
            f"silently use its {config.model_type} defaults)",
            "use the model's own config.json, with every size field set",
        )


def _missing_experts(
    raw: dict[str, Any], config: Any, stored: dict[str, Any], aliases: dict[str, str]
) -> list[str]:
    """The experts count's name when the config keeps one and config.json states none."""
    kept = [f for f in EXPERT_COUNTS if aliases.get(f, f) in stored]
    given = any(f in raw or aliases.get(f, f) in raw for f in EXPERT_COUNTS)
    if not kept or given or not _read(config, kept[0]):
        return []
    return [f"{kept[0]} (the experts count)"]


def _read(config: Any, field: str) -> int | None:
    try:
        value = getattr(config, field, None)
    except AttributeError:  # a heterogeneous config refusing a global read
        return None
    if isinstance(value, list | tuple):
        value = max(value, default=None) if all(isinstance(v, int) for v in value) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# -- fields that must agree: each check returns (what disagrees, how to fix it) or None

_GROUPS = ("n_group", "num_expert_group")  # group-limited routing: experts split in groups


def _experts(config: Any) -> tuple[str, int] | None:
    return next(((_named(config, f), v) for f in EXPERT_COUNTS if (v := _read(config, f))), None)


def _named(config: Any, field: str) -> str:
    """The name config.json stores `field` under (an alias resolves to it)."""
    return str((getattr(config, "attribute_map", None) or {}).get(field, field))


def _groups(config: Any) -> tuple[str, str] | None:
    """Routing groups must split the experts evenly, and top-k of them must exist (the
    router views its scores as groups × experts-per-group)."""
    experts, group = _experts(config), next((f for f in _GROUPS if _read(config, f)), None)
    if experts is None or group is None:
        return None
    groups, top = _read(config, group) or 1, _read(config, "topk_group") or 1
    group = _named(config, group)
    if experts[1] % groups:
        return (
            f"{experts[0]}={experts[1]}, not a multiple of {group}={groups} (the router "
            "splits the experts into equal groups)",
            f"set {group} to a divisor of {experts[1]} (1: no grouping), or change {experts[0]}",
        )
    if top > groups:
        return (f"topk_group={top} of {group}={groups} groups", f"set topk_group ≤ {groups}")
    return None


def _rope_width(config: Any) -> tuple[str, str] | None:
    """Multi-head latent attention rotates qk_rope_head_dim channels of each head, with a
    rotary embedding head_dim × partial_rotary_factor wide: the two must be equal."""
    rope, head = _read(config, "qk_rope_head_dim"), _read(config, "head_dim")
    factor = _rotary_factor(config)
    if not rope or not head or factor is None or int(head * factor) == rope:
        return None
    return (
        f"head_dim × partial_rotary_factor = {head} × {factor:g} = {int(head * factor)} "
        f"rotary channels, but qk_rope_head_dim={rope} (attention rotates that many)",
        f"set head_dim to {rope / factor:g} (qk_rope_head_dim / partial_rotary_factor)",
    )


def _rope_params(config: Any) -> dict[str, Any] | None:
    """config.rope_parameters, or None when absent or given per layer type."""
    params = getattr(config, "rope_parameters", None) or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        return None
    return params


def _rotary_factor(config: Any) -> float | None:
    """The rotary embedding's partial_rotary_factor (1.0 when unset); None for per-layer-type
    rope parameters, which latent attention does not use."""
    params = _rope_params(config)
    if params is None:
        return None
    factor = params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", None)
    return float(factor or 1.0)


def _sliding_window(config: Any) -> tuple[str, str] | None:
    """Sliding-attention layers need the window they slide over (transformers' mask raises
    "Could not find a `sliding_window` argument" on the first forward)."""
    sliding = list(getattr(config, "layer_types", None) or ()).count("sliding_attention")
    if not sliding or getattr(config, "sliding_window", None) is not None:
        return None
    return (
        f"{sliding} sliding_attention layers but sliding_window is null",
        "set sliding_window (the span those layers attend over), or make them full_attention",
    )


CONSISTENCY = (_groups, _rope_width, _sliding_window)  # a top-k past the experts: summary.py


def check_build(model: Any, name: str) -> None:
    """ConfigError when a module of the meta build (its shapes are known, no memory used)
    contradicts another: the first forward would fail deep inside it."""
    for path, module in model.named_modules():
        for check in BUILD_CHECKS:
            found = check(module, model.config)
            if found:
                raise ConfigError(f"{name}: config.json gives {path} {found[0]}", found[1])


def _kv_heads(module: Any, config: Any) -> tuple[str, str] | None:
    """More key/value heads than query heads (mimo_v2_flash's sliding layers double
    num_key_value_heads): no query head per group."""
    if getattr(module, "num_key_value_groups", None) != 0:
        return None
    heads, kv = _read(config, "num_attention_heads"), _read(config, "num_key_value_heads")
    return (
        f"fewer query heads than key/value heads (num_attention_heads={heads}, "
        f"num_key_value_heads={kv})",
        "set num_key_value_heads to a divisor of num_attention_heads that this layer's kind "
        "keeps (some families double it on sliding-window layers)",
    )


def _latent_kv_heads(module: Any, config: Any) -> tuple[str, str] | None:
    """Latent attention (kv_b_proj) expands its compressed keys and values to one head per
    query head; repeating them for fewer key/value heads doubles them past the queries."""
    groups = getattr(module, "num_key_value_groups", None)
    if not hasattr(module, "kv_b_proj") or groups in (None, 1):
        return None
    heads, kv = _read(config, "num_attention_heads"), _read(config, "num_key_value_heads")
    return (
        f"latent attention with num_key_value_heads={kv} for num_attention_heads={heads} "
        "(kv_b_proj makes a key/value head per query head)",
        f"set num_key_value_heads to num_attention_heads ({heads})",
    )


def _mrope_split(module: Any, config: Any) -> tuple[str, str] | None:
    """A rotary embedding that splits its frequencies into (temporal, height, width)
    sections (glm4v_moe's, default (8, 12, 12)) needs them to sum to their count; those
    that interleave them (Qwen3-VL's) take any sections."""
    sections, inv_freq = getattr(module, "mrope_section", None), getattr(module, "inv_freq", None)
    if not sections or inv_freq is None or sum(sections) == inv_freq.shape[-1]:
        return None
    if not _splits_sections(type(module)):
        return None  # its sections interleave: any sum works
    return (
        f"rotary sections mrope_section={list(sections)} summing to {sum(sections)}, but "
        f"{inv_freq.shape[-1]} rotary frequencies (head_dim × partial_rotary_factor / 2)",
        f"set rope_parameters.mrope_section to sections summing to {inv_freq.shape[-1]}",
    )


def _splits_sections(cls: type) -> bool:
    """The class's source splits the frequencies by its sections (read once a class)."""
    if cls not in _SPLITS:
        _SPLITS[cls] = "split(self.mrope_section" in inspect.getsource(cls)
    return _SPLITS[cls]


_SPLITS: dict[type, bool] = {}


BUILD_CHECKS = (_kv_heads, _latent_kv_heads, _mrope_split)
