"""Routing diagnostics: how evenly each MoE layer spreads its tokens over the experts.

`RoutingRecorder` hooks the router modules (the family's `paths.router`) and counts, per
MoE layer, the experts each real token is sent to – the top-k indices the router returns
(or the top-k of its logits where it returns none). Padding tokens are left out (the
attention mask), and so are the router calls that gradient checkpointing re-runs in the
backward pass: only calls inside the model's own forward count.

`LayerLoad` turns the counts into the numbers that show collapse (docs/knowledge.md §10):

- load fraction per expert: its share of all top-k assignments (they sum to 1);
- normalised load entropy H/ln E: 1 for an even spread, 0 when one expert takes everything;
- max/min load fraction and dead experts (no tokens at all);
- top-1 share: the fraction of tokens whose first choice is the busiest expert. A layer
  *collapses* when one expert is the first choice of more than half of the tokens
  (`COLLAPSE_SHARE`). The first choice is used because with top-k >= 2 no expert can hold
  more than 1/k of the assignments, so "> 50 % of the load" could never fire there.

Many bases already route unevenly before any training (the quickstart's base sends 53 % of
layer 2's first choices to one expert), so a collapse only counts against the fine-tune
when it is worse than the base's own: `base_routing` measures the base on training rows
before the first step, and a layer *drifted* when it is collapsed and its top-1 share
exceeds the base's by more than `DRIFT_MARGIN` plus twice the record's sampling error.

`RoutingCallback` records every `train.routing_every` optimizer steps into routing.jsonl
and warns once per drifted layer; `drift_line` says in one line what drifted and where the
base was already concentrated; `summarize` condenses the records for the run summary.
Under `accelerate launch` each process counts its own tokens; the main process writes its
share.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from moetune.model.families.registry import get_family
from moetune.model.layers import decoder_layers
from moetune.train.routing.modes import measuring
from moetune.train.routing.rows import BASE_ROWS, batches, sampled

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from moetune.model.spec import ModelSpec

COLLAPSE_SHARE = 0.5  # one expert the first choice of more than this share of tokens
DRIFT_MARGIN = 0.10  # top-1 share above the base's by more than this (+ sampling error)


@dataclass(frozen=True)
class LayerLoad:
    """Expert load of one MoE layer over the tokens of one recording."""

    layer: int
    counts: tuple[int, ...]  # top-k assignments per expert
    top1: tuple[int, ...]  # tokens whose first choice is each expert

    @property
    def tokens(self) -> int:
        return sum(self.top1)

    @property
    def fractions(self) -> tuple[float, ...]:
        total = sum(self.counts)
        return tuple(c / total if total else 0.0 for c in self.counts)

    @property
    def entropy(self) -> float:
        """H/ln E of the load fractions: 1 even, 0 all on one expert."""
        if len(self.counts) < 2 or not sum(self.counts):
            return 0.0
        h = -sum(p * math.log(p) for p in self.fractions if p > 0)
        return h / math.log(len(self.counts))

    @property
    def dead(self) -> tuple[int, ...]:
        return tuple(e for e, c in enumerate(self.counts) if c == 0)

    @property
    def top1_share(self) -> float:
        return max(self.top1) / self.tokens if self.tokens else 0.0

    @property
    def busiest(self) -> int:
        return max(range(len(self.top1)), key=self.top1.__getitem__)

    @property
    def collapsed(self) -> bool:
        return self.top1_share > COLLAPSE_SHARE

    def to_json(self) -> dict[str, Any]:
        return {
            "layer": self.layer,
            "tokens": self.tokens,
            "tokens_per_expert": list(self.counts),
            "entropy": round(self.entropy, 6),
            "max_fraction": round(max(self.fractions), 6),
            "min_fraction": round(min(self.fractions), 6),
            "dead_experts": list(self.dead),
            "top1_share": round(self.top1_share, 6),
            "collapsed": self.collapsed,
        }


def layer_load(layer: int, indices: torch.Tensor, num_experts: int) -> LayerLoad:
    """The load of one layer from its routing decisions `indices` [tokens, top_k]."""
    flat = indices.reshape(-1, indices.shape[-1]).long()
    counts = torch.bincount(flat.reshape(-1), minlength=num_experts)
    top1 = torch.bincount(flat[:, 0], minlength=num_experts)
    return LayerLoad(layer, tuple(counts.tolist()), tuple(top1.tolist()))


def routed_experts(output: Any, num_experts: int, top_k: int) -> torch.Tensor | None:
    """The [tokens, top_k] expert indices in a router's output, or None when unreadable.

    Routers return (logits, weights, indices) in transformers 5; the integer tensor is the
    routing decision. A router that returns only logits is read as their top-k.
    """
    parts = output if isinstance(output, tuple | list) else (output,)
    tensors = [t for t in parts if isinstance(t, torch.Tensor)]
    for t in tensors:
        if not t.is_floating_point() and t.dim() >= 2:
            return t.reshape(-1, t.shape[-1])
    for t in tensors:
        if t.is_floating_point() and t.shape[-1] == num_experts:
            return t.reshape(-1, num_experts).topk(top_k, dim=-1).indices
    return None


def routed_weights(output: Any, indices: torch.Tensor) -> torch.Tensor | None:
    """The routing weight of each of `indices` [tokens, top_k] in a router's output.

    transformers 5 routers return (logits, weights, indices): the last float tensor shaped
    like the indices (softmax/sigmoid top-k, normalised or scaled as the family does). A
    router that returns only logits is read as their softmax at the chosen experts; None
    when there are no scores at all.
    """
    parts = output if isinstance(output, tuple | list) else (output,)
    floats = [t for t in parts if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        return None
    shaped = [t for t in floats[1:] if t.numel() == indices.numel()]  # floats[0]: the logits
    if shaped:
        return shaped[-1].reshape(indices.shape)
    logits = floats[0].reshape(indices.shape[0], -1)
    return logits.float().softmax(dim=-1).gather(1, indices.long())


def router_modules(model: nn.Module, spec: ModelSpec) -> dict[int, nn.Module]:
    """MoE layer -> its router module (the outermost, peft wrapper included)."""
    family = get_family(spec.model_type)
    layers = decoder_layers(model, spec, family)
    found: dict[int, nn.Module] = {}
    for i in spec.moe_layers:
        for path in family.paths_of(spec).router:
            try:
                found[i] = layers[i].get_submodule(path)
                break
            except AttributeError:
                continue
    return found


def effective_weight(module: nn.Module) -> torch.Tensor:
    """A router's weight as the forward uses it: base weight plus active LoRA deltas."""
    # lazy: heavy to import (peft)
    from peft.tuners.tuners_utils import BaseTunerLayer

    def is_wrapper(obj: Any) -> bool:  # a function, so mypy keeps `layer` as Any
        return isinstance(obj, BaseTunerLayer)

    layer: Any = module  # peft wrappers and router classes are typed loosely
    deltas: list[torch.Tensor] = []
    while is_wrapper(layer):
        if getattr(layer, "parameter_name", "weight") == "weight":
            active = [a for a in layer.active_adapters if a in layer.lora_A]
            deltas += [layer.get_delta_weight(a) for a in active]
        layer = layer.base_layer
    weight: torch.Tensor = layer.weight.detach().float()
    for delta in deltas:
        weight = weight + delta.detach().float()
    return weight


def router_weights(model: nn.Module, spec: ModelSpec) -> dict[int, torch.Tensor]:
    """MoE layer -> a CPU fp32 copy of its router's effective weight."""
    routers = router_modules(model, spec)
    with torch.no_grad(), gathered([p for m in routers.values() for p in m.parameters()]):
        return {
            layer: whole(effective_weight(module)).cpu().clone()
            for layer, module in routers.items()
        }


def gathered(params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[Any]:
    """DeepSpeed ZeRO-3 parameters whole for reading (GatheredParameters, a collective: every
    rank enters it); anything else as it is."""
    if not any(hasattr(p, "ds_id") for p in params):
        return contextlib.nullcontext()
    # lazy: heavy to import (deepspeed)
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of an FSDP2 shard (a DTensor; a collective: every rank calls it)."""
    # lazy: heavy to import (torch)
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _digest(weights: dict[int, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for layer in sorted(weights):
        h.update(weights[layer].contiguous().numpy().tobytes())
    return h.hexdigest()


def compare_router(
    before: dict[int, torch.Tensor], after: dict[int, torch.Tensor], trainable: bool
) -> dict[str, Any]:
    """Did training change the router's effective weights? Bit-exact, per MoE layer."""
    changed = [layer for layer in before if not torch.equal(before[layer], after[layer])]
    drift = max(((after[k] - before[k]).abs().max().item() for k in before), default=0.0)
    return {
        "trainable": trainable,
        "changed": bool(changed),
        "changed_layers": changed,
        "max_abs_change": drift,
        "sha256_before": _digest(before),
        "sha256_after": _digest(after),
    }


def hook_routing(
    model: nn.Module,
    spec: ModelSpec,
    begin: Callable[..., None],
    end: Callable[..., None],
    router_hook: Callable[[int], Callable[[nn.Module, Any, Any], None]],
) -> list[RemovableHandle]:
    """Hooks around each forward of the (peft-wrapped) model's base – `begin` sees its
    kwargs – and `router_hook(layer)` on every MoE layer's router; the handles."""
    get_base = getattr(model, "get_base_model", None)
    base: nn.Module = get_base() if callable(get_base) else model
    handles = [
        base.register_forward_pre_hook(begin, with_kwargs=True),
        base.register_forward_hook(end),
    ]
    for layer, router in router_modules(model, spec).items():
        handles.append(router.register_forward_hook(router_hook(layer)))
    return handles


class RoutingRecorder:
    """Counts routed tokens per MoE layer while started; hooks stay until `remove()`.
    With `weights`, each decision's routing weight is kept as well (see `routed`)."""

    def __init__(self, model: nn.Module, spec: ModelSpec, weights: bool = False) -> None:
        self.num_experts, self.top_k = spec.num_experts, spec.top_k
        self.active = False
        self.weights = weights
        self._in_forward = False
        self._mask: torch.Tensor | None = None
        self._seen: dict[int, list[torch.Tensor]] = {}
        self._weights: dict[int, list[torch.Tensor]] = {}
        self._handles = hook_routing(model, spec, self._begin, self._end, self._hook)

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._in_forward = True
        mask = kwargs.get("attention_mask")
        self._mask = mask.reshape(-1).bool() if isinstance(mask, torch.Tensor) else None

    def _end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._in_forward = False

    def _hook(self, layer: int) -> Callable[[nn.Module, Any, Any], None]:
        def record(module: nn.Module, args: Any, output: Any) -> None:
            if self.active and self._in_forward:  # not gradient checkpointing's recompute
                self.record(layer, output)

        return record

    def record(self, layer: int, output: Any) -> None:
        """Keep the decisions in one router call's `output`, padding tokens left out.

        Without autograd: a router that returns only scores is read through its top-k, and
        a top-k of a grad-requiring tensor saves its indices – in a checkpointed layer the
        forward then saves one tensor more than the recompute (which records nothing), and
        backward fails with a CheckpointError (llama4's router).
        """
        with torch.no_grad():
            indices = routed_experts(output, self.num_experts, self.top_k)
            if indices is None:
                return
            weights = routed_weights(output, indices) if self.weights else None
            mask = self._mask
            if mask is not None and mask.numel() == indices.shape[0]:
                indices = indices[mask.to(indices.device)]
                weights = None if weights is None else weights[mask.to(weights.device)]
        self._seen.setdefault(layer, []).append(indices.cpu())
        if weights is not None:
            self._weights.setdefault(layer, []).append(weights.float().cpu())

    def start(self) -> None:
        self._seen, self._weights, self.active = {}, {}, True

    def routed(self) -> dict[int, tuple[torch.Tensor, torch.Tensor | None]]:
        """Per layer, every decision since `start()`: indices [tokens, top_k] and their
        weights (None unless recording weights); stops recording."""
        self.active = False
        return {
            layer: (
                torch.cat(parts),
                torch.cat(self._weights[layer]) if layer in self._weights else None,
            )
            for layer, parts in sorted(self._seen.items())
        }

    def stop(self) -> list[LayerLoad]:
        """The loads recorded since `start()`, per layer, and stop recording."""
        self.active = False
        return [
            layer_load(layer, torch.cat(parts), self.num_experts)
            for layer, parts in sorted(self._seen.items())
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def base_routing(
    recorder: RoutingRecorder, model: nn.Module, inputs: Iterable[dict[str, Any]]
) -> dict[int, LayerLoad]:
    """MoE layer -> the routing of `model` over `inputs` (no grad, eval mode but for the
    quantised kernels, each module's mode back after: `measuring`). Called before the first
    step, when every LoRA B is still zero: the model routes as the base does."""
    recorder.start()
    try:
        with measuring(model):
            for batch in inputs:
                model(**batch)
    finally:
        loads = recorder.stop()
    return {load.layer: load for load in loads}


def drifted(load: LayerLoad, base: LayerLoad | None) -> bool:
    """Collapsed, and – where the base was measured – worse than the base by the margin."""
    if not load.collapsed:
        return False
    if base is None or not base.tokens or not load.tokens:
        return True
    p = base.top1_share
    noise = 2 * math.sqrt(p * (1 - p) / load.tokens)  # a record is a sample of tokens too
    return load.top1_share - p > DRIFT_MARGIN + noise


def collapse_warning(step: int, load: LayerLoad, base: LayerLoad | None = None) -> str:
    versus = f", base {base.top1_share:.0%}" if base is not None and base.tokens else ""
    return (
        f"routing collapse at step {step}: layer {load.layer} sends "
        f"{load.top1_share:.0%} of tokens to expert {load.busiest} first{versus} "
        f"(load entropy {load.entropy:.2f})"
    )


def drift_line(base: dict[int, LayerLoad], drifted_layers: Sequence[int], layers: int) -> str:
    """One line for the end of a run: layers that drifted, and where the base already
    concentrated (top-1 share over COLLAPSE_SHARE before any training)."""
    rule = f"collapsed and > {DRIFT_MARGIN:.0%} above the base's top-1 share"
    line = f"routing: {len(drifted_layers)} of {layers} layers drifted from the base ({rule})"
    if drifted_layers:
        line += f": layers {', '.join(map(str, drifted_layers))}"
    already = [b for _, b in sorted(base.items()) if b.collapsed]
    if already:
        where = ", ".join(f"{b.layer} ({b.top1_share:.0%} to expert {b.busiest})" for b in already)
        line += f"; base already concentrated in layer{'s' if len(already) > 1 else ''} {where}"
    return line


class RoutingCallback(TrainerCallback):
    """Records the routing every `every` optimizer steps; `write(row)` stores a record and
    `warn(message)` reports a layer drifting from `base` (collapsed beyond the base's own
    routing), once per layer, as it happens (all of them also in `.warnings`). Layers
    without a base measurement warn on plain collapse, once."""

    def __init__(
        self,
        recorder: RoutingRecorder,
        every: int,
        write: Callable[[dict[str, Any]], None],
        warn: Callable[[str], None] = lambda message: None,
        base: dict[int, LayerLoad] | None = None,
    ) -> None:
        self.recorder, self.every, self.write, self.warn = recorder, every, write, warn
        self.base: dict[int, LayerLoad] = base or {}
        self.warnings: list[str] = []
        self.drifted: list[int] = []  # layers warned about, in the order they drifted
        self.layers: set[int] = set()  # layers recorded

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.every and (state.global_step + 1) % self.every == 0:
            self.recorder.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.recorder.active:
            return
        loads = self.recorder.stop()
        if not loads:
            return
        if args.should_save:
            self.write({"step": state.global_step, "layers": [x.to_json() for x in loads]})
        for load in loads:
            self.layers.add(load.layer)
            base = self.base.get(load.layer)
            if load.layer not in self.drifted and drifted(load, base):
                self.drifted.append(load.layer)
                self.warnings.append(collapse_warning(state.global_step, load, base))
                self.warn(self.warnings[-1])

    def measure_base(
        self, model: nn.Module, dataset: Any, collate: Callable[[list[Any]], Any], batch: int
    ) -> None:
        """The base's routing on up to BASE_ROWS training rows, collated as the trainer
        does; call it before the first step (routing off: nothing to compare, not measured)."""
        if self.every:
            self.base = self.measured_base(model, dataset, collate, batch)

    def measured_base(
        self, model: nn.Module, dataset: Any, collate: Callable[[list[Any]], Any], batch: int,
        limit: int = BASE_ROWS,
    ) -> dict[int, LayerLoad]:  # fmt: skip
        """What `measure_base` stores, returned (empty with routing off); `limit` rows."""
        if not self.every:
            return {}
        dataset, rows = sampled(dataset, limit)
        device = next(model.parameters()).device
        inputs = batches(dataset, collate, rows, batch, device)
        return base_routing(self.recorder, model, inputs)

    def drift(self) -> dict[str, Any]:
        """summary.json's view: the base's routing, the drifted layers, the rule, the line."""
        layers = len(self.layers | set(self.base))
        return {
            "base": [load.to_json() for _, load in sorted(self.base.items())],
            "drifted_layers": sorted(self.drifted),
            "drift_margin": DRIFT_MARGIN,
            "line": drift_line(self.base, sorted(self.drifted), layers),
        }


def summarize(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per layer over all records: last and lowest entropy, collapsed steps, dead experts."""
    layers: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for row in rows:
        for load in row["layers"]:
            layers.setdefault(load["layer"], []).append((row["step"], load))
    out = {str(layer): _layer_summary(seen) for layer, seen in sorted(layers.items())}
    collapsed = [int(k) for k, v in out.items() if v["collapsed_steps"]]
    return {"records": len(rows), "collapsed_layers": collapsed, "layers": out}


def _layer_summary(seen: list[tuple[int, dict[str, Any]]]) -> dict[str, Any]:
    entropies = [load["entropy"] for _, load in seen]
    last_step, last = seen[-1]
    return {
        "last_step": last_step,
        "entropy_last": last["entropy"],
        "entropy_min": min(entropies),
        "entropy_mean": round(sum(entropies) / len(entropies), 6),
        "max_fraction_last": last["max_fraction"],
        "min_fraction_last": last["min_fraction"],
        "dead_experts_last": last["dead_experts"],
        "collapsed_steps": [step for step, load in seen if load["collapsed"]],
    }
