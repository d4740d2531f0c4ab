"""Families whose layout departs from the common decoder: jamba (Mamba + attention),
dbrx (fused Wqkv, flattened 2-D experts) and llama4 (text_config, [E, H, 2I] experts)."""

from __future__ import annotations

from typing import Any

from moetune.model.arch.common import MLX_ATTENTION, QKVO, fused, under
from moetune.model.counting import (
    Cfg,
    Dims,
    Moe,
    embeddings_and_head,
    every_layer,
    glu,
    gqa,
    linear,
    make_spec,
    uniform_layers,
)
from moetune.model.families import ExpertsLayout, Family, ModulePaths, register
from moetune.model.spec import Components, ModelSpec

# --- Jamba: Mamba mixers with attention every attn_layer_period layers ---------------


def _mamba(c: Cfg, d: Dims) -> int:
    """One JambaMambaMixer (counted as `other`, its inner norms included)."""
    inner = c.num("mamba_expand") * d.hidden
    state, conv, rank = c.num("mamba_d_state"), c.num("mamba_d_conv"), c.num("mamba_dt_rank")
    proj_bias = c.flag("mamba_proj_bias")
    return (
        inner * conv + (inner if c.flag("mamba_conv_bias") else 0)  # depthwise conv1d
        + linear(d.hidden, 2 * inner, proj_bias)  # in_proj
        + linear(inner, rank + 2 * state)  # x_proj
        + linear(rank, inner, True)  # dt_proj
        + inner * state + inner  # A_log, D
        + linear(inner, d.hidden, proj_bias)  # out_proj
        + rank + 2 * state  # dt/b/c layernorms
    )  # fmt: skip


def _periodic(d: Dims, period: int, offset: int) -> tuple[int, ...]:
    return tuple(i for i in range(d.layers) if i % period == offset)


def _jamba(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("jamba", raw, name)
    d = Dims.read(c)
    experts = c.num("num_experts")
    top_k, inter = c.num("num_experts_per_tok"), c.num("intermediate_size")
    moe = Moe(experts=experts, top_k=top_k, expert_size=inter)
    moe_layers = (
        _periodic(d, c.num("expert_layer_period"), c.num("expert_layer_offset"))
        if experts > 1  # transformers builds a plain MLP when num_experts == 1
        else ()
    )
    attn_layers = _periodic(d, c.num("attn_layer_period"), c.num("attn_layer_offset"))
    n_attn = len(attn_layers)
    mixers = Components(attention=gqa(d)).times(n_attn)
    mixers += Components(other=_mamba(c, d)).times(d.layers - n_attn)
    sparse = Components(
        routed_experts=3 * experts * d.hidden * moe.expert_size,
        routers=experts * d.hidden,
    )
    dense = Components(dense_mlp=glu(d.hidden, moe.expert_size))
    norms = Components(norms=2 * d.hidden)  # input_layernorm, pre_ff_layernorm
    total = mixers + uniform_layers(d.layers, moe_layers, norms, dense, sparse)
    total += embeddings_and_head(d) + Components(norms=d.hidden)
    return make_spec(c, d, moe, moe_layers, total, attention_layers=attn_layers)


@register
def jamba() -> Family:
    ff = "feed_forward"
    paths = ModulePaths(
        attention=QKVO,
        expert_params=fused(f"{ff}.experts"),
        dense_mlp=under(ff),
        router=(f"{ff}.router",),
    )
    return Family("jamba", _jamba, paths, peft_automap=False, mlx_supported=False)


# --- DBRX: d_model/n_layers/n_heads, attn_config, ffn_config -------------------------


def _dbrx(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("dbrx", raw, name)
    d = Dims.read(c)  # attribute_map: hidden_size→d_model, num_hidden_layers→n_layers, …
    ffn = c.hf.ffn_config
    moe = Moe(experts=ffn.moe_num_experts, top_k=ffn.moe_top_k, expert_size=ffn.ffn_hidden_size)
    head_dim = d.hidden // d.heads
    per_layer = Components(
        # Wqkv fused: H -> H + 2·kv·head_dim, then out_proj H -> H; no biases
        attention=linear(d.hidden, d.hidden + 2 * d.kv_heads * head_dim) + d.hidden * d.hidden,
        norms=2 * d.hidden,  # norm_1, norm_2: LayerNorm without bias
        routed_experts=3 * moe.experts * moe.expert_size * d.hidden,  # w1, v1, w2 [E·I, H]
        routers=moe.experts * d.hidden,
    )
    total = per_layer.times(d.layers) + embeddings_and_head(d) + Components(norms=d.hidden)
    return make_spec(c, d, moe, every_layer(d, moe), total)


@register
def dbrx() -> Family:
    paths = ModulePaths(
        attention=("Wqkv", "out_proj"),
        expert_params=tuple(f"ffn.experts.mlp.{w}" for w in ("w1", "v1", "w2")),
        router=("ffn.router.layer",),
    )
    # w1 (gate) and v1 (up) are [E·I, H] = per expert [out, in]; w2 is per expert [in, out]
    layout = ExpertsLayout(
        is_concatenated=False, fused_gate_up=False, flat_2d=True, experts_interface=False
    )
    return Family(
        "dbrx",
        _dbrx,
        paths,
        layout=layout,
        peft_automap=False,
        mlx_supported=False,  # mlx-lm keeps one Linear per expert: no SwitchLinear to adapt
        layers_prefix="transformer.blocks",
    )


# --- Llama 4: text_config inside a multimodal config ---------------------------------


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The llama4_text config: `text_config` of a llama4 config, or the dict itself."""
    inner = raw.get("text_config")
    text = dict(inner) if isinstance(inner, dict) else dict(raw)
    text.pop("text_config", None)
    text.pop("vision_config", None)
    text["model_type"] = "llama4_text"
    return text


def _llama4(raw: dict[str, Any], name: str) -> ModelSpec:
    c = Cfg("llama4_text", text_config(raw), name)
    d = Dims.read(c)
    inter = c.num("intermediate_size")
    moe = Moe(
        experts=c.num("num_local_experts"),
        top_k=c.num("num_experts_per_tok"),
        expert_size=inter,
        shared=1,
        shared_size=inter,
        dense_size=c.num("intermediate_size_mlp"),
    )
    layers = tuple(i for i in c.nums("moe_layers") if 0 <= i < d.layers)
    bias = c.flag("attention_bias")
    common = Components(attention=gqa(d, bias, bias), norms=2 * d.hidden)  # qk L2 norm: no weight
    sparse = Components(
        routed_experts=3 * moe.experts * d.hidden * inter,  # gate_up [E, H, 2I], down [E, I, H]
        shared_experts=glu(d.hidden, inter),
        routers=moe.experts * d.hidden,
    )
    dense = Components(dense_mlp=glu(d.hidden, moe.dense_size))
    total = uniform_layers(d.layers, layers, common, dense, sparse)
    total += embeddings_and_head(d) + Components(norms=d.hidden)
    return make_spec(c, d, moe, layers, total)


@register
def llama4() -> Family:
    ff = "feed_forward"
    paths = ModulePaths(
        attention=QKVO,
        expert_params=fused(f"{ff}.experts"),
        dense_mlp=under(ff),
        shared=under(f"{ff}.shared_expert"),
        router=(f"{ff}.router",),
        mlx_attention=MLX_ATTENTION,
    )
    # Llama4TextExperts: gate/up as halves of [E, H, 2I]; not an ExpertsInterface module
    layout = ExpertsLayout(is_transposed=True, experts_interface=False)
    return Family(
        "llama4",
        _llama4,
        paths,
        layout=layout,
        peft_automap=False,
        mlx_supported=False,
        aliases=("llama4_text",),
    )
