"""Model configs that cannot be real are refused before anything is built.

transformers fills a missing size field with its class default (a 4096-wide, 32-layer
model for a config.json that forgot `hidden_size`) and builds whatever it is given (a
100-million-layer meta build hangs). Both are caught here, naming the field.
"""

from __future__ import annotations

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
