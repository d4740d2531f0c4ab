"""vLLM's memory on one card per tensor-parallel rank (see `plan.serve` for the model).

vLLM's LoRA buffers (vllm/lora/layers): every LoRA-wrapped Linear holds
`lora_a_stacked [max_loras, 1, max_rank, in]` and `lora_b_stacked [max_loras, 1, out, max_rank]`
in the model dtype (column-parallel layers shard `out`, row-parallel ones `in`); fused MoE
layers hold, per local expert, `w13_lora_a [max_loras, E, r, H]` ×2 (gate, up),
`w13_lora_b [max_loras, E, I/tp, r]` ×2, `w2_lora_a [max_loras, E, r, I/tp]` and
`w2_lora_b [max_loras, E, H, r]`. Routers and the LM head get none here.
"""

from __future__ import annotations

from typing import Any

from moetune.errors import ConfigError
from moetune.model.families.serving import VLLM_RANKS
from moetune.model.spec import ModelSpec
from moetune.plan.hardware import Card
from moetune.plan.serve.engines import (
    _ROW_PARALLEL,
    ENGINES,
    Engine,
    GiB,
    Inventory,
    ServePlan,
    _card,
    _context_bytes,
    _positive,
    inventory,
)

TP_DEGREES = (1, 2, 4, 8)
BLOCK = 16  # vLLM's KV block size (tokens)
CUDA_GRAPHS = GiB  # vLLM's CUDA-graph pool, approximate (--enforce-eager: none)
MAX_BATCHED_TOKENS = 8192  # `vllm serve` default max_num_batched_tokens (profile run)
MAX_SEQS = 256  # default max_num_seqs: the sampler's fp32 logits in the profile run
KV_DTYPES = {"auto": 2, "bf16": 2, "fp8": 1}
VLLM_KV_FLAG = {"bf16": "bfloat16", "fp8": "fp8"}  # --kv-cache-dtype's spelling of each


def checkpoint_weight_bytes(spec: ModelSpec, inv: Inventory) -> tuple[int, int]:
    """(sharded, replicated) bytes of the checkpoint as vLLM loads it: bf16, or fp8 Linears
    (1 B + a fp32 scale per 128×128 block) / MXFP4 expert stacks (4.25 bits)."""
    sharded = replicated = 0.0
    for t in inv.tensors:
        size = 2.0
        if spec.quant_method == "fp8" and t.quantizable and t.layer is not None:
            size = 1 + 4 / (128 * 128)
        elif spec.quant_method == "mxfp4" and t.routed:
            size = 17 / 32
        if t.category in ("norm", "router"):
            replicated += t.numel * size
        else:
            sharded += t.numel * size
    return int(sharded), int(replicated)


def lora_buffer_bytes(spec: ModelSpec, inv: Inventory, max_loras: int, rank: int, tp: int) -> int:
    """One rank's LoRA buffers (bf16) for `max_loras` slots of `rank` (module docstring)."""
    if max_loras == 0:
        return 0
    per_slot = 0
    for leaf, fan_in, fan_out in inv.linears:
        if leaf in _ROW_PARALLEL:
            per_slot += rank * (-(-fan_in // tp) + fan_out)
        else:
            per_slot += rank * (fan_in + -(-fan_out // tp))
    h, inter = spec.hidden_size, -(-spec.expert_intermediate_size // tp)
    per_slot += len(spec.moe_layers) * spec.num_experts * rank * (3 * h + 3 * inter)
    return 2 * max_loras * per_slot


def kv_bytes_per_rank(spec: ModelSpec, inv: Inventory, tokens: int, tp: int, value: int) -> int:
    """One sequence of `tokens` (rounded up to KV blocks) on one rank: KV heads shard while
    tp ≤ heads (then each rank holds ceil(heads / tp)); MLA's latent is replicated."""
    tokens = -(-tokens // BLOCK) * BLOCK
    heads = max(1, spec.num_kv_heads)
    share = -(-heads // tp) / heads
    total = 0.0
    for c in inv.caches:
        cells = min(tokens, c.window) if c.kind == "sliding" else tokens
        width = c.per_token if c.kind == "mla" else c.per_token * share
        total += c.state_bytes / tp + width * cells * value
    return int(total)


def activation_bytes(spec: ModelSpec, tp: int) -> int:
    """The profile run's peak activations (approximate): a max_num_batched_tokens forward's
    hidden states and one MoE layer's routed intermediates, plus the sampler's fp32 logits."""
    mlp = max(spec.top_k * spec.expert_intermediate_size, spec.dense_intermediate_size)
    tokens = MAX_BATCHED_TOKENS * 2 * (8 * spec.hidden_size + 3 * -(-mlp // tp))
    return tokens + MAX_SEQS * 4 * spec.vocab_size


def plan_vllm(
    spec: ModelSpec,
    card: Card | str,
    max_model_len: int = 32768,
    max_loras: int = 1,
    max_lora_rank: int = 16,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel: int | None = None,
    kv_dtype: str = "auto",
) -> ServePlan:
    """vLLM on `card`: per rank at `tensor_parallel` (None: the smallest degree that fits)."""
    chosen = _card(card)
    _positive("--max-model-len", max_model_len)
    _check(gpu_memory_utilization, max_loras, max_lora_rank, kv_dtype)
    args = (spec, chosen, max_model_len, max_loras, max_lora_rank, gpu_memory_utilization, kv_dtype)
    if tensor_parallel is not None:
        _check_tp(spec, tensor_parallel)
        return _at_tp(*args, tensor_parallel)
    plans = [_at_tp(*args, tp) for tp in TP_DEGREES if spec.num_attention_heads % tp == 0]
    return next((p for p in plans if p.fits), plans[-1])


def _check(util: float, max_loras: int, rank: int, kv_dtype: str) -> None:
    if not 0 < util <= 1:
        raise ConfigError(f"--gpu-memory-utilization {util} is not in (0, 1]", "pass e.g. 0.9")
    if max_loras < 0:
        raise ConfigError(f"--max-loras {max_loras} is negative", "pass 0 (no LoRA) or more")
    if rank not in VLLM_RANKS:
        raise ConfigError(
            f"--max-lora-rank {rank} is not a rank vLLM accepts",
            f"use one of: {', '.join(map(str, VLLM_RANKS))} (the smallest ≥ the adapter's r)",
        )
    if kv_dtype not in KV_DTYPES:
        raise ConfigError(f"unknown --kv-dtype {kv_dtype!r}", f"use one of: {', '.join(KV_DTYPES)}")


def _check_tp(spec: ModelSpec, tp: int) -> None:
    if tp < 1 or spec.num_attention_heads % tp:
        valid = ", ".join(str(t) for t in TP_DEGREES if spec.num_attention_heads % t == 0)
        raise ConfigError(
            f"--tp {tp} does not divide the {spec.num_attention_heads} attention heads",
            f"use one of: {valid}",
        )


def _at_tp(
    spec: ModelSpec, card: Card, max_len: int, loras: int, rank: int, util: float, kv: str, tp: int
) -> ServePlan:
    inv = inventory(spec)
    sharded, replicated = checkpoint_weight_bytes(spec, inv)
    weights = -(-sharded // tp) + replicated
    kv_bytes = kv_bytes_per_rank(spec, inv, max_len, tp, KV_DTYPES[kv])
    components = {
        "weights": weights,
        "kv_cache": kv_bytes,
        "lora_buffers": lora_buffer_bytes(spec, inv, loras, rank, tp),
        "activations": activation_bytes(spec, tp),
        "cuda_graphs": CUDA_GRAPHS,
        "cuda_context": _context_bytes(card),
    }
    budget = int(util * card.usable_bytes)
    settings = {"max_model_len": max_len, "max_loras": loras, "max_lora_rank": rank,
                "gpu_memory_utilization": util, "kv_dtype": kv}  # fmt: skip
    fits = sum(components.values()) <= budget
    return ServePlan(
        engine="vllm", model=spec.name, card=card.id, fits=fits, weights_bytes=weights,
        kv_cache_bytes=kv_bytes, components=components, budget_bytes=budget,
        tensor_parallel=tp, settings=settings, notes=_notes(spec, card, inv, tp, fits, settings),
    )  # fmt: skip


def _notes(
    spec: ModelSpec, card: Card, inv: Inventory, tp: int, fits: bool, settings: dict[str, Any]
) -> tuple[str, ...]:
    notes = list(inv.notes)
    if card.kind == "mps":
        notes.append(f"{card.id}: vLLM has no Apple Metal backend (serve with llama.cpp or mlx-lm)")
    flags = f"--tensor-parallel-size {tp} --max-model-len {settings['max_model_len']}"
    flags += f" --gpu-memory-utilization {settings['gpu_memory_utilization']}"
    if settings["kv_dtype"] != "auto":
        flags += f" --kv-cache-dtype {VLLM_KV_FLAG[settings['kv_dtype']]}"
    if settings["max_loras"]:  # every choice planned for is in the line that serves it
        flags += f" --enable-lora --max-loras {settings['max_loras']}"
        flags += f" --max-lora-rank {settings['max_lora_rank']}"
    notes.append(f"vllm serve {spec.name} {flags}" if fits else f"does not fit at TP {tp}")
    notes.append("activations (profile run) and the CUDA-graph pool are approximate")
    return tuple(notes)


VLLM_OPTIONS = ("max_model_len", "max_loras", "max_lora_rank", "gpu_memory_utilization",
                "tensor_parallel", "kv_dtype")  # fmt: skip
ENGINES.add("vllm", Engine("vllm", plan_vllm, VLLM_OPTIONS))
