"""The ModelSpec's figures (expert count, top-k, widths, head sizes, dtype) from a build
whose decoder layers `model.read` has classified."""

from __future__ import annotations

from typing import Any

from moetune.errors import ConfigError
from moetune.model.hf_config import CHECKPOINT_ONLY_KEYS, plain_floats, quant_config_of
from moetune.model.read import Layer, attention_layers, dense_layers, first_int
from moetune.model.spec import Components, ModelSpec

# config fields that name the experts each token is routed to (first set one wins)
TOP_K_FIELDS = (
    "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k",
    "top_k", "top_k_experts", "n_activated_experts", "experts_per_token", "num_selected_experts",
)  # fmt: skip


def spec_of(
    name: str, config: Any, raw: dict[str, Any], read: list[Layer], components: Components
) -> ModelSpec:
    """The ModelSpec of a build whose decoder layers `read` holds."""
    moe = tuple(i for i, r in enumerate(read) if r.experts)
    num_experts = _num_experts(read, config)
    top_k = _top_k(config, read, num_experts) if moe else 0
    routed = [r.counts["routed_experts"] for r in read]
    active = components.total - sum(n - n * top_k // max(1, num_experts) for n in routed)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    return ModelSpec(
        name=name,
        model_type=str(config.model_type),
        num_layers=len(read),
        hidden_size=hidden,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        moe_layers=moe,
        num_experts=num_experts if moe else 0,
        top_k=top_k,
        expert_intermediate_size=_expert_size(read, moe, hidden, num_experts),
        num_shared_experts=_shared_count(config, read),
        shared_intermediate_size=_per_glu(read, moe, "shared_experts", hidden),
        dense_intermediate_size=_dense_size(config, read, moe, hidden),
        num_attention_heads=int(getattr(config, "num_attention_heads", 0) or 0),
        num_kv_heads=_kv_heads(config),
        head_dim=_head_dim(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        components=components,
        active_params=active,
        dtype=_dtype(raw, config),
        hf_config=_hf_dict(config),
        attention_layer_ids=attention_layers(read),
        quant_config=quant_config_of(raw) or None,
        mixers=tuple(r.mixer for r in read),
        dense_layer_ids=dense_layers(read, moe),
    )


def _num_experts(read: list[Layer], config: Any) -> int:
    # lazy: heavy to import (torch)
    from torch import nn

    for r in read:
        for _, module in r.experts:
            n = getattr(module, "num_experts", None)
            if isinstance(n, int) and n > 0:
                return n
            stacks = [p for p in module.parameters(recurse=False) if p.dim() == 3]
            if stacks:
                return int(stacks[0].shape[0])
            lists = [len(c) for c in module.children() if isinstance(c, nn.ModuleList)]
            if lists:
                return lists[0]
    return int(first_int(config, ("num_experts", "n_routed_experts", "num_local_experts")))


def _top_k(config: Any, read: list[Layer], num_experts: int) -> int:
    k = first_int(config, TOP_K_FIELDS)
    if not k:  # the router knows (e.g. a `top_k` attribute)
        k = next((r.top_k for r in read if r.top_k), 0)
    if not k:
        raise ConfigError(
            f"{config.model_type}: cannot tell how many experts each token is routed to",
            f"set one of {', '.join(TOP_K_FIELDS[:3])} in config.json",
        )
    if k > num_experts:
        raise ConfigError(
            f"{config.model_type}: top-k {k} exceeds the {num_experts} experts",
            "set num_experts_per_tok to at most the number of experts",
        )
    return k


def _glu_factor(read: list[Layer]) -> int:
    """3 projections per expert (gate, up, down) when gated, else 2."""
    for r in read:
        for _, module in r.experts:
            return 3 if getattr(module, "has_gate", True) else 2
    return 3


def _expert_size(read: list[Layer], moe: tuple[int, ...], hidden: int, experts: int) -> int:
    if not moe or not hidden or not experts:
        return 0
    for _, module in read[moe[0]].experts:
        down = getattr(module, "down_proj", None)
        decorated = "is_transposed" in vars(module)
        if decorated and down is not None and getattr(down, "dim", lambda: 0)() == 3:
            return int(down.shape[1] if getattr(module, "is_transposed", False) else down.shape[2])
    per_expert = read[moe[0]].counts["routed_experts"] // experts
    return per_expert // (_glu_factor(read) * hidden)


def _per_glu(read: list[Layer], layers: tuple[int, ...], kind: str, hidden: int) -> int:
    """Intermediate width of a dense / shared MLP: the input width of its Linear that
    projects back to the hidden size (its down projection)."""
    if not layers or not hidden:
        return 0
    r = read[layers[0]]
    for path in r.paths["shared" if kind == "shared_experts" else kind]:
        linear: Any = r.module.get_submodule(path)
        if linear.out_features == hidden and linear.in_features != hidden:
            return int(linear.in_features)
    return r.counts[kind] // (3 * hidden)


def _shared_count(config: Any, read: list[Layer]) -> int:
    if not any(r.counts["shared_experts"] for r in read):
        return 0
    return (
        first_int(config, ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")) or 1
    )


def _dense_size(config: Any, read: list[Layer], moe: tuple[int, ...], hidden: int) -> int:
    dense = tuple(i for i in range(len(read)) if i not in set(moe) and read[i].counts["dense_mlp"])
    return _per_glu(read, dense, "dense_mlp", hidden)


def _kv_heads(config: Any) -> int:
    kv = getattr(config, "num_key_value_heads", None)
    return int(kv or getattr(config, "num_attention_heads", 0) or 0)


def _head_dim(config: Any) -> int:
    if getattr(config, "qk_nope_head_dim", None):  # MLA: query/key width per head
        return int(config.qk_nope_head_dim) + int(getattr(config, "qk_rope_head_dim", 0) or 0)
    head_dim = first_int(config, ("head_dim",))
    if head_dim:
        return head_dim
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    return int(getattr(config, "hidden_size", 0) or 0) // heads if heads else 0


def _dtype(raw: dict[str, Any], config: Any) -> str:
    value = raw.get("torch_dtype") or raw.get("dtype") or getattr(config, "dtype", None)
    text = str(value or "bfloat16").removeprefix("torch.")
    return text if text in ("bfloat16", "float16", "float32") else "bfloat16"


def _hf_dict(config: Any) -> dict[str, Any]:
    """The (text) config as a dict transformers rebuilds the same model from."""
    out = plain_floats(config.to_dict())
    for key in ("transformers_version", "architectures", *CHECKPOINT_ONLY_KEYS):
        out.pop(key, None)
    return out
