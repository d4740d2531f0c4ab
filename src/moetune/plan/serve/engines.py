"""Inference memory: will a model (or a merged fine-tune) serve on a card, with llama.cpp or
vLLM, and how.

Both engines read the same inventory: every weight tensor of transformers' meta build of
the model, with its llama.cpp category, layer and row length, and per decoder layer what
its token mixer caches (`ModelSpec.mixers`):

- attention layers cache K and V for every token: the k_proj + v_proj widths (K doubles as
  V where the layer has no v_proj), all `--ctx` tokens – or, for a sliding-window layer
  (`layer_types`), the window plus one micro-batch (llama.cpp: padded to 256 cells);
- MLA layers cache the compressed latent: `kv_lora_rank + qk_rope_head_dim` values per token
  (llama.cpp and vLLM both keep V as a view of it);
- linear-attention and Mamba layers keep a fixed recurrent + convolution state (fp32)
  whatever the context length (`STATES`; a kind without a sizer is named in the notes).

llama.cpp (`plan_llama_cpp`): weights by GGUF quant type (`plan.serve.gguf`: llama-quantize's
per-tensor mix); token embeddings always stay in host RAM (llama.cpp's input layer);
`--n-cpu-moe N` keeps the routed-expert tensors of blocks 0..N-1 in RAM: the plan gives the
smallest N that fits the card and the RAM those experts need. On unified memory (Apple,
DGX Spark) CPU and GPU share one pool: offloading frees nothing, so N is 0 and everything
goes to the GPU (`-ngl 99`). A GGUF base cannot be fine-tuned (`train` refuses it).

vLLM (`plan_vllm`): checkpoint weights (bf16; fp8 / MXFP4 checkpoints as stored) sharded
over the tensor-parallel ranks (norms and routers replicated; KV heads sharded while there
are at least as many as ranks, MLA's latent replicated), the KV cache for one
`--max-model-len` sequence (vLLM refuses to start without it and gives the rest of its
budget to more KV), the LoRA buffers vLLM preallocates for `--max-loras` adapters of
`--max-lora-rank` on every Linear and on the expert stacks (w13 A/B, w2 A/B per expert),
a profile-run activation term and CUDA graphs, all within `gpu_memory_utilization` × the
card. The TP degree is the smallest power of two that divides the heads and fits.

Approximate, and said so: llama.cpp's compute buffer (its load log prints the real
"CUDA0 compute buffer size"), vLLM's profile-run activations and CUDA-graph pool.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from moetune.errors import ConfigError
from moetune.model import build_model
from moetune.model.build import to_hf_config
from moetune.model.read import classify_layer, find_layers
from moetune.model.spec import ModelSpec
from moetune.plan.hardware import Card, get_card
from moetune.plan.overhead import CUDA_CONTEXT_BYTES
from moetune.plan.serve.gguf import Tensor, get_file_type, tensor_types, type_bytes
from moetune.registry import Registry

GiB = 1024**3
KV_TYPES = {"f16": 2.0, "bf16": 2.0, "f32": 4.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
_CATEGORY = {
    "q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
    "kv_b_proj": "attn_kv_b", "qkv_proj": "attn_qkv", "query_key_value": "attn_qkv",
    "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down",
    "w1": "ffn_gate", "w3": "ffn_up", "v1": "ffn_up", "w2": "ffn_down",
}  # fmt: skip
_ROW_PARALLEL = ("o_proj", "down_proj", "out_proj", "w2", "dense")  # vLLM shards their input
UBATCH = 512  # llama.cpp's default physical batch (-ub)


@dataclass(frozen=True)
class Cache:
    """What one decoder layer caches: `per_token` values for `kind` full / sliding / mla
    (`window` tokens for sliding), or a fixed `state_bytes` (linear attention, Mamba)."""

    kind: str  # full | sliding | mla | state | none
    per_token: int = 0
    window: int = 0
    state_bytes: int = 0


@dataclass(frozen=True)
class Inventory:
    """A model's weight tensors (llama.cpp categories) and each layer's cache."""

    tensors: tuple[Tensor, ...]
    caches: tuple[Cache, ...]
    linears: tuple[tuple[str, int, int], ...]  # (module leaf, in, out) of the layers' Linears
    notes: tuple[str, ...] = ()


# ---------------------------------------------------------------- the inventory


@cache
def _inventory_cached(key: str, spec: ModelSpec) -> Inventory:
    model = build_model(spec)
    prefix, layers = find_layers(model, spec.num_layers)
    config = to_hf_config(spec)
    tensors: list[Tensor] = []
    linears: list[tuple[str, int, int]] = []
    for i, layer in enumerate(layers):
        read = classify_layer(layer)
        for pname, param in layer.named_parameters():
            full = f"{prefix}.{i}.{pname}"
            tensors += _layer_tensors(spec, full, i, tuple(param.shape), read, pname)
            if _is_linear(pname, param.dim(), read):
                linears.append((pname.split(".")[-2], int(param.shape[1]), int(param.shape[0])))
    tensors += [_outer_tensor(n, tuple(p.shape)) for n, p in model.named_parameters()
                if not n.startswith(f"{prefix}.")]  # fmt: skip
    caches, notes = _caches(spec, config, tensors)
    return Inventory(tuple(tensors), caches, tuple(linears), notes)


def inventory(spec: ModelSpec) -> Inventory:
    """The (cached) inventory of `spec`: one meta build."""
    return _inventory_cached(f"{spec.name}:{id(spec)}", spec)


def _is_linear(pname: str, dim: int, read: Any) -> bool:
    module = pname.rpartition(".")[0]
    routed = any(pname.startswith(f"{e}.") for e, _ in read.experts)
    return (
        dim == 2 and pname.endswith("weight") and not routed and module not in read.paths["router"]
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _layer_tensors(
    spec: ModelSpec, name: str, i: int, shape: tuple[int, ...], read: Any, pname: str
) -> list[Tensor]:
    numel, module = _numel(shape), pname.rpartition(".")[0]
    if len(shape) < 2 or pname.endswith("bias") or "norm" in pname.lower() or "conv" in pname:
        # llama-quantize keeps norms, biases and Mamba / short-conv kernels as converted (F32)
        return [Tensor(name, "norm", i, numel, shape[-1], False)]
    if module in read.paths["router"]:
        return [Tensor(name, "router", i, numel, shape[-1], False)]
    if any(pname.startswith(f"{e}.") for e, _ in read.experts):
        return _expert_tensors(spec, name, i, shape, pname)
    category = _CATEGORY.get(module.rpartition(".")[2], "other")
    return [Tensor(name, category, i, numel, shape[-1], True)]


def _expert_tensors(
    spec: ModelSpec, name: str, i: int, shape: tuple[int, ...], pname: str
) -> list[Tensor]:
    """Routed stacks: gate_up splits into llama.cpp's ffn_gate_exps and ffn_up_exps (rows
    of hidden size); down's rows are the expert width."""
    leaf, numel = pname.rpartition(".")[2], _numel(shape)
    h, inter = spec.hidden_size, spec.expert_intermediate_size
    if len(shape) == 2 and leaf == "weight":  # per-expert Linears (ModuleList experts)
        category = _CATEGORY.get(pname.split(".")[-2], "other")
        return [Tensor(name, category, i, numel, shape[-1], True, True)]
    if "gate_up" in leaf:
        half = numel // 2
        return [Tensor(f"{name}:{p}", f"ffn_{p}", i, half, h, True, True) for p in ("gate", "up")]
    category = next((c for k, c in _CATEGORY.items() if k in leaf), "ffn_down")
    ncols = inter if category == "ffn_down" else h
    return [Tensor(name, category, i, numel, ncols, True, True)]


def _outer_tensor(name: str, shape: tuple[int, ...]) -> Tensor:
    if len(shape) < 2:
        return Tensor(name, "norm", None, _numel(shape), shape[-1], False)
    category = "output" if "lm_head" in name else "token_embd" if "embed" in name else "other"
    return Tensor(name, category, None, _numel(shape), shape[-1], True)


# ---------------------------------------------------------------- what each layer caches


def _caches(
    spec: ModelSpec, config: Any, tensors: list[Tensor]
) -> tuple[tuple[Cache, ...], tuple[str, ...]]:
    kinds = spec.mixers or ("attention",) * spec.num_layers
    types = list(getattr(config, "layer_types", None) or [])
    window = int(getattr(config, "sliding_window", 0) or 0)
    out, notes = [], []
    for i, kind in enumerate(kinds):
        if kind == "mla":
            width = int(config.kv_lora_rank) + int(config.qk_rope_head_dim)
            out.append(Cache("mla", width))
        elif kind == "attention":
            sliding = i < len(types) and "sliding" in str(types[i]) and window > 0
            out.append(Cache("sliding" if sliding else "full", _kv_width(tensors, i), window))
        elif kind in STATES:
            out.append(Cache("state", state_bytes=STATES[kind](config)))
        else:
            out.append(Cache("none"))
            notes.append(f"layer {i}: no cache sizer for {kind!r} layers (counted as 0)")
    return tuple(out), tuple(notes[:1] + ([f"… {len(notes) - 1} more"] if len(notes) > 1 else []))


def _kv_width(tensors: list[Tensor], i: int) -> int:
    """K + V values per token of layer `i` (rows of k_proj and v_proj; K=V without v_proj)."""
    rows = {c: sum(t.numel // t.ncols for t in tensors if t.layer == i and t.category == c)
            for c in ("attn_k", "attn_v")}  # fmt: skip
    return rows["attn_k"] + (rows["attn_v"] or rows["attn_k"])


def _gated_deltanet(config: Any) -> int:
    """Qwen3-Next / Qwen3.5 linear attention: fp32 recurrent state per value head and the
    short convolution's last (kernel − 1) inputs of q, k and v."""
    hk, hv = int(config.linear_num_key_heads), int(config.linear_num_value_heads)
    dk, dv = int(config.linear_key_head_dim), int(config.linear_value_head_dim)
    conv = (int(config.linear_conv_kernel_dim) - 1) * (2 * hk * dk + hv * dv)
    return 4 * (hv * dk * dv + conv)


def _mamba(config: Any) -> int:
    """Mamba-2: fp32 SSM state (heads × head_dim × state) and conv state."""
    heads, dim = int(config.mamba_num_heads), int(config.mamba_head_dim)
    state, groups = int(config.ssm_state_size), int(getattr(config, "n_groups", 1))
    conv = (int(config.conv_kernel) - 1) * (heads * dim + 2 * groups * state)
    return 4 * (heads * dim * state + conv)


STATES: dict[str, Callable[[Any], int]] = {"linear_attention": _gated_deltanet, "mamba": _mamba}


def kv_cache_bytes(inv: Inventory, tokens: int, value_bytes: float, extra: int = 0) -> int:
    """Bytes of every layer's cache for one sequence of `tokens` (`extra`: cells beyond a
    sliding window, llama.cpp's micro-batch)."""
    total = 0.0
    for c in inv.caches:
        cells = min(tokens, c.window + extra) if c.kind == "sliding" else tokens
        total += c.state_bytes + c.per_token * cells * value_bytes
    return int(total)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class ServePlan:
    """One engine on one card. `components` are the card's bytes (per rank for vLLM) and
    sum to `required_bytes`, compared with `budget_bytes`."""

    engine: str
    model: str
    card: str
    fits: bool
    weights_bytes: int  # all weights as the engine stores them (one rank's share: vLLM)
    kv_cache_bytes: int
    components: dict[str, int]
    budget_bytes: int
    n_cpu_moe: int | None = None  # llama.cpp: smallest --n-cpu-moe that fits
    cpu_ram_bytes: int = 0  # llama.cpp: host RAM for the offloaded experts + embeddings
    tensor_parallel: int | None = None  # vLLM: the TP degree planned
    settings: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    @property
    def required_bytes(self) -> int:
        return sum(self.components.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "model": self.model,
            "card": self.card,
            "fits": self.fits,
            "weights_bytes": self.weights_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,
            "required_bytes": self.required_bytes,
            "budget_bytes": self.budget_bytes,
            "components": dict(self.components),
            "n_cpu_moe": self.n_cpu_moe,
            "cpu_ram_bytes": self.cpu_ram_bytes,
            "tensor_parallel": self.tensor_parallel,
            "settings": dict(self.settings),
            "notes": list(self.notes),
        }


def _context_bytes(card: Card) -> int:
    return CUDA_CONTEXT_BYTES if card.is_cuda else 0


def _card(card: Card | str) -> Card:
    return card if isinstance(card, Card) else get_card(card)


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ConfigError(f"{name} {value} is not a positive number", f"pass {name} N >= 1")


# ---------------------------------------------------------------- llama.cpp


def gguf_tensor_bytes(spec: ModelSpec, quant: str) -> list[tuple[Tensor, str, int]]:
    """Each tensor of the GGUF `quant` file: (tensor, ggml type, bytes)."""
    inv = inventory(spec)
    ftype = get_file_type(quant)
    types = tensor_types(list(inv.tensors), ftype, spec.num_layers, spec.num_experts)
    return [(t, ty, int(type_bytes(ty, t.numel))) for t, ty in zip(inv.tensors, types, strict=True)]


def compute_buffer_bytes(spec: ModelSpec, ubatch: int = UBATCH) -> int:
    """llama.cpp's compute buffer (approximate, flash attention on): one micro-batch's fp32
    logits and the largest layer's intermediate activations."""
    mlp = max(spec.top_k * spec.expert_intermediate_size, spec.dense_intermediate_size)
    return 4 * ubatch * (spec.vocab_size + 4 * spec.hidden_size + 3 * mlp)


def plan_llama_cpp(
    spec: ModelSpec,
    card: Card | str,
    quant: str = "Q4_K_M",
    ctx: int = 32768,
    kv_type: str = "f16",
) -> ServePlan:
    """llama.cpp on `card`: GGUF weights, KV cache for `ctx`, and the smallest --n-cpu-moe."""
    chosen = _card(card)
    _positive("--ctx", ctx)
    if kv_type not in KV_TYPES:
        raise ConfigError(
            f"unknown KV cache type {kv_type!r}", f"use one of: {', '.join(KV_TYPES)}"
        )
    rows = gguf_tensor_bytes(spec, quant)
    inv = inventory(spec)
    weights = sum(b for _, _, b in rows)
    embd = sum(b for t, _, b in rows if t.category == "token_embd")
    tied_copy = embd if not any(t.category == "output" for t, _, _ in rows) else 0
    experts = [
        sum(b for t, _, b in rows if t.routed and t.layer == i) for i in range(spec.num_layers)
    ]
    kv = kv_cache_bytes(inv, ctx, KV_TYPES[kv_type], extra=UBATCH)
    fixed = {"kv_cache": kv, "compute_buffer": compute_buffer_bytes(spec),
             "cuda_context": _context_bytes(chosen)}  # fmt: skip
    settings = {
        "quant": get_file_type(quant).name,
        "ctx": ctx,
        "kv_type": kv_type,
        "ubatch": UBATCH,
    }
    unified = chosen.kind != "cuda"
    gpu_weights = weights if unified else weights - embd + tied_copy
    n, on_cpu = _smallest_n(
        experts, gpu_weights + sum(fixed.values()), chosen.usable_bytes, unified
    )
    components = {"weights": gpu_weights - on_cpu, **fixed}
    return ServePlan(
        engine="llama.cpp", model=spec.name, card=chosen.id,
        fits=sum(components.values()) <= chosen.usable_bytes,
        weights_bytes=weights, kv_cache_bytes=kv, components=components,
        budget_bytes=chosen.usable_bytes, n_cpu_moe=n,
        cpu_ram_bytes=0 if unified else on_cpu + embd, settings=settings,
        notes=_llama_notes(spec, chosen, n, inv),
    )  # fmt: skip


def _smallest_n(
    experts: list[int], gpu_total: int, usable: int, unified: bool
) -> tuple[int | None, int]:
    """(N, bytes moved to RAM): the smallest --n-cpu-moe whose GPU share fits; None (all
    layers' experts moved) when none does. Unified memory: 0, nothing moves."""
    if unified:
        return 0, 0
    moved = 0
    for n in range(len(experts) + 1):
        if gpu_total - moved <= usable:
            return n, moved
        moved += experts[n] if n < len(experts) else 0
    return None, sum(experts)


def _llama_notes(spec: ModelSpec, card: Card, n: int | None, inv: Inventory) -> tuple[str, ...]:
    notes = list(inv.notes)
    if card.kind != "cuda":
        notes.append(
            f"{card.id} is unified memory: CPU and GPU share one pool, so --n-cpu-moe frees "
            "nothing and slows decode – offload everything to the GPU (-ngl 99, no --n-cpu-moe)"
        )
    elif n is None:
        notes.append(
            "does not fit even with every layer's experts in RAM: lower --ctx, pick a smaller "
            "quant, or also keep whole layers on the CPU (-ngl)"
        )
    elif n:
        notes.append(
            f"llama-server -ngl 99 --n-cpu-moe {n}: blocks 0–{n - 1}'s routed experts in RAM"
        )
    notes.append(
        "token embeddings stay in host RAM (llama.cpp's input layer); compute buffer approximate"
    )
    return tuple(notes)


# ---------------------------------------------------------------- engines


@dataclass(frozen=True)
class Engine:
    """A serving engine: its planner and the options it takes."""

    name: str
    plan: Callable[..., ServePlan]
    options: tuple[str, ...]


# The registry imports none of its engines: llama.cpp registers below (it is planned in
# this module), vLLM in vllm.py, which plan/serve/__init__.py imports.
ENGINES: Registry[Engine] = Registry("serving engine")
ENGINES.add("llama.cpp", Engine("llama.cpp", plan_llama_cpp, ("quant", "ctx", "kv_type")))


def get_engine(name: str) -> Engine:
    return ENGINES.get(name.strip().lower())


def serve_plans(
    spec: ModelSpec, cards: list[str], engine: str, **options: Any
) -> dict[str, ServePlan]:
    """Per card, `engine`'s plan; options the engine does not take are ignored (None: its
    default)."""
    chosen = get_engine(engine)
    kept = {k: v for k, v in options.items() if k in chosen.options and v is not None}
    resolved = [get_card(c) for c in cards]  # every card id checked before any planning
    return {c.id: chosen.plan(spec, c, **kept) for c in resolved}
