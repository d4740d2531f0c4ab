"""What one decoder layer saves for backward, per token, by family (a registry).

Each number is the bytes autograd keeps per token (or per query·key pair) in the
transformers 5.24 / peft 0.21 forward, read off the fake-tensor trace's saved tensors
(`torch.autograd.graph.saved_tensors_hooks`) layer by layer and checked against
`trace_step` with 1–3 layer models at three sequence lengths:

- RMSNorm (HF): an fp32 copy of its input (4 B per element) survives for backward.
- SDPA with a fused kernel (flash / memory-efficient): q, k, v and the output in bf16,
  plus the fp32 log-sum-exp per head; grouped KV heads are not expanded.
- q/k RMSNorms before it (Qwen3 per head; OLMoE, MiniMax-M2 full width): + fp32 q and k.
- Eager attention (gpt-oss: sinks): q and the repeated k, v, plus the bf16 attention
  probabilities – `2·heads` bytes per query·key pair – and one additive mask per layer type.
- MLA (DeepSeek) under SDPA: where v's head dim differs from q/k's (every released MLA
  model), no fused CPU kernel takes that, and the trace falls back to the math kernel,
  which upcasts q, k, v and the probabilities to fp32 (`4·heads` per pair); equal head
  dims (tiny test models) take the fused kernel. On CUDA the memory-efficient kernel accepts
  a different v dim and keeps none of the pair term: the trace (and so this profile) is
  conservative there.
- Output-gated attention (Qwen3-Next, Qwen3.5): per-head q/k RMSNorms as Qwen3, plus the
  sigmoid gate on the attention output (its input and output, bf16).
- Gated DeltaNet (`linear_attention`: Qwen3-Next, Qwen3.5) through transformers' torch
  `chunk_gated_delta_rule` (what runs without flash-linear-attention, and what the trace
  runs): the causal conv's input and output, fp32 l2-normed q/k repeated to the value
  heads, per 64-token chunk a C×C decay/attention matrix per head and a dk×dv state, and
  the gated RMSNorm on the output – all linear in tokens (C = 64 is the kernel's chunk).
- DeepSeek sparse attention (V3.2, and every MLA family with an indexer: GLM-5's
  glm_moe_dsa, Mistral Large 4, dots3): MLA plus, per layer, the indexer's top-k mask over
  the keys (bf16 per pair); the indexer runs without grad but makes fp32 scores per index
  head and pair while the layer runs forward (again in the recompute); LoRA on its
  Linears keeps no inputs (and gets no gradient).
- Short convolution (`conv`: LFM2-MoE) through transformers' torch `causal_conv1d_fn`
  (what runs without the causal-conv1d kernel): autograd keeps in_proj's B, C, x output
  (6·H bf16), B·x (the conv input, 2·H) and the padded depthwise conv output (2·H); the
  layer's backward adds about 6·H of transposed copies – 16·H per token in all, fitted to the
  trace at hidden 64 and 128, seq 64 and 128 (the padding's (kernel − 1) columns per
  sequence are left out).
- Mamba2 (`mamba`: granitemoehybrid) through transformers' torch `mamba2_chunk_scan` (what
  runs without mamba-ssm): the projections and conv in bf16, then fp32 x·dt, B and C
  repeated to every head, per chunk the C×C decay / C·B / masked matrices per head and the
  chunk states – fitted to the trace as 33·inner + 3·heads·chunk + 28·heads·state per token
  on three tiny shapes (4 × 32 heads, chunk 32 / 16; 8 × 16 heads) and checked on a fourth
  (state 32); the pad to a whole chunk and the per-layer constant are left out.
- Kimi delta attention (`linear_attention`: kimi_linear, bailing_hybrid) through transformers'
  torch `chunk_kimi_delta_attention` (no flash-linear-attention): its decay is per channel, so
  per 64-token chunk it makes C×C×dk fp32 tensors per head – the decay mask, k_β·k and q·k
  products (12·C·dk per head per token) – plus the row loop's clones (Σ i² over the chunk)
  and about 111 bytes per head dim; its backward holds ~2.25 more decay-sized gradients.
  Fitted to the trace on three tiny shapes (4 × 16, 8 × 16, 4 × 32 heads × dim) and checked
  on two held out (4 × 8, 2 × 64: kept within 2.4 %).
- Lightning attention (`linear_attention`: minimax) through its torch block loop (bf16): per
  head the qkv activation, copies of q/k/v per block and the gated norm (~24·d), each block's
  decayed q·kᵀ (2·B per token) and the d×d state per block (2·d²/B) – read off the saved
  tensors at three shapes and within 1.6 % kept of the trace at three (block 16, d 32).
  MiniMax's full-attention layers get SDPA a sliding-window mask when the config sets one: k, v
  are repeated to every head and the bf16 mask (2 B per pair) is kept per layer.
- lara_mini: Qwen3.5's gated DeltaNet (the term above) beside per-head qk-norm attention; its
  `sliding_attention` layers take the masked SDPA term (a term by layer type).
- Hyper-connected hybrids (a profile's `streams` / `residual` / `head`; terms and fits in
  `plan.terms_hybrid`): qwen4_exp_text – split-projection gated DeltaNet, QSA-indexed gated
  attention, gated residual streams; glm5_next_text – KDA beside MLA + DSA, mHC streams. Their
  eager expert loops, routed balanced as the trace routes them, keep what the grouped_mm term
  sizes per routed token.
- Experts (grouped_mm): the gathered input (2·k·H) when the stacks need a weight gradient,
  the gate/up output and its activation (`gate_saved`·k·I), the down input (2·k·I, again
  only with LoRA on the stacks) and the down output for the routing-weight product (2·k·H).

A layer's token mixer (`ModelSpec.mixers`) picks its term: `MIXERS` by kind, which a
family's profile overrides where its mixer differs (and, by the config's `layer_types`,
where one type of layer keeps more: lara_mini's sliding windows). A kind with no term here is not
calibrated, and the planner traces instead (`uncalibrated`). Extend by registering a term
under a mixer kind, or a profile under a model_type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from moetune.model.spec import ModelSpec
from moetune.plan import terms_hybrid as hyper
from moetune.plan.terms_hybrid import gated_delta_net

SpecInt = Callable[[ModelSpec], int]


def _zero(_: ModelSpec) -> int:
    return 0


def _one(_: ModelSpec) -> int:
    return 1


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
        "kv_b": spec.num_attention_heads * (c["qk_nope_head_dim"] + c["v_head_dim"]),
        "norms": c.get("kv_lora_rank") or 0,
        "q_norm": c.get("q_lora_rank") or 0,
    }


def _mla_math(spec: ModelSpec) -> bool:
    """No fused CPU kernel takes a v head dim unlike q/k's: SDPA runs the math kernel."""
    m = _mla(spec)
    return bool(m["qk"] != m["v"])


def mla_attention(spec: ModelSpec) -> int:
    """MLA's kv_a / q_a RMSNorms plus its SDPA: the math kernel's fp32 q, k, v, or (equal
    head dims) the fused kernel's bf16 q, k, out, fp32 log-sum-exp per head, and v – a view
    that keeps kv_b_proj's whole output (k_nope and v) alive."""
    m = _mla(spec)
    norms = 4 * (m["norms"] + m["q_norm"])
    if _mla_math(spec):
        return norms + 4 * (2 * m["qk"] + m["v"])
    rstd = 4 * (bool(m["norms"]) + bool(m["q_norm"]))
    return norms + rstd + 2 * (2 * m["qk"] + m["kv_b"] + m["v"]) + 4 * spec.num_attention_heads


def mla_pairs(spec: ModelSpec) -> int:
    """The math kernel's fp32 probabilities, per query·key pair; the fused kernel: none."""
    return 4 * spec.num_attention_heads if _mla_math(spec) else 0


def sdpa_gated_qk_norm(spec: ModelSpec) -> int:
    """Per-head q/k norms (+ their fp32 rstd) and a sigmoid gate on the output (Qwen3-Next)."""
    q, _, heads = _dims(spec)
    return sdpa_fused_qk_norm(spec) + 4 * q + 4 * (heads + spec.num_kv_heads)


def short_conv(spec: ModelSpec) -> int:
    """LFM2's gated short convolution, per token: 16·H (see the module docstring)."""
    return 16 * spec.hidden_size


def mamba2_chunked(spec: ModelSpec) -> int:
    """Mamba2 through transformers' torch chunked scan, per token (see the module docstring)."""
    c = spec.hf_config
    heads, state = c["mamba_n_heads"], c["mamba_d_state"]
    inner = heads * c["mamba_d_head"]
    return 33 * inner + 3 * heads * c["mamba_chunk_size"] + 28 * heads * state


KDA_CHUNK = 64  # chunk_kimi_delta_attention's chunk size
KDA_BACKWARD = 2.25  # decay-mask-sized fp32 gradients alive at once in its backward (fitted)


def _kda(spec: ModelSpec) -> tuple[int, int, int]:
    """(heads, head dim, chunk) of Kimi delta attention: q, k and v share the head dim."""
    c = spec.hf_config
    return c["linear_num_heads"], c["linear_head_dim"], KDA_CHUNK


def kimi_delta_attention(spec: ModelSpec) -> int:
    """KDA through transformers' torch chunked kernel, per token (see the module docstring)."""
    heads, dk, chunk = _kda(spec)
    triangle = 4 * (chunk - 1) * (2 * chunk - 1) // 6  # the row loop's clones, Σ i² / C
    per_head = 12 * chunk * dk + triangle + 111 * dk + 6 * dk * dk // chunk + 277
    return heads * per_head


def kda_backward(spec: ModelSpec) -> int:
    """KDA's backward: gradients of its per-channel C×C×dk decay tensors (fp32)."""
    heads, dk, chunk = _kda(spec)
    return int(KDA_BACKWARD * 4 * heads * chunk * dk)


LIGHTNING = (24, 2)  # bytes per head dim, per block position (fitted; see below)


def lightning_attention(spec: ModelSpec) -> int:
    """MiniMax's lightning attention (its torch block loop, bf16), per token: per head the
    projections' activations and copies (~24·d), each block's masked q·k (2·B) and the
    d×d state per block (2·d²/B) – fitted to the trace (see the module docstring)."""
    d, block = spec.head_dim, spec.hf_config["block_size"]
    return spec.num_attention_heads * (LIGHTNING[0] * d + LIGHTNING[1] * block + 2 * d * d // block)


def sdpa_masked(spec: ModelSpec) -> int:
    """SDPA given a mask (a sliding window): k and v are repeated to every head first."""
    q, _, heads = _dims(spec)
    return 2 * 4 * q + 4 * heads


def sdpa_masked_qk_norm(spec: ModelSpec) -> int:
    """Masked SDPA after per-head q/k RMSNorms: + fp32 q and k (as `sdpa_fused_qk_norm`)."""
    q, kv, _ = _dims(spec)
    return sdpa_masked(spec) + 4 * (q + kv)


def dsa_pairs(spec: ModelSpec) -> int:
    """MLA's pairs plus DeepSeek sparse attention's top-k mask (bf16, one per layer)."""
    return mla_pairs(spec) + 2


def indexer_scores(spec: ModelSpec) -> int:
    """The indexer's fp32 q·k scores per index head, and their scaled / relu'd copy."""
    return 2 * 4 * spec.hf_config["index_n_heads"]


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
    # per pair, alive only while the mixer runs forward (or recomputes): DSA's index scores
    forward_pairs: SpecInt = _zero
    # per token, alive only while the mixer runs backward, beyond its saved set
    backward: SpecInt = _zero
    no_grad: tuple[str, ...] = ()  # submodules run under torch.no_grad: adapters there keep nothing
    notes: str = ""
    fields: tuple[str, ...] = ()  # config fields the term reads (a spec without them: no term)
    absent: tuple[str, ...] = ()  # fields of a variant the term does not size

    def fits(self, spec: ModelSpec) -> bool:
        c = spec.hf_config
        return all(c.get(f) is not None for f in self.fields) and not any(
            c.get(f) for f in self.absent
        )


NO_MIXER = MixerTerm(_zero)
MLA_NOTE = (
    "MLA attention is sized as the trace runs it (math SDPA, s² per head in fp32); CUDA's "
    "memory-efficient kernel keeps no s² term, so long sequences need less on a GPU"
)
DELTA_NOTE = (
    "linear attention is sized as transformers' torch chunked gated-delta kernel keeps it "
    "(what runs without flash-linear-attention); fla's fused kernels keep less"
)
_MLA_FIELDS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_DELTA_FIELDS = (
    "linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
    "linear_value_head_dim",
)  # fmt: skip
MLA = MixerTerm(
    mla_attention,
    pairs=mla_pairs,
    pair_transient=1.45,
    notes=MLA_NOTE,
    fields=_MLA_FIELDS,
    absent=("index_n_heads",),  # a DSA indexer: its family's profile sizes it
)
DSA = dataclasses.replace(
    MLA,
    pairs=dsa_pairs,
    forward_pairs=indexer_scores,
    fields=(*_MLA_FIELDS, "index_n_heads"),
    absent=(),
    no_grad=("indexer.",),
    notes=MLA_NOTE + "; the DSA indexer's s² scores per index head are sized in fp32",
)
# Only kinds whose kernel is the same across families; linear attention differs by family
# (gated DeltaNet, KDA, lightning …), so its terms sit in the families' profiles.
MIXERS: dict[str, MixerTerm] = {"attention": MixerTerm(sdpa_fused), "mla": MLA, "none": NO_MIXER}
DELTA_NET = MixerTerm(gated_delta_net, notes=DELTA_NOTE, fields=_DELTA_FIELDS)
SHORT_CONV = MixerTerm(
    short_conv,
    notes="short convolutions are sized as transformers' torch causal_conv1d_fn keeps them",
)
MAMBA2 = MixerTerm(
    mamba2_chunked,
    notes="Mamba2 is sized as transformers' torch chunked scan keeps it (no mamba-ssm)",
    fields=("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_chunk_size"),
)
KDA = MixerTerm(
    kimi_delta_attention,
    backward=kda_backward,
    notes=(
        "Kimi delta attention is sized as transformers' torch chunked kernel keeps it (per "
        "channel C×C×dk decay tensors in fp32; no flash-linear-attention): fla keeps far less"
    ),
    fields=("linear_num_heads", "linear_head_dim"),
)
LIGHTNING_TERM = MixerTerm(
    lightning_attention,
    notes="lightning attention is sized as transformers' torch block loop keeps it",
    fields=("block_size",),
)
SLIDING = MixerTerm(
    sdpa_masked,
    pairs=lambda _: 2,  # the window's mask, in bf16, per layer
    fields=("sliding_window",),
)
# a kind's other terms, tried in order when the family's own does not fit its config
VARIANTS: dict[str, tuple[MixerTerm, ...]] = {
    "mla": (MLA, DSA),
    "attention": (MIXERS["attention"],),
}


@dataclass(frozen=True)
class ActivationProfile:
    """Per-token saved bytes of one family's decoder layer (see the module docstring)."""

    # the family's own mixer terms over `MIXERS`; None: this family's kind is not calibrated
    mixers: dict[str, MixerTerm | None] = field(default_factory=dict)
    kind: str = "attention"  # every layer's mixer when a spec names none (hand-written tables)
    # terms by the config's layer type, over the kind's (lara_mini's sliding-window layers)
    by_layer_type: dict[str, MixerTerm] = field(default_factory=dict)
    masks: SpecInt = _zero  # s×s bf16 masks alive for the whole step
    gate_saved: int = 8  # × k·I: gate/up output + activation product (gated experts)
    glu_saved: int = 6  # × I: the same for dense and shared GLU MLPs
    shared_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate) × shared output
    norms: int = 2  # RMSNorms per layer (input + post-attention)
    # hyper-connections: residual streams per token, each layer's stream mixing per token, and
    # the final collapse of the streams per token (plan.terms_hyper)
    streams: SpecInt = _one
    residual: SpecInt = _zero
    mlp_residual: SpecInt = _zero  # the MLP side's share of `residual`
    head: SpecInt = _zero
    notes: str = ""

    def term(self, kind: str) -> MixerTerm | None:
        """The saved-bytes term of a mixer kind; None when it is not calibrated."""
        return self.mixers[kind] if kind in self.mixers else MIXERS.get(kind)


DEFAULT = ActivationProfile()
QK_NORM = ActivationProfile(mixers={"attention": MixerTerm(sdpa_fused_qk_norm)})
QWEN3_NEXT = ActivationProfile(  # output-gated attention between gated DeltaNet layers
    mixers={"attention": MixerTerm(sdpa_gated_qk_norm), "linear_attention": DELTA_NET}
)
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

LARA_MINI = ActivationProfile(  # Qwen3.5's gated DeltaNet between per-head qk-norm attention
    mixers={"attention": MixerTerm(sdpa_fused_qk_norm), "linear_attention": DELTA_NET},
    # its sliding-window layers pass SDPA a mask: k, v repeated to every head + the mask
    by_layer_type={
        "sliding_attention": dataclasses.replace(SLIDING, per_token=sdpa_masked_qk_norm)
    },
)

QWEN4_EXP = ActivationProfile(  # gated DeltaNet beside QSA-indexed attention, 4 streams
    mixers={
        "linear_attention": dataclasses.replace(DELTA_NET, per_token=hyper.split_delta_net),
        "attention": MixerTerm(hyper.qsa_attention, pairs=hyper.qsa_masks, no_grad=("indexer.",)),
    },
    norms=0,  # no layer norms: each gated residual normalises the streams
    shared_gate=True,
    streams=hyper.hyper_streams,
    residual=hyper.gated_residual_layer,
    head=hyper.gated_residual_head,
)

GLM5_NEXT = ActivationProfile(  # KDA beside MLA + a pooled DSA indexer, 4 mHC streams
    mixers={"linear_attention": KDA},
    streams=hyper.hyper_streams,
    residual=hyper.mhc_layer,
    mlp_residual=hyper.mhc_mlp_side,
    gate_saved=14,  # clamped SwiGLU: as gpt_oss's, the clamps' copies beyond gate_up
    glu_saved=10,  # the dense and shared MLPs clamp too: + the clamped gate and up
)

PROFILES: dict[str, ActivationProfile] = {
    "qwen3_moe": QK_NORM,
    "olmoe": QK_NORM,
    "minimax_m2": QK_NORM,  # full-width q/k norms, as OLMoE
    "qwen3_next": QWEN3_NEXT,
    "qwen3_5_moe_text": QWEN3_NEXT,
    "qwen4_exp_text": QWEN4_EXP,
    "glm5_next_text": GLM5_NEXT,
    "qwen2_moe": ActivationProfile(shared_gate=True),
    "lfm2_moe": ActivationProfile(mixers={"conv": SHORT_CONV}),
    "minimax": ActivationProfile(mixers={"attention": SLIDING, "linear_attention": LIGHTNING_TERM}),
    "lara_mini": LARA_MINI,
    "kimi_linear": ActivationProfile(mixers={"linear_attention": KDA}),  # + MLA (NoPE)
    "bailing_hybrid": ActivationProfile(mixers={"linear_attention": KDA}),
    "granitemoehybrid": ActivationProfile(mixers={"mamba": MAMBA2}),
    "mixtral": DEFAULT,
    "gpt_oss": ActivationProfile(
        mixers={"attention": SINKS},
        masks=layer_type_masks,
        # gate clamp + sigmoid·alpha + (up + 1) products: five k·I tensors beyond gate_up
        gate_saved=14,
    ),
    "deepseek_v2": ActivationProfile(kind="mla"),
    "deepseek_v3": ActivationProfile(kind="mla"),
    "deepseek_v32": ActivationProfile(kind="mla", mixers={"mla": DSA}),
    "gemma4_text": ActivationProfile(mixers={"attention": None}, notes=GEMMA4_NOTE),
    # MLA + a DSA indexer, but more than the DSA term sizes (tiny configs, seq 128, gc off:
    # the layers keep 19 % / 57 % more): axk2's low-rank gated input norm and output gate,
    # hy_v4's hyper-connections
    "axk2": ActivationProfile(mixers={"mla": None}),
    "hy_v4": ActivationProfile(mixers={"mla": None}),
    "hy_v4_vl_text": ActivationProfile(mixers={"mla": None}),
    # JetMoe's attention is itself a mixture of experts (routed q/o projections per token):
    # the GQA term sizes 36 % less than the trace keeps (tiny config, seq 256, gc on)
    "jetmoe": ActivationProfile(mixers={"attention": None}),
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
    """Each layer's mixer term; None where its kind has no calibrated term for `spec`."""
    prof = profile_for(spec.model_type)
    types = list(spec.hf_config.get("layer_types") or [])
    kinds = layer_kinds(spec)
    types += [""] * (len(kinds) - len(types))
    return tuple(
        prof.by_layer_type.get(t) or _term(prof, k, spec) if k else NO_MIXER
        for k, t in zip(kinds, types, strict=False)
    )


def _term(prof: ActivationProfile, kind: str, spec: ModelSpec) -> MixerTerm | None:
    """The profile's term for `kind` where it fits `spec`, else the kind's variant that does
    (MLA with a DSA indexer); None when neither sizes this layer."""
    term = prof.term(kind) if kind else NO_MIXER
    if term is None:
        return None
    fitting = [t for t in (term, *VARIANTS.get(kind, ())) if t.fits(spec)]
    return fitting[0] if fitting else None


def uncalibrated(spec: ModelSpec) -> list[str]:
    """Mixer kinds of `spec` with no calibrated analytic term (the plan traces those)."""
    kinds, terms = layer_kinds(spec), layer_terms(spec)
    return list(dict.fromkeys(k for k, t in zip(kinds, terms, strict=True) if t is None))


def mixer_notes(spec: ModelSpec) -> list[str]:
    """The notes of the mixer terms `spec` uses, once each."""
    terms = dict.fromkeys(t for t in layer_terms(spec) if t is not None and t.notes)
    return [t.notes for t in terms]
