"""What one decoder layer saves for backward, per token, by family (a registry).

Each number is the bytes autograd keeps per token (or per query·key pair) in the
transformers 5.24 / peft 0.21 forward, read off the fake-tensor trace's saved tensors
(`torch.autograd.graph.saved_tensors_hooks`) layer by layer and checked against
`trace_step` with 1–3 layer models at three sequence lengths:

- RMSNorm (HF): an fp32 copy of its input (4 B per element) survives for backward.
- SDPA with a fused kernel (flash / memory-efficient): q, k, v and the output in bf16,
  plus the fp32 log-sum-exp per head; grouped KV heads are not expanded.
- Eager attention (gpt-oss: sinks): q and the repeated k, v, plus the bf16 attention
  probabilities – `2·heads` bytes per query·key pair – and one additive mask per layer type.
- MLA (DeepSeek) under SDPA: v's head dim differs from q/k's, no fused CPU kernel takes
  that, and the trace falls back to the math kernel, which upcasts q, k, v and the
  probabilities to fp32 (`4·heads` per pair). On CUDA the memory-efficient kernel accepts
  a different v dim and keeps none of the pair term: the trace (and so this profile) is
  conservative there.
- Experts (grouped_mm): the gathered input (2·k·H) when the stacks need a weight gradient,
  the gate/up output and its activation (`gate_saved`·k·I), the down input (2·k·I, again
  only with LoRA on the stacks) and the down output for the routing-weight product (2·k·H).

Extend by registering a profile under a model_type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moetune.model.spec import ModelSpec

SpecInt = Callable[[ModelSpec], int]


def _zero(_: ModelSpec) -> int:
    return 0


def _dims(spec: ModelSpec) -> tuple[int, int, int]:
    """(query width, key/value width, heads) of grouped-query attention."""
    heads = spec.num_attention_heads
    return heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, heads


def sdpa_fused(spec: ModelSpec) -> int:
    """Flash / memory-efficient SDPA: q, k, v, out in bf16 + fp32 logsumexp per head."""
    q, kv, heads = _dims(spec)
    return 2 * (2 * q + 2 * kv) + 4 * heads


def sdpa_fused_qk_norm(spec: ModelSpec) -> int:
    """Fused SDPA after q/k RMSNorm (Qwen3 per head, OLMoE full width): + fp32 q and k."""
    q, kv, _ = _dims(spec)
    return sdpa_fused(spec) + 4 * (q + kv)


def eager_repeat_kv(spec: ModelSpec) -> int:
    """Eager attention: q and k, v repeated to every head, in bf16."""
    q, _, _ = _dims(spec)
    return 2 * 3 * q


def _mla(spec: ModelSpec) -> dict[str, Any]:
    c = spec.hf_config
    return {
        "qk": spec.num_attention_heads * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]),
        "v": spec.num_attention_heads * c["v_head_dim"],
        "norms": c.get("kv_lora_rank") or 0,
        "q_norm": c.get("q_lora_rank") or 0,
    }


def mla_math(spec: ModelSpec) -> int:
    """MLA through the math SDPA kernel (fp32 q, k, v) plus the kv_a / q_a RMSNorms."""
    m = _mla(spec)
    return 4 * (2 * m["qk"] + m["v"]) + 4 * (m["norms"] + m["q_norm"])


def heads_pairs(bytes_per_head: int) -> SpecInt:
    """Bytes per query·key pair for kernels that materialise the probabilities."""
    return lambda spec: bytes_per_head * spec.num_attention_heads


def layer_type_masks(spec: ModelSpec) -> int:
    """One additive bf16 mask per distinct layer type (eager attention)."""
    return max(1, len(set(spec.hf_config.get("layer_types") or ["full"])))


@dataclass(frozen=True)
class ActivationProfile:
    """Per-token saved bytes of one family's decoder layer (see the module docstring)."""

    attention: SpecInt = sdpa_fused  # attention core, per token
    pairs: SpecInt = _zero  # per query·key pair (per sequence), for T² kernels
    masks: SpecInt = _zero  # s×s bf16 masks alive for the whole step
    # backward / recompute of a T² kernel: extra probability-sized tensors beyond the
    # saved one (eager: scores, masked scores, max-shifted logits; math SDPA: the fp32
    # probability gradient and softmax-backward output), fitted to the trace at s=8192
    pair_transient: float = 0.0
    gate_saved: int = 8  # × k·I: gate/up output + activation product (gated experts)
    shared_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate) × shared output
    norms: int = 2  # RMSNorms per layer (input + post-attention)
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


DEFAULT = ActivationProfile()
MLA_NOTE = (
    "MLA attention is sized as the trace runs it (math SDPA, s² per head in fp32); CUDA's "
    "memory-efficient kernel keeps no s² term, so long sequences need less on a GPU"
)

PROFILES: dict[str, ActivationProfile] = {
    "qwen3_moe": ActivationProfile(attention=sdpa_fused_qk_norm),
    "olmoe": ActivationProfile(attention=sdpa_fused_qk_norm),
    "qwen2_moe": ActivationProfile(shared_gate=True),
    "mixtral": DEFAULT,
    "gpt_oss": ActivationProfile(
        attention=eager_repeat_kv,
        pairs=heads_pairs(2),
        masks=layer_type_masks,
        pair_transient=1.6,
        # gate clamp + sigmoid·alpha + (up + 1) products: five k·I tensors beyond gate_up
        gate_saved=14,
        notes="attention sinks need eager attention: probabilities are s² per head",
    ),
    "deepseek_v2": ActivationProfile(
        attention=mla_math, pairs=heads_pairs(4), pair_transient=1.45, notes=MLA_NOTE
    ),
    "deepseek_v3": ActivationProfile(
        attention=mla_math, pairs=heads_pairs(4), pair_transient=1.45, notes=MLA_NOTE
    ),
}


def profile_for(model_type: str) -> ActivationProfile:
    """The family's profile; fused-SDPA GQA defaults for families without one."""
    return PROFILES.get(model_type, DEFAULT)
