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
  gradient (docs/knowledge.md §3); without checkpointing every layer keeps its copy.
  Split LoRA takes over the 3-D stacks only (they keep bf16 copies of their factors): a
  shared expert's or the dense MLP's weight targeted as a parameter still makes its W+ΔW,
- logits: moetune trains through TRL's fused LM head, which projects 4096 tokens ×
  32768 vocab entries at a time into one reused tile and accumulates the hidden-state
  gradient in fp32 (plus its cast back): tile + 6 B per token·hidden. With the model's
  own loss (`fused_head=False`) bf16 logits → fp32 → log-softmax, and at the loss
  backward fp32 logits, their log-softmax and its gradient are live: 12 B per token·vocab,
- optimizer transients: foreach AdamW's full-size temporary (fused AdamW has none).

The peak is the largest of three phases: the loss backward, each layer's backward, and
the optimizer step. Coefficients are calibrated against `trace_step` (see
benchmarks/planner_accuracy.py and benchmarks/results/trace-and-planner.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moetune.config import RunConfig
from moetune.model.spec import ModelSpec
from moetune.plan.layer_cost import LayerCost, is_attention, layer_cost, residual_width
from moetune.plan.layout import Adapter, AdapterLayout, adapter_layout
from moetune.plan.overhead import overhead_for
from moetune.plan.profiles.registry import NO_MIXER, layer_terms, profile_for
from moetune.plan.step import ADAPTER_BYTES, Optimizer, Step

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
LOGIT_BYTES = 12  # fp32 logits + log-softmax + its gradient at the loss backward
FUSED_TILE = (4096, 32768)  # TRL's fused LM head: tokens × vocab entries per tile
QUANT_BYTES = {"bnb-4bit": 4.127 / 8, "bnb-8bit": 1.0}  # NF4 + double-quant absmax; int8


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
        layer_cost(spec, step, _layer_adapters(layout, i), i, terms[i] or NO_MIXER, i in frozen)
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
    return {i for i in range(first + 1) if not is_attention(spec, i)}


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
    a published base kept as stored, what its format says; int8 + one fp32 scale per output
    row; NF4 nibbles + an fp32 absmax per 64 (double quant: an int8 absmax per 64 and an
    fp32 scale per 256 of those). A stored base's other quantised Linears are at
    `step.stored_linear_bytes` (frozen_bytes), everything else at the compute dtype."""
    if step.stored_bytes:
        return step.stored_bytes
    if step.experts_dtype == "int8":
        return 1 + 4 / spec.hidden_size
    if step.experts_dtype == "nf4":
        return 0.5 + (1 / 64 + 4 / (64 * 256) if step.experts_double_quant else 4 / 64)
    return step.weight_bytes


def frozen_bytes(spec: ModelSpec, step: Step) -> float:
    c = spec.components
    if step.quantization not in QUANT_BYTES:
        routed = c.routed_experts
        linears = step.stored_linear_params if step.stored_linear_bytes else 0  # plan/kept.py
        rest = (spec.total_params - routed - linears) * step.weight_bytes
        return (
            rest + routed * expert_bytes_per_param(spec, step) + linears * step.stored_linear_bytes
        )
    # bitsandbytes replaces nn.Linear only; prepare_model_for_kbit_training upcasts the
    # rest (fused experts, routers, embeddings, lm_head, norms) to fp32.
    linears = c.attention + c.dense_mlp + c.shared_experts
    return linears * QUANT_BYTES[step.quantization] + (spec.total_params - linears) * 4


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
    width = residual_width(spec, profile_for(spec.model_type))
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
