"""Shared helpers for the family modules: reading a config and counting parameters.

Counts are closed-form (shape arithmetic); a test checks each family against a meta-device
build of the real transformers model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from moetune.errors import ConfigError
from moetune.model.spec import Components, ModelSpec

# Keys moetune adds to catalog files, and checkpoint-only settings that must not reach a
# bf16 build (from_config would try to set up the quantizer).
PRIVATE_KEYS = ("_moetune",)
CHECKPOINT_ONLY_KEYS = ("quantization_config",)


def hf_config_object(model_type: str, cfg: dict[str, Any], name: str = "custom") -> Any:
    """The transformers config for `cfg`: its defaults and attribute_map aliases applied.

    Raises ConfigError when transformers rejects a field, so a bad config.json is reported
    with the model name instead of a traceback.
    """
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    kwargs = {
        k: plain_floats(v) for k, v in cfg.items() if k != "model_type" and k not in PRIVATE_KEYS
    }
    try:
        with quiet_transformers():
            return AutoConfig.for_model(model_type, **kwargs)
    except (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError) as exc:
        # the strict-dataclass message puts the field on line 1 and the cause on line 2
        first = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(
            f"{name}: config.json is not a valid {model_type} config ({first})",
            "correct the field named above, or re-download the model's config.json",
        ) from exc


def plain_floats(value: Any) -> Any:
    """to_dict writes inf / nan as {"__float__": "Infinity"}; the config takes floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: plain_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_floats(v) for v in value]
    return value


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """Config-sanity warnings (e.g. eos id outside a tiny vocab) are noise when planning."""
    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


class Cfg:
    """Reads one model's config the way transformers builds it (defaults and aliases)."""

    def __init__(self, model_type: str, raw: dict[str, Any], name: str) -> None:
        self.model_type = model_type
        self.raw = raw
        self.name = name
        self.hf = hf_config_object(model_type, raw, name)

    def get(self, *names: str, default: Any = None) -> Any:
        """First of `names` that is set (not None) on the transformers config, else default."""
        for n in names:
            value = getattr(self.hf, n, None)
            if value is not None:
                return value
        return default

    def num(self, *names: str, default: int | None = None) -> int:
        value = self.get(*names, default=default)
        if value is None or isinstance(value, bool):
            raise ConfigError(
                f"{self.name}: config.json has no usable {' / '.join(names)} ({self.model_type})",
                f"add {names[0]} to config.json",
            )
        try:
            return int(value)
        except (TypeError, ValueError):
            raise ConfigError(
                f"{self.name}: {names[0]} must be an integer, got {value!r}",
                f"set {names[0]} to an integer in config.json",
            ) from None

    def flag(self, *names: str, default: bool = False) -> bool:
        return bool(self.get(*names, default=default))

    def nums(self, name: str) -> tuple[int, ...]:
        """A list-valued field (e.g. mlp_only_layers) as a tuple; missing -> ()."""
        value = self.get(name, default=())
        return tuple(int(v) for v in value)


@dataclass(frozen=True)
class Dims:
    """The sizes every decoder-only transformer has."""

    hidden: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool

    @classmethod
    def read(cls, c: Cfg) -> Dims:
        hidden = c.num("hidden_size")
        heads = c.num("num_attention_heads")
        return cls(
            hidden=hidden,
            layers=c.num("num_hidden_layers"),
            vocab=c.num("vocab_size"),
            heads=heads,
            kv_heads=c.num("num_key_value_heads", default=heads),
            # transformers: `getattr(config, "head_dim", None) or hidden // heads`
            head_dim=c.num("head_dim", default=hidden // heads),
            tied=c.flag("tie_word_embeddings"),
        )


@dataclass(frozen=True)
class Moe:
    """What the routed and shared experts look like (0s for a dense model)."""

    experts: int = 0
    top_k: int = 0
    expert_size: int = 0
    shared: int = 0
    shared_size: int = 0
    dense_size: int = 0


# --- parameter arithmetic -----------------------------------------------------------


def linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def glu(hidden: int, inter: int, bias: bool = False) -> int:
    """gate_proj + up_proj + down_proj."""
    return 2 * linear(hidden, inter, bias) + linear(inter, hidden, bias)


def gqa(d: Dims, qkv_bias: bool = False, o_bias: bool = False) -> int:
    """q/k/v/o projections of grouped-query attention."""
    q = linear(d.hidden, d.heads * d.head_dim, qkv_bias)
    kv = 2 * linear(d.hidden, d.kv_heads * d.head_dim, qkv_bias)
    return q + kv + linear(d.heads * d.head_dim, d.hidden, o_bias)


def fused_experts(experts: int, hidden: int, inter: int, bias: bool = False) -> int:
    """gate_up_proj [E, 2I, H] + down_proj [E, H, I] (+ per-expert biases)."""
    per_expert = 3 * hidden * inter + ((2 * inter + hidden) if bias else 0)
    return experts * per_expert


def embeddings_and_head(d: Dims, head_bias: bool = False) -> Components:
    """Token embeddings plus lm_head; a tied lm_head shares the embedding weight."""
    head = (0 if d.tied else d.vocab * d.hidden) + (d.vocab if head_bias else 0)
    return Components(embeddings=d.vocab * d.hidden, lm_head=head)


# --- layer placement ----------------------------------------------------------------


def every_layer(d: Dims, moe: Moe) -> tuple[int, ...]:
    return tuple(range(d.layers)) if moe.experts > 0 else ()


def after_first_k(d: Dims, first_k: int) -> tuple[int, ...]:
    """DeepSeek/GLM: `layer_idx >= first_k_dense_replace` is MoE."""
    return tuple(range(first_k, d.layers))


def qwen_sparse_layers(c: Cfg, d: Dims, experts: int) -> tuple[int, ...]:
    """Qwen2/3-MoE: every `decoder_sparse_step`-th layer, minus `mlp_only_layers`."""
    if experts <= 0:
        return ()
    step = c.num("decoder_sparse_step", default=1)
    dense = set(c.nums("mlp_only_layers"))
    return tuple(i for i in range(d.layers) if i not in dense and (i + 1) % step == 0)


# --- assembly -----------------------------------------------------------------------


def uniform_layers(
    num_layers: int,
    moe_layers: Iterable[int],
    common: Components,
    dense: Components,
    sparse: Components,
) -> Components:
    """Sum of all layers: `common` in each, then `sparse` in MoE layers, `dense` elsewhere."""
    n_moe = len(set(moe_layers))
    return common.times(num_layers) + sparse.times(n_moe) + dense.times(num_layers - n_moe)


def active_params(total: int, routed: int, moe: Moe) -> int:
    """Total minus the routed experts a token does not visit (top_k of E per MoE layer)."""
    if moe.experts <= 0 or routed == 0:
        return total
    per_expert_total = routed // moe.experts  # all MoE layers together
    return total - per_expert_total * (moe.experts - moe.top_k)


def hf_dict(raw: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The config dict transformers builds the (bf16) model from."""
    drop = (*PRIVATE_KEYS, *CHECKPOINT_ONLY_KEYS)
    out = {k: v for k, v in raw.items() if k not in drop}
    out["model_type"] = model_type
    return out


def quant_method(raw: dict[str, Any]) -> str | None:
    q = raw.get("quantization_config")
    return str(q.get("quant_method")) if isinstance(q, dict) and q.get("quant_method") else None


def dtype_of(raw: dict[str, Any]) -> str:
    value = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    return str(value).removeprefix("torch.")


def make_spec(
    c: Cfg,
    d: Dims,
    moe: Moe,
    moe_layers: Sequence[int],
    components: Components,
    attention_layers: Sequence[int] | None = None,
) -> ModelSpec:
    """Assemble the ModelSpec every family returns."""
    return ModelSpec(
        name=c.name,
        model_type=c.model_type,
        num_layers=d.layers,
        hidden_size=d.hidden,
        vocab_size=d.vocab,
        moe_layers=tuple(sorted(set(moe_layers))),
        num_experts=moe.experts,
        top_k=moe.top_k,
        expert_intermediate_size=moe.expert_size,
        num_shared_experts=moe.shared,
        shared_intermediate_size=moe.shared_size,
        dense_intermediate_size=moe.dense_size,
        num_attention_heads=d.heads,
        num_kv_heads=d.kv_heads,
        head_dim=d.head_dim,
        tie_word_embeddings=d.tied,
        components=components,
        active_params=active_params(components.total, components.routed_experts, moe),
        dtype=dtype_of(c.raw),
        hf_config=hf_dict(c.raw, c.model_type),
        attention_layer_ids=None if attention_layers is None else tuple(attention_layers),
        quant_method=quant_method(c.raw),
    )
