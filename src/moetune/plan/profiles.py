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
- Output-gated attention (Qwen3-Next, Qwen3.5): per-head q/k RMSNorms as Qwen3, plus the
  sigmoid gate on the attention output (its input and output, bf16).
- Gated DeltaNet (`linear_attention`: Qwen3-Next, Qwen3.5) through transformers' torch
  `chunk_gated_delta_rule` (what runs without flash-linear-attention, and what the trace
  runs): the causal conv's input and output, fp32 l2-normed q/k repeated to the value
  heads, per 64-token chunk a C×C decay/attention matrix per head and a dk×dv state, and
  the gated RMSNorm on the output – all linear in tokens (C = 64 is the kernel's chunk).
- Experts (grouped_mm): the gathered input (2·k·H) when the stacks need a weight gradient,
  the gate/up output and its activation (`gate_saved`·k·I), the down input (2·k·I, again
  only with LoRA on the stacks) and the down output for the routing-weight product (2·k·H).

A layer's token mixer (`ModelSpec.mixers`) picks its term: `MIXERS` by kind, which a
family's profile overrides where its mixer differs. A kind with no term here is not
calibrated, and the planner traces instead (`uncalibrated`). Extend by registering a term
under a mixer kind, or a profile under a model_type.
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


def sdpa_gated_qk_norm(spec: ModelSpec) -> int:
    """Per-head q/k norms (+ their fp32 rstd) and a sigmoid gate on the output (Qwen3-Next)."""
    q, _, heads = _dims(spec)
    return sdpa_fused_qk_norm(spec) + 4 * q + 4 * (heads + spec.num_kv_heads)


DELTA_CHUNK = 64  # torch_chunk_gated_delta_rule's chunk size


def gated_delta_net(spec: ModelSpec) -> int:
    """Gated DeltaNet through the torch chunked kernel, per token (see the module docstring)."""
    c, chunk = spec.hf_config, DELTA_CHUNK
    hv, hk = c["linear_num_value_heads"], c["linear_num_key_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = 2 * hk * dk + hv * dv  # q, k, v channels through the causal conv
    # conv in/out · chunk matrices · q/k/w/u per head · v/out/norm · states · gates and norms
    per_head = 20 * chunk + 32 * dk + 26 * dv + 4 * dk * dv // chunk + 34
    return 4 * conv + hv * per_head


def heads_pairs(bytes_per_head: int) -> SpecInt:
    """Bytes per query·key pair for kernels that materialise the probabilities."""
    return lambda spec: bytes_per_head * spec.num_attention_heads


def layer_type_masks(spec: ModelSpec) -> int:
    """One additive bf16 mask per distinct layer type (eager attention)."""
    return max(1, len(set(spec.hf_config.get("layer_types") or ["full"])))


@dataclass(frozen=True)
class MixerTerm:
    """Saved bytes of one token mixer kind (see the module docstring)."""

    per_token: SpecInt  # the mixer core, per token (adapted Linears' inputs come on top)
    pairs: SpecInt = _zero  # per query·key pair (per sequence), for T² kernels
    # backward / recompute of a T² kernel: extra probability-sized tensors beyond the
    # saved one (eager: scores, masked scores, max-shifted logits; math SDPA: the fp32
    # probability gradient and softmax-backward output), fitted to the trace at s=8192
    pair_transient: float = 0.0
    notes: str = ""


MLA_NOTE = (
    "MLA attention is sized as the trace runs it (math SDPA, s² per head in fp32); CUDA's "
    "memory-efficient kernel keeps no s² term, so long sequences need less on a GPU"
)
DELTA_NOTE = (
    "linear attention is sized as transformers' torch chunked gated-delta kernel keeps it "
    "(what runs without flash-linear-attention); fla's fused kernels keep less"
)
GQA = MixerTerm(sdpa_fused)
MLA = MixerTerm(mla_math, pairs=heads_pairs(4), pair_transient=1.45, notes=MLA_NOTE)
MIXERS: dict[str, MixerTerm] = {
    "attention": GQA,
    "mla": MLA,
    "linear_attention": MixerTerm(gated_delta_net, notes=DELTA_NOTE),
}


@dataclass(frozen=True)
class ActivationProfile:
    """Per-token saved bytes of one family's decoder layer (see the module docstring)."""

    # the family's own mixer terms over `MIXERS`; None: this family's kind is not calibrated
    mixers: dict[str, MixerTerm | None] = field(default_factory=dict)
    kind: str = "attention"  # every layer's mixer when a spec names none (hand-written tables)
    masks: SpecInt = _zero  # s×s bf16 masks alive for the whole step
    gate_saved: int = 8  # × k·I: gate/up output + activation product (gated experts)
    shared_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate) × shared output
    norms: int = 2  # RMSNorms per layer (input + post-attention)
    notes: str = ""

    def term(self, kind: str) -> MixerTerm | None:
        """The saved-bytes term of a mixer kind; None when it is not calibrated."""
        if kind in self.mixers:
            return self.mixers[kind]
        return MIXERS.get(kind)


DEFAULT = ActivationProfile()
QK_NORM = ActivationProfile(mixers={"attention": MixerTerm(sdpa_fused_qk_norm)})
GATED = ActivationProfile(mixers={"attention": MixerTerm(sdpa_gated_qk_norm)})
SINKS = MixerTerm(
    eager_repeat_kv,
    pairs=heads_pairs(2),
    pair_transient=1.6,
    notes="attention sinks need eager attention: probabilities are s² per head",
)
GEMMA4_NOTE = (
    "gemma4's sliding-window layers keep an s×s mask each, and a dense MLP runs beside the "
    "experts: no calibrated analytic term yet"
)

PROFILES: dict[str, ActivationProfile] = {
    "qwen3_moe": QK_NORM,
    "olmoe": QK_NORM,
    "minimax_m2": QK_NORM,  # full-width q/k norms, as OLMoE
    "qwen3_next": GATED,
    "qwen3_5_moe_text": GATED,
    "qwen2_moe": ActivationProfile(shared_gate=True),
    "mixtral": DEFAULT,
    "gpt_oss": ActivationProfile(
        mixers={"attention": SINKS},
        masks=layer_type_masks,
        # gate clamp + sigmoid·alpha + (up + 1) products: five k·I tensors beyond gate_up
        gate_saved=14,
    ),
    "deepseek_v2": ActivationProfile(kind="mla"),
    "deepseek_v3": ActivationProfile(kind="mla"),
    "gemma4_text": ActivationProfile(mixers={"attention": None}, notes=GEMMA4_NOTE),
}


def profile_for(model_type: str) -> ActivationProfile:
    """The family's profile; fused-SDPA GQA defaults for families without one."""
    return PROFILES.get(model_type, DEFAULT)


def layer_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """Each layer's mixer kind: as built, else the profile's kind on attention layers."""
    if spec.mixers:
        return spec.mixers
    kind, attention = profile_for(spec.model_type).kind, set(spec.attention_layers)
    return tuple(kind if i in attention else "" for i in range(spec.num_layers))


def layer_terms(spec: ModelSpec) -> tuple[MixerTerm | None, ...]:
    """Each layer's mixer term (a layer without a mixer: the zero term)."""
    prof = profile_for(spec.model_type)
    return tuple(prof.term(k) if k else NO_MIXER for k in layer_kinds(spec))


def uncalibrated(spec: ModelSpec) -> list[str]:
    """Mixer kinds of `spec` with no calibrated analytic term (the plan traces those)."""
    prof = profile_for(spec.model_type)
    return [k for k in dict.fromkeys(layer_kinds(spec)) if k and prof.term(k) is None]


def mixer_notes(spec: ModelSpec) -> list[str]:
    """The notes of the mixer terms `spec` uses, once each."""
    terms = dict.fromkeys(t for t in layer_terms(spec) if t is not None and t.notes)
    return [t.notes for t in terms]


NO_MIXER = MixerTerm(_zero)
