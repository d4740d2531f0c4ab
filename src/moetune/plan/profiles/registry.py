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
- State-space mixers (`mamba`: Mamba2 in granitemoehybrid and nemotron_h, Mamba1 in jamba)
  and nemotron_h's MLP layers (`mlp`): their terms and fits are in `plan.profiles.ssm`. Without
  checkpointing a Mamba layer before the first adapted layer keeps nothing (the stream needs
  no gradient yet): the analytic leaves it out (`analytic._grad_free`).
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
- hy_v4's eager MLA with sinks and its hyper-connections (a residual of several streams,
  sized on the profile: `streams`, `residual`, `head`): see `plan.profiles.mla`.
- axk2: the DSA term plus an output gate and low-rank gated RMSNorms (`plan.profiles.axk2`).
- gemma4_text: a term by layer type (masked SDPA on sliding windows, causal on full attention
  with its own head dim), read off the trace as `plan.profiles.gemma4` says.
- Hyper-connected hybrids (a profile's `streams` / `residual` / `head`; terms and fits in
  `plan.profiles.hybrid`): qwen4_exp_text – split-projection gated DeltaNet, QSA-indexed gated
  attention, gated residual streams; glm5_next_text – KDA beside MLA + DSA, mHC streams. Their
  eager expert loops, routed balanced as the trace routes them, keep what the grouped_mm term
  sizes per routed token.
- Experts (grouped_mm): the gathered input (2·k·H) when the stacks need a weight gradient,
  the gate/up output and its activation (`gate_saved`·k·I), the down input (2·k·I, again
  only with LoRA on the stacks) and the down output for the routing-weight product (2·k·H).

Attention with its own experts or convolutions (JetMoE's mixture of attention, Inkling's
and Inkling2's relative-bias attention between fp32 short convolutions) is sized in
`plan.profiles.conv`, whose docstring says how each term was read off.

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

import moetune.plan.profiles.axk2 as axk2
import moetune.plan.profiles.conv as conv
import moetune.plan.profiles.gemma4 as g4
import moetune.plan.profiles.hybrid as hyper
import moetune.plan.profiles.mla as terms_mla
from moetune.model.spec import ModelSpec
from moetune.plan.profiles.attention import (
    eager_repeat_kv,
    heads_pairs,
    kda_backward,
    kimi_delta_attention,
    layer_type_masks,
    lightning_attention,
    sdpa_fused,
    sdpa_fused_qk_norm,
    sdpa_gated_qk_norm,
    sdpa_masked,
    sdpa_masked_qk_norm,
    short_conv,
)
from moetune.plan.profiles.hybrid import gated_delta_net
from moetune.plan.profiles.mla import dsa_pairs, indexer_scores, mla_attention, mla_pairs
from moetune.plan.profiles.ssm import (
    MAMBA1_FIELDS,
    MAMBA2_FIELDS,
    dense_mlp_layer,
    mamba1_backward,
    mamba1_scan,
    mamba2_chunked,
)

SpecInt = Callable[[ModelSpec], int]


def _zero(_: ModelSpec) -> int:
    return 0


def _one(_: ModelSpec) -> int:
    return 1


@dataclass(frozen=True)
class MixerTerm:
    """Saved bytes of one token mixer kind (see the module docstring)."""

    per_token: SpecInt  # the mixer core, per token (adapted Linears' inputs come on top)
    pairs: SpecInt = _zero  # per query·key pair (per sequence), for T² kernels
    # backward / recompute of a T² kernel: extra probability-sized tensors beyond the
    # saved one (eager: scores, masked scores, max-shifted logits; math SDPA: the fp32
    # probability gradient and softmax-backward output), alive once the MLP's saved set is
    # freed (the analytic nets it out): MLA's and eager sinks' are the trace's two (its
    # peak op, softmax backward, at seq 2048 / 8192 on DeepSeek-V2-Lite and gpt-oss-20b)
    pair_transient: float = 0.0
    # per pair, alive only while the mixer runs forward (or recomputes): DSA's index scores
    forward_pairs: SpecInt = _zero
    # per token, alive only while the mixer runs backward, beyond its saved set
    backward: SpecInt = _zero
    # per token, alive while the mixer's own backward runs, net of its saved set freed by then
    # (the MLP's is subtracted by the analytic): gemma4's fp32 q-norm backward
    late_backward: SpecInt = _zero
    no_grad: tuple[str, ...] = ()  # submodules run under torch.no_grad: adapters there keep nothing
    notes: str = ""
    fields: tuple[str, ...] = ()  # config fields the term reads (a spec without them: no term)
    absent: tuple[str, ...] = ()  # fields of a variant the term does not size
    sized: Callable[[ModelSpec], bool] | None = None  # a build the term sizes (inkling2_loop)

    def fits(self, spec: ModelSpec) -> bool:
        c = spec.hf_config
        return (
            all(c.get(f) is not None for f in self.fields)
            and not any(c.get(f) for f in self.absent)
            and (self.sized is None or self.sized(spec))
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
    pair_transient=2.0,
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
    fields=MAMBA2_FIELDS["granitemoehybrid"][:4],
)
MAMBA1 = MixerTerm(
    mamba1_scan,
    backward=mamba1_backward,
    notes=(
        "Mamba1 is sized as transformers' torch recurrent scan keeps it (a state per token and "
        "channel; no mamba-ssm): the CUDA kernel recomputes those and keeps far less"
    ),
    fields=MAMBA1_FIELDS,
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
_MOA = ("kv_channels", "intermediate_size")  # JetMoE's attention experts
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
    resident: SpecInt = _zero  # bytes per token alive for the whole step, outside the layers
    checkpointed: SpecInt = _zero  # … only with checkpointing (the embeddings require grad)
    gate_saved: int = 8  # × k·I: gate/up output + activation product (gated experts)
    glu_saved: int = 6  # × I: the same for dense and shared GLU MLPs
    shared_gate: bool = False  # qwen2_moe: sigmoid(shared_expert_gate) × shared output
    norms: int = 2  # RMSNorms per layer (input + post-attention)
    # hyper-connections (hy_v4, qwen4_exp, glm5_next): residual streams (a layer's input is
    # streams × hidden), what a layer's stream mixing keeps per token, and the streams'
    # collapse before the final norm
    streams: SpecInt = _one
    residual: SpecInt = _zero
    head: SpecInt = _zero
    mlp_residual: SpecInt = _zero  # the MLP side's share of `residual` (profiles/hybrid.py)
    # what the first layer does not keep when its input needs no gradient (LoRA without
    # checkpointing: the embeddings are frozen); left out (0) where that is one norm's input
    frozen_input: SpecInt = _zero
    # the routed experts' bytes per token (experts trained?) where the family's expert loop
    # keeps other than grouped_mm's (longcat_flash's identity experts); None: grouped_mm's
    routed: Callable[[ModelSpec, bool], int] | None = None
    # an eager expert loop's backward adds each slice's zero-filled full-size gradient to the
    # stack's running sum: that many gradients of the largest stack at once; 0: grouped_mm's
    # (the down stack's one)
    stack_grads: int = 0
    # intermediate size of a dense MLP that runs beside the routed experts (gemma4)
    mlp_beside_experts: SpecInt = _zero
    moe_layer_extra: SpecInt = _zero  # per token in MoE layers only (axk2's gated norm)
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
    pair_transient=2.0,
    notes="attention sinks need eager attention: probabilities are s² per head",
)
_SHARED_KV = ("num_kv_shared_layers",)  # layers reusing another's k/v: not sized
GEMMA4 = ActivationProfile(  # its layers by type: see plan.profiles.gemma4
    mixers={"attention": None},  # a layer type other than these two: not calibrated
    by_layer_type={  # sliding windows keep a bf16 mask per layer (2 B per pair)
        "sliding_attention": MixerTerm(g4.gemma4_sliding, pairs=lambda _: 2, absent=_SHARED_KV,
                                       late_backward=g4.q_norm_backward(full=False)),
        "full_attention": MixerTerm(g4.gemma4_full, absent=_SHARED_KV,
                                    late_backward=g4.q_norm_backward(full=True))},
    norms=8,  # 4 around the mixer and MLP, 3 on the dense / expert branches, the router's
    mlp_beside_experts=g4.gemma4_dense_mlp,
    resident=g4.per_layer_inputs,
    checkpointed=g4.per_layer_inputs_norm,
    notes="gemma4's layers are sized as SDPA runs them (k, v repeated where masked)",
)  # fmt: skip

AXK2 = ActivationProfile(  # DSA + an output gate; gated input norms (post-attention: MoE)
    kind="mla",
    mixers={"mla": dataclasses.replace(DSA, per_token=lambda s: mla_attention(s)
                                       + axk2.output_gate(s) + axk2.gated_norm(s))},
    moe_layer_extra=axk2.gated_norm,
)  # fmt: skip

LARA_MINI = ActivationProfile(  # Qwen3.5's gated DeltaNet between per-head qk-norm attention
    mixers={"attention": MixerTerm(sdpa_fused_qk_norm), "linear_attention": DELTA_NET},
    # its sliding-window layers pass SDPA a mask: k, v repeated to every head + the mask
    by_layer_type={
        "sliding_attention": dataclasses.replace(SLIDING, per_token=sdpa_masked_qk_norm)
    },
)
# eager MLA with sinks + a no-grad DSA indexer, hyper-connections (profiles/mla.py)
HY_V4 = ActivationProfile(
    mixers={
        "mla": MixerTerm(
            terms_mla.sink_mla_attention,
            pairs=terms_mla.sink_mla_pairs,
            pair_transient=1.6,
            forward_pairs=indexer_scores,
            no_grad=("indexer.",),
            notes="hy_v4's eager attention with sinks keeps fp32 probabilities: s² per head",
        )
    },
    gate_saved=12,  # gate and up clamped before the SwiGLU
    streams=hyper.hyper_streams,
    residual=terms_mla.hyper_layer,
    head=terms_mla.hyper_head,
    frozen_input=terms_mla.hyper_frozen_input,
)
# two MLA sublayers and two dense MLPs per layer; zero (identity) experts (profiles/mla.py)
LONGCAT_FLASH = ActivationProfile(
    mixers={
        "mla": dataclasses.replace(
            MLA, per_token=terms_mla.dual_mla, pairs=terms_mla.dual_mla_pairs, absent=()
        )
    },
    norms=4,
    frozen_input=terms_mla.first_norm,
    routed=terms_mla.zero_expert_routed,
    stack_grads=3,  # the running sum, one slice's full-size gradient, their sum
)

GATE_SAVED_RELU2 = 4  # × k·I: relu² experts (no gate): the up output and the down input
NEMOTRON_H = ActivationProfile(  # one norm per layer; each layer a single block
    mixers={
        "mamba": dataclasses.replace(MAMBA2, fields=MAMBA2_FIELDS["nemotron_h"][:4]),
        "mlp": MixerTerm(dense_mlp_layer, fields=("intermediate_size",)),
    },
    norms=1,
    gate_saved=GATE_SAVED_RELU2,
)


def _sconv_layers(terms: tuple[SpecInt, ...], note: str, sized: Any = None, **prof: Any) -> Any:
    """Inkling's layers, all of kind `conv`: (full, sliding, per pair) terms by layer type."""
    full, sliding = (MixerTerm(f, pairs=terms[2], notes=note, sized=sized) for f in terms[:2])
    return ActivationProfile({"conv": full}, by_layer_type={"hybrid_sliding": sliding}, **prof)


INKLING = _sconv_layers(  # relative-bias SDPA (math kernel) between short convolutions
    (conv.inkling_full, conv.inkling_sliding, conv.inkling_pairs),
    "inkling's attention is sized as the math SDPA kernel keeps it (fp32, s² per head)",
    masks=lambda spec: (layer_type_masks(spec) + 1) // 2,  # a bool mask per layer type
)
INKLING2_TERMS = (conv.inkling2_full, conv.inkling2_sliding, conv.inkling2_pairs)
INKLING2_NOTE = "inkling2's attention is sized as eager attention keeps it (s² per head)"
# eager sink attention, dynamic k/v convs, block residuals; its softcapped SwiGLU runs in
# fp32: gate, up, tanh and products (24·k·I) + the down input
INKLING2 = _sconv_layers(INKLING2_TERMS, INKLING2_NOTE, gate_saved=26)
INKLING2_LOOP = _sconv_layers(INKLING2_TERMS, INKLING2_NOTE, conv.no_loop_layers, gate_saved=26)

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
    "jamba": ActivationProfile(mixers={"mamba": MAMBA1}),
    "nemotron_h": NEMOTRON_H,
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
    "gemma4_text": GEMMA4,
    "axk2": AXK2,  # MLA + DSA, an output gate and low-rank gated norms (profiles/axk2.py)
    "hy_v4": HY_V4,
    "hy_v4_vl_text": HY_V4,
    "longcat_flash": LONGCAT_FLASH,
    # JetMoe's attention is itself a mixture of experts (routed q/o projections per token)
    "inkling_text": INKLING,
    "inkling2_text": INKLING2,
    "inkling2_loop_text": INKLING2_LOOP,
    "jetmoe": ActivationProfile(mixers={"attention": MixerTerm(conv.jetmoe_moa, fields=_MOA)}),
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
    return tuple(_layer_term(prof, k, t, spec) for k, t in zip(kinds, types, strict=False))


def _layer_term(prof: ActivationProfile, kind: str, typ: str, spec: ModelSpec) -> MixerTerm | None:
    """The layer type's own term where the profile has one (None where it does not fit `spec`:
    gemma4 with shared k/v), else the kind's."""
    typed = prof.by_layer_type.get(typ) if kind else None
    if typed is not None:
        return typed if typed.fits(spec) else None
    return _term(prof, kind, spec)


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
