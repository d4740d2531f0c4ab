"""The instant estimate: peak live tensor bytes of one training step, by component.

The step is sized the way the trace (`plan.trace`) runs it and a real run behaves in the
steady state (step ≥ 2, Adam moments live through forward and backward):

- static: frozen weights (dtype bytes; QLoRA: 4-bit Linears, everything else upcast to
  fp32 by `prepare_model_for_kbit_training` – bitsandbytes leaves fused experts bf16,
  docs/knowledge.md §3), trainable weights (peft upcasts adapters to fp32: 4 B),
- optimizer state: two Adam moments (fp32 for adapters; param dtype for full),
- gradients: accumulating layer by layer during backward, all of them in the step,
- activations: what each decoder layer saves for backward, its token mixer's term picked
  by the layer's kind (`ModelSpec.mixers`: attention, mla, linear_attention …; see
  `plan.profiles`), all layers with gradient checkpointing off (none in a mixer without
  adapters before the first adapted layer: Mamba at layer 0); with it on, each layer's
  input plus one layer's recompute (a kind with no calibrated term adds nothing here, and
  `plan.fit` traces such a spec instead),
- expert weight copies: peft's ParamWrapper materialises `W + s·B@A` for every wrapped
  stack on each forward and keeps it for backward, and backward makes a full-size weight
  gradient (docs/knowledge.md §3); without checkpointing every layer keeps its copy,
- logits: moetune trains through TRL's fused LM head, which projects 4096 tokens ×
  32768 vocab entries at a time into one reused tile and accumulates the hidden-state
  gradient in fp32 (plus its cast back): tile + 6 B per token·hidden. With the model's
  own loss (`fused_head=False`) bf16 logits → fp32 → log-softmax, and at the loss
  backward fp32 logits, their log-softmax and its gradient are live: 12 B per token·vocab,
- optimizer transients: foreach AdamW's full-size temporary (fused AdamW has none).

The peak is the largest of three phases: the loss backward, each layer's backward, and
the optimizer step. Coefficients are calibrated against `trace_step` (see
benchmarks/planner_accuracy.py and RESULTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from moetune.config import RunConfig
from moetune.model.spec import ModelSpec
from moetune.plan.layout import Adapter, AdapterLayout, adapter_layout
from moetune.plan.overhead import overhead_for
from moetune.plan.profiles import NO_MIXER, ActivationProfile, MixerTerm, layer_terms, profile_for

Method = Literal["lora", "full", "qlora"]
Optimizer = Literal["fused", "foreach", "for-loop"]
COMPONENTS = (
    "frozen_weights",
    "trainable_weights",
    "gradients",
    "optimizer_state",
    "activations",
    "expert_weight_copies",
    "logits",
    "optimizer_transients",
)
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
ADAPTER_BYTES = 4  # peft autocast_adapter_dtype=True keeps LoRA weights in fp32
LOGIT_BYTES = 12  # fp32 logits + log-softmax + its gradient at the loss backward
FUSED_TILE = (4096, 32768)  # TRL's fused LM head: tokens × vocab entries per tile
QUANT_BYTES = {"bnb-4bit": 4.127 / 8, "bnb-8bit": 1.0}  # NF4 + double-quant absmax; int8


@dataclass(frozen=True)
class Step:
    """The training step being sized."""

    seq_len: int
    batch_size: int = 1
    gradient_checkpointing: bool = True
    method: Method = "lora"
    optimizer: Optimizer = "fused"
    quantization: str = "none"
    weight_bytes: int = 2
    split_lora: bool = False  # lora.engine moetune: expert LoRA on routed tokens, no W+ΔW
    experts_dtype: str = "bf16"  # moetune's frozen expert storage: bf16 | int8 | nf4
    experts_double_quant: bool = False
    fused_head: bool = True  # TRL SFTTrainer's tiled LM head (moetune's trainer) vs full logits

    @property
    def tokens(self) -> int:
        return self.seq_len * self.batch_size

    @property
    def pairs(self) -> int:
        """Query·key pairs per head over the batch (sequences attend within themselves)."""
        return self.batch_size * self.seq_len * self.seq_len

    @property
    def act_bytes(self) -> int:
        """QLoRA's upcast norms and embeddings carry fp32 hidden states."""
        return 4 if self.method == "qlora" else self.weight_bytes

    @classmethod
    def from_config(cls, cfg: RunConfig, spec: ModelSpec, optimizer: Optimizer = "fused") -> Step:
        quant = cfg.train.quantization
        if cfg.train.tuning == "qlora" and quant == "none":
            quant = "bnb-4bit"
        return cls(
            seq_len=cfg.train.seq_len,
            batch_size=cfg.train.batch_size,
            gradient_checkpointing=cfg.train.gradient_checkpointing,
            method=cfg.train.tuning,
            optimizer=optimizer,
            quantization=quant,
            weight_bytes=DTYPE_BYTES[cfg.model.dtype],
            split_lora=split_lora(spec, cfg),
            experts_dtype=cfg.model.experts_dtype,
            experts_double_quant=cfg.model.experts_double_quant,
        )


def split_lora(spec: ModelSpec, cfg: RunConfig) -> bool:
    """Whether the step runs moetune's split-LoRA experts (`lora.engine` resolved on `spec`)."""
    # lazy: heavy to import (torch, peft via moetune.engine)
    from moetune.engine.resolve import resolve_engine

    return cfg.train.tuning != "full" and resolve_engine(spec, cfg.lora) == "moetune"


@dataclass(frozen=True)
class AnalyticEstimate:
    """Bytes live at the peak by component (they sum to `peak_bytes`); no overhead."""

    components: dict[str, int]
    peak_bytes: int
    peak_phase: str  # "loss", "backward" (layer N) or "optimizer"
    trainable_params: int
    total_params: int
    phases: dict[str, int] = field(default_factory=dict)  # peak of each phase

    @property
    def overhead_bytes(self) -> int:
        """A CUDA card's overhead on top of the peak (plan.overhead; per card in the plan)."""
        return overhead_for("cuda", self.peak_bytes).total

    def to_json(self) -> dict[str, Any]:
        return {
            "components": dict(self.components),
            "peak_bytes": self.peak_bytes,
            "overhead_bytes": self.overhead_bytes,
            "peak_phase": self.peak_phase,
            "trainable_params": self.trainable_params,
            "total_params": self.total_params,
            "phases": dict(self.phases),
        }


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer's bytes in the step (see the module docstring)."""

    saved: int  # activations kept for backward (gradient checkpointing off)
    copies: int  # ParamWrapper W+ΔW copies kept for backward
    checkpoint: int  # the layer input kept with gradient checkpointing on
    backward_act: int  # activation gradients made in this layer's backward
    backward_copy: int  # full-size weight gradient of the first wrapped stack in backward
    grads: int  # this layer's trainable gradients


def estimate(
    spec: ModelSpec,
    cfg: RunConfig,
    *,
    optimizer: Optimizer = "fused",
    layout: AdapterLayout | None = None,
) -> AnalyticEstimate:
    """The analytic peak for `cfg` on `spec`; `layout` defaults to the recipe's (cached)."""
    step = Step.from_config(cfg, spec, optimizer)
    if step.method != "full" and layout is None:
        layout = adapter_layout(spec, cfg.lora)
    return estimate_step(spec, step, layout)


def estimate_step(spec: ModelSpec, step: Step, layout: AdapterLayout | None) -> AnalyticEstimate:
    """The analytic peak of `step` on `spec` with LoRA `layout` (None: full fine-tuning)."""
    full = step.method == "full" or layout is None
    trainable = spec.total_params if full else layout.trainable_params  # type: ignore[union-attr]
    terms, frozen = layer_terms(spec), _grad_free(spec, step, layout)
    layers = [
        _layer_cost(spec, step, _layer_adapters(layout, i), i, terms[i] or NO_MIXER, i in frozen)
        for i in range(spec.num_layers)
    ]
    base = _static(spec, step, trainable)
    phases = {"loss": _loss_phase(spec, step, layers, base)}
    phases.update(_backward_phases(spec, step, layers, base))
    phases["optimizer"] = _optimizer_phase(step, base, trainable)
    name = max(phases, key=lambda p: sum(phases[p].values()))
    components = {c: int(phases[name].get(c, 0)) for c in COMPONENTS}
    return AnalyticEstimate(
        components=components,
        peak_bytes=sum(components.values()),
        peak_phase=name,
        trainable_params=trainable,
        total_params=spec.total_params,
        phases={p: int(sum(v.values())) for p, v in phases.items()},
    )


def _layer_adapters(layout: AdapterLayout | None, i: int) -> tuple[Adapter, ...] | None:
    return None if layout is None else layout.layers[i]


def _grad_free(spec: ModelSpec, step: Step, layout: AdapterLayout | None) -> set[int]:
    """Layers whose mixer keeps nothing: without checkpointing (which makes the embeddings
    need a gradient) the stream needs none until the first adapted layer, so a mixer with
    no adapters up to there (Mamba at layer 0: jamba, nemotron_h) saves nothing, nor its norms."""
    if step.gradient_checkpointing or layout is None:
        return set()
    first = next((i for i, a in enumerate(layout.layers) if a), spec.num_layers - 1)
    return {i for i in range(first + 1) if not _is_attention(spec, i)}


# ---------------------------------------------------------------- static parts


def _static(spec: ModelSpec, step: Step, trainable: int) -> dict[str, float]:
    """Weights and the (steady-state) Adam moments: live in every phase."""
    if step.method == "full":
        weights = spec.total_params * step.weight_bytes
        return {"trainable_weights": weights, "optimizer_state": 2 * weights}
    return {
        "frozen_weights": frozen_bytes(spec, step),
        "trainable_weights": trainable * ADAPTER_BYTES,
        "optimizer_state": trainable * 2 * ADAPTER_BYTES,
    }


def expert_bytes_per_param(spec: ModelSpec, step: Step) -> float:
    """Bytes per routed-expert parameter as moetune stores the frozen stacks (engine/quant):
    int8 + one fp32 scale per output row; NF4 nibbles + an fp32 absmax per 64 (double
    quant: an int8 absmax per 64 and an fp32 scale per 256 of those)."""
    if step.experts_dtype == "int8":
        return 1 + 4 / spec.hidden_size
    if step.experts_dtype == "nf4":
        return 0.5 + (1 / 64 + 4 / (64 * 256) if step.experts_double_quant else 4 / 64)
    return step.weight_bytes


def frozen_bytes(spec: ModelSpec, step: Step) -> float:
    if step.quantization not in QUANT_BYTES:
        routed = spec.components.routed_experts
        rest = (spec.total_params - routed) * step.weight_bytes
        return rest + routed * expert_bytes_per_param(spec, step)
    c = spec.components
    # bitsandbytes replaces nn.Linear only; prepare_model_for_kbit_training upcasts the
    # rest (fused experts, routers, embeddings, lm_head, norms) to fp32.
    linears = c.attention + c.dense_mlp + c.shared_experts
    return linears * QUANT_BYTES[step.quantization] + (spec.total_params - linears) * 4


# ---------------------------------------------------------------- one layer


def _layer_cost(
    spec: ModelSpec,
    step: Step,
    adapters: tuple[Adapter, ...] | None,
    i: int,
    mixer: MixerTerm,
    grad_free: bool = False,
) -> LayerCost:
    """Layer `i`'s bytes with its token mixer's term (an uncalibrated kind: none); a
    `grad_free` mixer (`_grad_free`) keeps nothing."""
    prof = profile_for(spec.model_type)
    full = adapters is None
    wrapped = () if full else tuple(a for a in adapters if a.via == "param")  # type: ignore[union-attr]
    experts_trained = full or any(a.kind == "experts" for a in wrapped)
    mixing = 0 if grad_free else _mixer_bytes(spec, prof, mixer, adapters, i)
    mlp = _mlp_bytes(spec, prof, adapters, i, experts_trained)
    per_token = mixing + mlp
    if i == 0 and not (full or step.gradient_checkpointing):
        per_token -= prof.frozen_input(spec)
    saved = per_token * step.tokens + mixer.pairs(spec) * step.pairs
    saved = saved * step.act_bytes // 2
    copies = sum(a.base_numel + _factor_cast(a) for a in wrapped) * _copy_bytes(step)
    act_grad, copy_grad = _backward_extra(spec, step, wrapped, (i, mixer, mlp), experts_trained)
    if step.split_lora:  # split LoRA never forms W+ΔW nor a full-size weight gradient;
        # its grouped matmuls keep activation-dtype copies of the factors for backward
        copies = sum(_factor_cast(a) for a in wrapped) * _copy_bytes(step)
        copy_grad = 0
    return LayerCost(
        saved=saved,
        copies=copies,
        checkpoint=2 * _width(spec, prof) * step.tokens * step.act_bytes // 2,
        backward_act=act_grad,
        backward_copy=copy_grad,
        grads=_layer_grads(spec, step, adapters, i),
    )


def _width(spec: ModelSpec, prof: ActivationProfile) -> int:
    """The residual's width: hidden, times the streams of hyper-connections."""
    return prof.streams(spec) * spec.hidden_size


def _is_attention(spec: ModelSpec, i: int) -> int:
    return int(i in spec.attention_layers)


def _copy_bytes(step: Step) -> int:
    """W+ΔW is made in the stack's dtype: bf16, or fp32 after QLoRA's upcast."""
    return 4 if step.method == "qlora" else step.weight_bytes


def _factor_cast(a: Adapter) -> int:
    """3-D stacks fold B@A in with one baddbmm on bf16 copies of the factors (kept)."""
    return a.lora_numel if a.base_numel > a.in_features * a.out_features else 0


def _mixer_bytes(
    spec: ModelSpec,
    prof: ActivationProfile,
    mixer: MixerTerm,
    adapters: tuple[Adapter, ...] | None,
    i: int,
) -> int:
    """Norms, the token mixer's core, and every lora.Linear's kept inputs, per token."""
    h = spec.hidden_size
    total = prof.norms * 4 * h + prof.residual(spec) + mixer.per_token(spec)
    if adapters is None:  # full: every weight needs its input and each norm its output
        if not _is_attention(spec, i):
            return total
        q = spec.num_attention_heads * spec.head_dim
        return total + 2 * h + 2 * q + prof.norms * 2 * h
    # lora.Linear casts its input to fp32 for lora_A and keeps lora_A's output
    kept = [a for a in adapters if a.via == "linear" and not a.name.startswith(mixer.no_grad)]
    return total + sum(4 * a.in_features + 4 * a.rank for a in kept)


def _mlp_bytes(
    spec: ModelSpec,
    prof: ActivationProfile,
    adapters: tuple[Adapter, ...] | None,
    i: int,
    experts_trained: bool,
) -> int:
    """Routed experts + router, shared experts, or the dense MLP, per token."""
    h = spec.hidden_size
    if i not in spec.moe_layers:
        dense = _weights_trained(adapters, "dense")
        return _glu_bytes(h, spec.dense_intermediate_size, dense, prof.glu_saved)
    k, inter = spec.top_k, spec.expert_intermediate_size
    routed = (
        (4 * k * h + prof.gate_saved * k * inter)
        if experts_trained
        else (2 * k * h + (prof.gate_saved - 2) * k * inter)
    )
    if prof.routed is not None:  # a family's own expert loop (longcat's identity experts)
        routed = prof.routed(spec, experts_trained)
    router = 4 * spec.num_experts + 16 * k
    trained = _weights_trained(adapters, "shared")
    shared = _glu_bytes(h, spec.shared_intermediate_size, trained, prof.glu_saved)
    if prof.shared_gate and spec.shared_intermediate_size:
        shared += 2 * h
    beside = _glu_bytes(h, prof.mlp_beside_experts(spec), _weights_trained(adapters, "dense"))
    return routed + router + shared + beside + prof.moe_layer_extra(spec)


def _weights_trained(adapters: tuple[Adapter, ...] | None, kind: str) -> bool:
    """Full training, or a ParamWrapper on this kind's Linear weights (their input is kept)."""
    return adapters is None or any(a.kind == kind and a.via == "param" for a in adapters)


def _glu_bytes(hidden: int, inter: int, weights_trained: bool, saved: int = 6) -> int:
    """Gated MLP: gate out, activation, up out (`saved`·I: more where it clamps); + inputs
    when the weights need gradients."""
    if not inter:
        return 0
    return saved * inter + (2 * hidden + 2 * inter if weights_trained else 0)


def _backward_extra(
    spec: ModelSpec,
    step: Step,
    wrapped: tuple[Adapter, ...],
    layer: tuple[int, MixerTerm, int],
    experts_trained: bool,
) -> tuple[int, int]:
    """(activation-gradient bytes, weight-gradient bytes) on top of the layer's saved set.

    The largest of: a late mixer backward's transients (net of the MLP's freed saved set);
    the routed tokens' gradients (4·k·H + 4·k·I per token); with LoRA on
    the stacks, the down stack's full-size weight gradient next to its input gradient
    (2·k·I per token); for T² attention kernels, the extra probability-sized tensors.
    """
    (i, mixer, mlp), t, act = layer, step.tokens, step.act_bytes // 2
    attention = mixer.pair_transient * mixer.pairs(spec) * step.pairs
    candidates = [(int(attention), 0), (mixer.forward_pairs(spec) * step.pairs, 0)]
    freed = profile_for(spec.model_type).mlp_residual(spec)  # the MLP side's stream mixing
    candidates.append(((mixer.backward(spec) - freed) * t * act, 0))
    # the mixer's own backward runs after the MLP's: the MLP's saved set is freed by then
    candidates.append(((mixer.late_backward(spec) - mlp) * t * act, 0))
    if i not in spec.moe_layers:
        inter = spec.dense_intermediate_size
        candidates.append((4 * inter * t * act, _largest(wrapped) * _copy_bytes(step)))
    else:
        k, h, inter = spec.top_k, spec.hidden_size, spec.expert_intermediate_size
        candidates.append(((4 * k * h + 4 * k * inter) * t * act, 0))
        if wrapped and experts_trained:
            down = _down_stack(wrapped, spec) * _copy_bytes(step)
            candidates.append((2 * k * inter * t * act, down))
    return max(candidates, key=sum)


def _down_stack(wrapped: tuple[Adapter, ...], spec: ModelSpec) -> int:
    loop = profile_for(spec.model_type).stack_grads  # an eager loop's full-size gradients
    if loop:
        return loop * _largest(wrapped)
    downs = [a.base_numel for a in wrapped if a.kind == "experts" and "down" in a.name]
    return max(downs) if downs else _largest(wrapped)


def _largest(wrapped: tuple[Adapter, ...]) -> int:
    return max((a.base_numel for a in wrapped), default=0)


def _layer_grads(spec: ModelSpec, step: Step, adapters: tuple[Adapter, ...] | None, i: int) -> int:
    if adapters is not None:
        return sum(a.lora_numel for a in adapters) * ADAPTER_BYTES
    return _layer_params(spec, i) * step.weight_bytes


def _layer_params(spec: ModelSpec, i: int) -> int:
    """Parameters of decoder layer `i` (for full fine-tuning), from the component counts."""
    c = spec.components
    attention = (c.attention + c.norms) // max(1, len(spec.attention_layers))
    n_moe, n_dense = len(spec.moe_layers), len(spec.dense_layers)
    if i in spec.moe_layers:
        return attention + (c.routed_experts + c.shared_experts + c.routers) // max(1, n_moe)
    return attention + c.dense_mlp // max(1, n_dense)


# ---------------------------------------------------------------- phases


def _with(base: dict[str, float], **parts: float) -> dict[str, float]:
    out = dict(base)
    for name, value in parts.items():
        out[name] = out.get(name, 0) + value
    return out


def _masks(spec: ModelSpec, step: Step) -> int:
    """s×s masks and per-token tensors alive for the whole step (gemma4's per-layer inputs)."""
    prof = profile_for(spec.model_type)
    resident = prof.resident(spec) + (prof.checkpointed(spec) if step.gradient_checkpointing else 0)
    return prof.masks(spec) * 2 * step.pairs + resident * step.tokens


def _loss_phase(
    spec: ModelSpec, step: Step, layers: list[LayerCost], base: dict[str, float]
) -> dict[str, float]:
    """The loss backward: every layer's keep-set, the logits, the final norm's fp32 input."""
    t, h, prof = step.tokens, spec.hidden_size, profile_for(spec.model_type)
    if step.gradient_checkpointing:
        kept, copies = sum(c.checkpoint for c in layers), 0
    else:
        kept, copies = sum(c.saved for c in layers), sum(c.copies for c in layers)
    return _with(
        base,
        activations=kept + (4 * h + prof.head(spec)) * t + _masks(spec, step),
        expert_weight_copies=copies,
        logits=logit_bytes(spec, step),
    )


def logit_bytes(spec: ModelSpec, step: Step) -> int:
    """The loss's bytes at its backward: TRL's fused tile or the full logits."""
    t = step.tokens
    if not step.fused_head:
        return LOGIT_BYTES * t * spec.vocab_size
    rows = min(t - step.batch_size, FUSED_TILE[0])  # labels shift by one per sequence
    tile = rows * FUSED_TILE[1] * step.act_bytes
    grad_weight = 6 * spec.vocab_size * spec.hidden_size if step.method == "full" else 0
    return tile + 6 * spec.hidden_size * t + grad_weight


def _head_grads(spec: ModelSpec, step: Step) -> int:
    """Full fine-tuning: the lm_head gradient arrives right after the logits."""
    return spec.components.lm_head * step.weight_bytes if step.method == "full" else 0


def _backward_phases(
    spec: ModelSpec, step: Step, layers: list[LayerCost], base: dict[str, float]
) -> dict[str, dict[str, float]]:
    """Each layer's backward, last layer first; only the largest is returned.

    While layer j runs backward, layers below it still hold their keep-set (saved
    activations and copies, or just checkpoints) and layers above it hold gradients.
    """
    gc = step.gradient_checkpointing
    kept = [c.checkpoint if gc else c.saved for c in layers]
    copies = [0 if gc else c.copies for c in layers]
    grads = [c.grads for c in layers]
    # the gradient between layers and the recomputed input (the residual's width), the final
    # norm and the streams' collapse, masks
    width = _width(spec, profile_for(spec.model_type))
    fixed = (6 if gc else 2) * width * step.tokens * step.act_bytes // 2
    fixed += _masks(spec, step) + profile_for(spec.model_type).head(spec) * step.tokens
    phases = {}
    for j, c in enumerate(layers):
        phases[f"backward (layer {j})"] = _with(
            base,
            activations=sum(kept[: j + 1]) + (c.saved if gc else 0) + c.backward_act + fixed,
            expert_weight_copies=sum(copies[: j + 1]) + (c.copies if gc else 0) + c.backward_copy,
            # full fine-tuning: this layer's weight gradients land while it runs backward
            gradients=_head_grads(spec, step) + sum(grads[j + 1 :]) + _own_grads(step, c),
        )
    name = max(phases, key=lambda n: sum(phases[n].values()))
    return {name: phases[name]}


def _own_grads(step: Step, c: LayerCost) -> int:
    return c.grads if step.method == "full" else 0


def _optimizer_phase(step: Step, base: dict[str, float], trainable: int) -> dict[str, float]:
    """AdamW: every gradient, the moments, and foreach's full-size temporary."""
    grad_bytes = step.weight_bytes if step.method == "full" else ADAPTER_BYTES
    transient = trainable * grad_bytes if step.optimizer == "foreach" else 0
    return _with(base, gradients=trainable * grad_bytes, optimizer_transients=transient)
