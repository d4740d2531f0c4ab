"""Dense families: recognised as not-MoE (num_experts 0, no MoE layers) and still planned."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from moetune.model.arch.common import MLX_ATTENTION, QKVO, under
from moetune.model.counting import Cfg, Dims, Moe, embeddings_and_head, glu, gqa, make_spec
from moetune.model.families import Family, ModulePaths, register
from moetune.model.spec import Components, ModelSpec

BuildSpec = Callable[[dict[str, Any], str], ModelSpec]

_PATHS = ModulePaths(
    attention=QKVO,
    expert_params=(),
    dense_mlp=under("mlp"),
    mlx_attention=MLX_ATTENTION,
    mlx_dense=under("mlp"),
)


def _dense_spec(model_type: str, *, qkv_bias: str | bool, o_bias: str | bool,
                mlp_bias: str | None = None, qk_norm: bool = False) -> BuildSpec:  # fmt: skip
    """A build_spec for a llama-style dense decoder.

    A bias argument is either a constant (the modeling file hard-codes it) or the name
    of the config flag that switches it.
    """

    def flag(c: Cfg, value: str | bool | None) -> bool:
        return c.flag(value) if isinstance(value, str) else bool(value)

    def build(raw: dict[str, Any], name: str) -> ModelSpec:
        c = Cfg(model_type, raw, name)
        d = Dims.read(c)
        inter = c.num("intermediate_size")
        per_layer = Components(
            attention=gqa(d, flag(c, qkv_bias), flag(c, o_bias)),
            dense_mlp=glu(d.hidden, inter, flag(c, mlp_bias)),
            norms=2 * d.hidden + (2 * d.head_dim if qk_norm else 0),
        )
        total = per_layer.times(d.layers) + embeddings_and_head(d) + Components(norms=d.hidden)
        return make_spec(c, d, Moe(dense_size=inter), (), total)

    return build


@register
def llama() -> Family:
    build = _dense_spec("llama", qkv_bias="attention_bias", o_bias="attention_bias",
                        mlp_bias="mlp_bias")  # fmt: skip
    return Family("llama", build, _PATHS)


@register
def qwen2() -> Family:
    return Family("qwen2", _dense_spec("qwen2", qkv_bias=True, o_bias=False), _PATHS)


@register
def qwen3() -> Family:
    build = _dense_spec("qwen3", qkv_bias="attention_bias", o_bias="attention_bias", qk_norm=True)
    return Family("qwen3", build, _PATHS)


@register
def mistral() -> Family:
    return Family("mistral", _dense_spec("mistral", qkv_bias=False, o_bias=False), _PATHS)
