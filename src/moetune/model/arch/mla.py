"""DeepSeek-V2/V3: multi-head latent attention (MLA), shared experts, first-k dense layers."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from moetune.model.arch.common import fused, under
from moetune.model.counting import (
    Cfg,
    Dims,
    Moe,
    after_first_k,
    embeddings_and_head,
    fused_experts,
    glu,
    hf_config_object,
    linear,
    make_spec,
    uniform_layers,
)
from moetune.model.families import Family, ModulePaths, register
from moetune.model.spec import Components, ModelSpec

_KV = ("kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
_Q_DIRECT = ("q_proj", *_KV)  # q_lora_rank null (DeepSeek-V2-Lite)
_Q_LORA = ("q_a_proj", "q_b_proj", *_KV)  # q_lora_rank set (DeepSeek-V2, V3)


def _mla(c: Cfg, d: Dims) -> tuple[int, int]:
    """(projection params, norm params) of one MLA block."""
    q_rank = c.get("q_lora_rank")
    kv_rank = c.num("kv_lora_rank")
    nope, rope = c.num("qk_nope_head_dim"), c.num("qk_rope_head_dim")
    v_dim = c.num("v_head_dim")
    bias = c.flag("attention_bias")
    q_out = d.heads * (nope + rope)
    if q_rank is None:
        q, q_norm = linear(d.hidden, q_out), 0
    else:
        q, q_norm = linear(d.hidden, int(q_rank), bias) + linear(int(q_rank), q_out), int(q_rank)
    kv = linear(d.hidden, kv_rank + rope, bias) + linear(kv_rank, d.heads * (nope + v_dim))
    return q + kv + linear(d.heads * v_dim, d.hidden, bias), q_norm + kv_rank


def _deepseek(model_type: str, raw: dict[str, Any], name: str, has_mlp_bias: bool) -> ModelSpec:
    c = Cfg(model_type, raw, name)
    mlp_bias = has_mlp_bias and c.flag("mlp_bias")
    # transformers sets head_dim to qk_rope_head_dim; report the q/k head size instead
    d = replace(Dims.read(c), head_dim=c.num("qk_nope_head_dim") + c.num("qk_rope_head_dim"))
    moe = Moe(
        experts=c.num("n_routed_experts"),
        top_k=c.num("num_experts_per_tok"),
        expert_size=c.num("moe_intermediate_size"),
        shared=c.num("n_shared_experts", default=0),
        shared_size=c.num("n_shared_experts", default=0) * c.num("moe_intermediate_size"),
        dense_size=c.num("intermediate_size"),
    )
    layers = after_first_k(d, c.num("first_k_dense_replace", default=0))
    attention, attn_norms = _mla(c, d)
    common = Components(attention=attention, norms=2 * d.hidden + attn_norms)
    sparse = Components(
        routed_experts=fused_experts(moe.experts, d.hidden, moe.expert_size),
        shared_experts=glu(d.hidden, moe.shared_size, mlp_bias),
        routers=moe.experts * d.hidden,  # fp32 gate; e_score_correction_bias is a buffer
    )
    dense = Components(dense_mlp=glu(d.hidden, moe.dense_size, mlp_bias))
    total = uniform_layers(d.layers, layers, common, dense, sparse)
    total += embeddings_and_head(d) + Components(norms=d.hidden)
    # num_nextn_predict_layers (MTP) weights are dropped by transformers: not counted
    return make_spec(c, d, moe, layers, total)


def _deepseek_v2(raw: dict[str, Any], name: str) -> ModelSpec:
    # V2 only: dense and shared MLPs honour mlp_bias
    return _deepseek("deepseek_v2", raw, name, has_mlp_bias=True)


def _deepseek_v3(raw: dict[str, Any], name: str) -> ModelSpec:
    return _deepseek("deepseek_v3", raw, name, has_mlp_bias=False)


def _paths(attention: tuple[str, ...]) -> ModulePaths:
    return ModulePaths(
        attention=attention,
        expert_params=fused("mlp.experts"),
        dense_mlp=under("mlp"),
        shared=under("mlp.shared_experts"),
        router=("mlp.gate",),
        mlx_attention=tuple(f"self_attn.{n}" for n in attention),
        mlx_experts=under("mlp.switch_mlp"),
        mlx_dense=under("mlp"),
        mlx_shared=under("mlp.shared_experts"),
        mlx_router=(),  # mlx-lm's MoEGate is not a Linear: never adaptable
    )


def _paths_for(spec: ModelSpec) -> ModulePaths:
    # q_lora_rank has a non-null default in transformers' config: read it resolved
    q_lora = hf_config_object(spec.model_type, spec.hf_config).q_lora_rank is not None
    return _paths(_Q_LORA if q_lora else _Q_DIRECT)


_ALL_ATTENTION = tuple(dict.fromkeys((*_Q_DIRECT, *_Q_LORA)))


@register
def deepseek_v2() -> Family:
    return Family("deepseek_v2", _deepseek_v2, _paths(_ALL_ATTENTION), paths_for=_paths_for)


@register
def deepseek_v3() -> Family:
    return Family("deepseek_v3", _deepseek_v3, _paths(_ALL_ATTENTION), paths_for=_paths_for)
