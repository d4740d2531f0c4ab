"""MoE families with grouped-query attention and fused `…Experts` stacks.

Each `build_spec` mirrors what the transformers 5.x modeling file instantiates; the
comment on each family names the non-obvious parts (biases, norms, router shapes).
"""

from __future__ import annotations

from typing import Any

from moetune.errors import ConfigError
from moetune.model.arch.common import MLX_ATTENTION, QKVO, fused, under
from moetune.model.counting import (
    Cfg,
    Dims,
    Moe,
    after_first_k,
    embeddings_and_head,
    every_layer,
    fused_experts,
    glu,
    gqa,
    linear,
    make_spec,
    qwen_sparse_layers,
    uniform_layers,
)
from moetune.model.families import ExpertsLayout, Family, ModulePaths, register
from moetune.model.spec import Components, ModelSpec

MLX_SWITCH = under("mlp.switch_mlp")
MLP = under("mlp")


def _final_rmsnorm(d: Dims) -> Components:
    return Components(norms=d.hidden)


def _layer_norms(d: Dims) -> int:
    """input_layernorm + post_attention_layernorm (RMSNorm, weight only)."""
    return 2 * d.hidden


# --- Qwen2-MoE: qkv bias, a gated shared expert, dense layers via mlp_only_layers ------


def _qwen2_moe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("qwen2_moe", raw, name)
    d = Dims.read(c)
    shared_size = c.num("shared_expert_intermediate_size", default=0)
    moe = Moe(
        experts=c.num("num_experts", default=0),
        top_k=c.num("num_experts_per_tok"),
        expert_size=c.num("moe_intermediate_size"),
        shared=1 if shared_size else 0,
        shared_size=shared_size,
        dense_size=c.num("intermediate_size"),
    )
    layers = qwen_sparse_layers(c, d, moe.experts)
    common = Components(attention=gqa(d, qkv_bias=c.flag("qkv_bias", default=True)))
    common += Components(norms=_layer_norms(d))
    sparse = Components(
        routed_experts=fused_experts(moe.experts, d.hidden, moe.expert_size),
        # shared_expert (GLU) + shared_expert_gate Linear(H, 1)
        shared_experts=glu(d.hidden, shared_size) + linear(d.hidden, 1),
        routers=moe.experts * d.hidden,
    )
    dense = Components(dense_mlp=glu(d.hidden, moe.dense_size))
    total = uniform_layers(d.layers, layers, common, dense, sparse)
    total += embeddings_and_head(d) + _final_rmsnorm(d)
    return make_spec(c, d, moe, layers, total)


@register
def qwen2_moe() -> Family:
    return Family(
        model_type="qwen2_moe",
        build_spec=_qwen2_moe,
        paths=ModulePaths(
            attention=QKVO,
            expert_params=fused("mlp.experts"),
            dense_mlp=MLP,
            shared=under("mlp.shared_expert"),
            router=("mlp.gate",),
            mlx_attention=MLX_ATTENTION,
            mlx_experts=MLX_SWITCH,
            mlx_dense=MLP,
            mlx_shared=under("mlp.shared_expert"),
            mlx_router=("mlp.gate",),
        ),
        peft_automap=False,  # peft 0.21 has no conversion mapping for qwen2_moe
    )


# --- Qwen3-MoE: per-head q/k RMSNorm, no shared expert ------------------------------


def _qwen3_moe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("qwen3_moe", raw, name)
    d = Dims.read(c)
    moe = Moe(
        experts=c.num("num_experts", "num_local_experts", default=0),
        top_k=c.num("num_experts_per_tok"),
        expert_size=c.num("moe_intermediate_size"),
        dense_size=c.num("intermediate_size"),
    )
    layers = qwen_sparse_layers(c, d, moe.experts)
    bias = c.flag("attention_bias")
    common = Components(
        attention=gqa(d, qkv_bias=bias, o_bias=bias),
        norms=_layer_norms(d) + 2 * d.head_dim,  # q_norm, k_norm over head_dim
    )
    sparse = Components(
        routed_experts=fused_experts(moe.experts, d.hidden, moe.expert_size),
        routers=moe.experts * d.hidden,
    )
    dense = Components(dense_mlp=glu(d.hidden, moe.dense_size))
    total = uniform_layers(d.layers, layers, common, dense, sparse)
    total += embeddings_and_head(d) + _final_rmsnorm(d)
    return make_spec(c, d, moe, layers, total)


def _switch_paths(block: str, router: str, mlx_block: str, mlx_router: str) -> ModulePaths:
    """Experts-only MoE block (no shared expert) and plain attention."""
    return ModulePaths(
        attention=QKVO,
        expert_params=fused(f"{block}.experts"),
        dense_mlp=under(block),
        router=(f"{block}.{router}",),
        mlx_attention=MLX_ATTENTION,
        mlx_experts=under(f"{mlx_block}.switch_mlp"),
        mlx_dense=under(mlx_block),
        mlx_router=(f"{mlx_block}.{mlx_router}",),
    )


@register
def qwen3_moe() -> Family:
    return Family("qwen3_moe", _qwen3_moe, _switch_paths("mlp", "gate", "mlp", "gate"))


# --- Simple all-MoE families: experts sized by intermediate_size --------------------


def _all_moe_spec(
    c: Cfg,
    d: Dims,
    attention: int,
    norms: int,
    final_norm: int,
    router_bias: bool = False,
    expert_bias: bool = False,
    head_bias: bool = False,
) -> ModelSpec:
    """Every layer: attention + fused experts (intermediate_size) + router; no shared."""
    moe = Moe(
        experts=c.num("num_local_experts", "num_experts"),
        top_k=c.num("num_experts_per_tok"),
        expert_size=c.num("intermediate_size"),
    )
    per_layer = Components(
        attention=attention,
        norms=norms,
        routed_experts=fused_experts(moe.experts, d.hidden, moe.expert_size, expert_bias),
        routers=linear(d.hidden, moe.experts, router_bias),
    )
    total = per_layer.times(d.layers) + embeddings_and_head(d, head_bias)
    total += Components(norms=final_norm)
    return make_spec(c, d, moe, every_layer(d, moe), total)


def _olmoe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("olmoe", raw, name)
    d = Dims.read(c)
    bias = c.flag("attention_bias")
    # q_norm spans the full hidden size, k_norm the kv projection (hidden // heads * kv_heads)
    qk_norms = d.hidden + (d.hidden // d.heads) * d.kv_heads
    return _all_moe_spec(c, d, gqa(d, bias, bias), _layer_norms(d) + qk_norms, d.hidden)


def _mixtral(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("mixtral", raw, name)
    d = Dims.read(c)
    return _all_moe_spec(c, d, gqa(d), _layer_norms(d), d.hidden)


def _granitemoe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("granitemoe", raw, name)
    d = Dims.read(c)
    bias = c.flag("attention_bias")
    return _all_moe_spec(c, d, gqa(d, bias, bias), _layer_norms(d), d.hidden)


def _phimoe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("phimoe", raw, name)
    d = Dims.read(c)
    bias = c.flag("attention_bias")
    # nn.LayerNorm (weight + bias) everywhere; optional lm_head bias
    norms = 2 * _layer_norms(d)
    head_bias = c.flag("lm_head_bias")
    return _all_moe_spec(c, d, gqa(d, bias, bias), norms, 2 * d.hidden, head_bias=head_bias)


def _gpt_oss(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("gpt_oss", raw, name)
    d = Dims.read(c)
    bias = c.flag("attention_bias", default=True)
    attention = gqa(d, bias, bias) + d.heads  # + attention sinks, one per head
    # router is Linear(H, E) with bias; experts carry gate_up_proj_bias and down_proj_bias
    return _all_moe_spec(
        c, d, attention, _layer_norms(d), d.hidden, router_bias=True, expert_bias=True
    )


@register
def olmoe() -> Family:
    return Family("olmoe", _olmoe, _switch_paths("mlp", "gate", "mlp", "gate"))


@register
def mixtral() -> Family:
    mlx = "block_sparse_moe"
    return Family(
        "mixtral",
        _mixtral,
        _switch_paths("mlp", "gate", mlx, "gate"),
        peft_automap=False,  # peft maps only the checkpoint names w1/w2/w3 here
        peft_automap_names=("w1", "w2", "w3"),
    )


@register
def granitemoe() -> Family:
    paths = _switch_paths("block_sparse_moe", "router", "block_sparse_moe", "router")
    # mlx-lm's granitemoe keeps experts outside SwitchLinear in the versions checked
    return Family("granitemoe", _granitemoe, paths, peft_automap=False, mlx_supported=False)


@register
def phimoe() -> Family:
    paths = _switch_paths("mlp", "router", "block_sparse_moe", "gate")
    return Family("phimoe", _phimoe, paths, peft_automap=False)


@register
def gpt_oss() -> Family:
    paths = _switch_paths("mlp", "router", "mlp", "router")
    mlx = ModulePaths(
        attention=paths.attention,
        expert_params=paths.expert_params,
        router=paths.router,
        mlx_attention=MLX_ATTENTION,
        mlx_experts=under("mlp.experts"),
        mlx_router=("mlp.router",),
    )
    layout = ExpertsLayout(is_concatenated=False, is_transposed=True, has_bias=True)
    return Family("gpt_oss", _gpt_oss, mlx, layout=layout, peft_automap=False)


# --- DeepSeek-style routing with GQA attention: GLM-4 MoE ---------------------------


def _glm4_moe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("glm4_moe", raw, name)
    d = Dims.read(c)
    moe = Moe(
        experts=c.num("n_routed_experts"),
        top_k=c.num("num_experts_per_tok"),
        expert_size=c.num("moe_intermediate_size"),
        shared=c.num("n_shared_experts"),
        shared_size=c.num("n_shared_experts") * c.num("moe_intermediate_size"),
        dense_size=c.num("intermediate_size"),
    )
    layers = after_first_k(d, c.num("first_k_dense_replace", default=0))
    qk_norm = 2 * d.head_dim if c.flag("use_qk_norm") else 0
    common = Components(
        attention=gqa(d, qkv_bias=c.flag("attention_bias")),  # o_proj never has a bias
        norms=_layer_norms(d) + qk_norm,
    )
    sparse = Components(
        routed_experts=fused_experts(moe.experts, d.hidden, moe.expert_size),
        shared_experts=glu(d.hidden, moe.shared_size),
        routers=moe.experts * d.hidden,  # e_score_correction_bias is a buffer
    )
    dense = Components(dense_mlp=glu(d.hidden, moe.dense_size))
    total = uniform_layers(d.layers, layers, common, dense, sparse)
    total += embeddings_and_head(d) + _final_rmsnorm(d)
    return make_spec(c, d, moe, layers, total)


@register
def glm4_moe() -> Family:
    paths = ModulePaths(
        attention=QKVO,
        expert_params=fused("mlp.experts"),
        dense_mlp=MLP,
        shared=under("mlp.shared_experts"),
        router=("mlp.gate",),
        mlx_attention=MLX_ATTENTION,
        mlx_experts=MLX_SWITCH,
        mlx_dense=MLP,
        mlx_shared=under("mlp.shared_experts"),
        mlx_router=(),  # mlx-lm's MoEGate is not a Linear: never adaptable
    )
    return Family("glm4_moe", _glm4_moe, paths)


# --- ERNIE 4.5 MoE: use_bias everywhere, tied embeddings by default ------------------


def _ernie_layers(c: Cfg, d: Dims) -> tuple[int, ...]:
    """(i+1) % moe_layer_interval == 0 within [moe_layer_start_index, moe_layer_end_index]."""
    interval = c.num("moe_layer_interval", default=1)
    start = c.num("moe_layer_start_index", default=0)
    end = c.num("moe_layer_end_index", default=d.layers - 1)
    end = d.layers - 1 if end < 0 else end
    return tuple(i for i in range(d.layers) if (i + 1) % interval == 0 and start <= i <= end)


def _ernie4_5_moe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("ernie4_5_moe", raw, name)
    d = Dims.read(c)
    bias = c.flag("use_bias")
    moe = Moe(
        experts=c.num("moe_num_experts", "num_experts"),
        top_k=c.num("moe_k", "num_experts_per_tok"),
        expert_size=c.num("moe_intermediate_size"),
        shared=c.num("moe_num_shared_experts", default=0),
        shared_size=c.num("moe_num_shared_experts", default=0) * c.num("moe_intermediate_size"),
        dense_size=c.num("intermediate_size"),
    )
    layers = _ernie_layers(c, d)
    common = Components(attention=gqa(d, bias, bias), norms=_layer_norms(d))
    sparse = Components(
        routed_experts=fused_experts(moe.experts, d.hidden, moe.expert_size),
        shared_experts=glu(d.hidden, moe.shared_size, bias) if moe.shared else 0,
        # gate weight [E, H] + moe_statics.e_score_correction_bias [1, E] (a Parameter)
        routers=moe.experts * d.hidden + moe.experts,
    )
    dense = Components(dense_mlp=glu(d.hidden, moe.dense_size, bias))
    total = uniform_layers(d.layers, layers, common, dense, sparse)
    total += embeddings_and_head(d, head_bias=bias) + _final_rmsnorm(d)
    return make_spec(c, d, moe, layers, total)


@register
def ernie4_5_moe() -> Family:
    paths = ModulePaths(
        attention=QKVO,
        expert_params=fused("mlp.experts"),
        dense_mlp=MLP,
        shared=under("mlp.shared_experts"),
        router=("mlp.gate",),
    )
    # mlx-lm module names for ERNIE MoE not verified here: no mlx recipe
    return Family("ernie4_5_moe", _ernie4_5_moe, paths, mlx_supported=False)


# --- Hunyuan-A13B: shared_mlp in every layer, router `mlp.gate.wg` -------------------


def _single(c: Cfg, name: str) -> int:
    """A per-layer list that transformers only supports when all values are equal."""
    value = c.get(name)
    if isinstance(value, list | tuple):
        if len(set(value)) != 1:
            raise ConfigError(
                f"{c.name}: per-layer {name} {value} differ; transformers builds one size",
                f"use a single integer {name}",
            )
        return int(value[0])
    return c.num(name)


def _hunyuan_v1_moe(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("hunyuan_v1_moe", raw, name)
    d = Dims.read(c)
    bias = c.flag("attention_bias")
    inter = c.num("intermediate_size")  # transformers sizes experts and shared_mlp by this
    moe = Moe(
        experts=_single(c, "num_experts"),
        top_k=_single(c, "moe_topk"),
        expert_size=inter,
        shared=1,
        shared_size=inter,
    )
    per_layer = Components(
        attention=gqa(d, bias, bias),
        norms=_layer_norms(d) + 2 * d.head_dim,  # query_layernorm, key_layernorm
        routed_experts=fused_experts(moe.experts, d.hidden, inter),
        shared_experts=glu(d.hidden, inter),
        routers=moe.experts * d.hidden,
    )
    total = per_layer.times(d.layers) + embeddings_and_head(d) + _final_rmsnorm(d)
    return make_spec(c, d, moe, every_layer(d, moe), total)


@register
def hunyuan_v1_moe() -> Family:
    paths = ModulePaths(
        attention=QKVO,
        expert_params=fused("mlp.experts"),
        shared=under("mlp.shared_mlp"),
        router=("mlp.gate.wg",),
    )
    return Family("hunyuan_v1_moe", _hunyuan_v1_moe, paths, mlx_supported=False)
