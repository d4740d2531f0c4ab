"""ESFT-style expert selection: LoRA trains only the experts the task routes to most.

Expert-Specialized Fine-Tuning (Wang et al. 2024) scores each expert of every MoE layer on
a sample of the training data with the frozen base, then tunes only the few that cover a
share of the layer's routing. Here (`lora.expert_selection`: gate | token):

1. score – the base (adapters off, eval mode, no grad) runs over up to
   `lora.expert_selection_rows` tokenised training rows, spread evenly over the dataset;
   train/routing/recorder.py's `RoutingRecorder` reads each router's decisions (padding left out),
   and a registered scorer turns them into one score per expert: "gate" the mean routing
   weight an expert receives per token (0 where not routed; the weights as the family's
   router produces them), "token" its share of the (token, slot) assignments;
2. choose – per layer, experts by descending score (ties: lower id first) until their
   cumulative share of the layer's total reaches `lora.expert_selection_share`, at least one;
3. restrict – gradient hooks zero the unselected experts' slices of every adapter's
   lora_A / lora_B gradient (peft's layout: A rows expert-major, B columns expert-fastest),
   for either engine; the split engine also skips their LoRA compute (`train_only`).
   With lora_B initialised to zero (peft's default, asserted here) their ΔW stays exactly
   zero through AdamW – zero gradient, zero moments, and decoupled weight decay of a zero
   is zero – so the saved adapter leaves them as the base has them. (Weight decay still
   shrinks their lora_A, which changes nothing while B is zero.)

The router stays frozen: selection is refused with lora.train_router (`check_selection`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from moetune.engine.experts_lora import PROJECTIONS, EngineError, train_only
from moetune.errors import ConfigError
from moetune.model.families.registry import get_family
from moetune.model.layers import decoder_layers
from moetune.train.routing.modes import measuring
from moetune.train.routing.recorder import RoutingRecorder
from moetune.train.routing.rows import batches, sampled

if TYPE_CHECKING:
    from torch import nn
    from torch.utils.hooks import RemovableHandle

    from moetune.config import LoraArgs
    from moetune.model.spec import ModelSpec

FILE = "experts_selected.json"  # in the run dir
_EPS = 1e-9  # a share reached up to float rounding counts as reached

# mode -> scores [E] from the routing decisions: indices [tokens, top_k], their weights
# (None where the router output had none), number of experts
Scorer = Callable[[torch.Tensor, torch.Tensor | None, int], torch.Tensor]
SCORERS: dict[str, Scorer] = {}


def scorer(mode: str) -> Callable[[Scorer], Scorer]:
    """Register a score mode for `lora.expert_selection`."""

    def add(fn: Scorer) -> Scorer:
        SCORERS[mode] = fn
        return fn

    return add


@scorer("gate")
def mean_gate(
    indices: torch.Tensor, weights: torch.Tensor | None, num_experts: int
) -> torch.Tensor:
    """ESFT's average gate score: the routing weight each expert gets, averaged over tokens."""
    if weights is None:
        raise EngineError(
            "expert selection by gate score found no routing weights in the router output",
            "set lora.expert_selection: token",
        )
    total = torch.zeros(num_experts, dtype=torch.float64)
    total.index_add_(0, indices.reshape(-1).long(), weights.reshape(-1).double())
    return total / max(indices.shape[0], 1)


@scorer("token")
def token_share(
    indices: torch.Tensor, weights: torch.Tensor | None, num_experts: int
) -> torch.Tensor:
    """ESFT's token selection ratio: each expert's share of the routed (token, slot) pairs."""
    counts = torch.bincount(indices.reshape(-1).long(), minlength=num_experts)
    return counts.double() / max(indices.numel(), 1)


# ---------------------------------------------------------------- choosing


def pick(scores: Sequence[float], share: float) -> tuple[list[int], float]:
    """Experts by descending score (ties: lower id) until they cover `share` of the total;
    at least one. Returns the chosen ids (ascending) and the share they cover."""
    total = float(sum(scores))
    order = sorted(range(len(scores)), key=lambda e: (-scores[e], e))
    if total <= 0:  # nothing routed: no share to cover
        return order[:1], 0.0
    chosen: list[int] = []
    covered = 0.0
    for expert in order:
        chosen.append(expert)
        covered += scores[expert] / total
        if covered >= share - _EPS:
            break
    return sorted(chosen), min(covered, 1.0)


@dataclass(frozen=True)
class LayerChoice:
    layer: int
    selected: tuple[int, ...]
    scores: tuple[float, ...]  # per expert, by expert id
    share: float  # of the layer's total score the selected experts cover

    def to_json(self) -> dict[str, Any]:
        return {
            "selected": list(self.selected),
            "scores": [round(s, 8) for s in self.scores],
            "share": round(self.share, 6),
        }


@dataclass(frozen=True)
class ExpertSelection:
    """What `experts_selected.json` holds: the experts that train, per MoE layer."""

    mode: str
    target_share: float
    rows: int  # training rows scored
    tokens: int  # real (non-padding) tokens scored
    num_experts: int
    layers: tuple[LayerChoice, ...]

    @property
    def trained(self) -> int:
        return sum(len(c.selected) for c in self.layers)

    def keep(self, layer: int) -> torch.Tensor:
        """[E] bool: the experts of `layer` that train."""
        mask = torch.zeros(self.num_experts, dtype=torch.bool)
        mask[list(self._by_layer()[layer].selected)] = True
        return mask

    def _by_layer(self) -> dict[int, LayerChoice]:
        return {c.layer: c for c in self.layers}

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "target_share": self.target_share,
            "rows": self.rows,
            "tokens": self.tokens,
            "trained_experts": self.trained,
            "total_experts": self.num_experts * len(self.layers),
            "selected": {str(c.layer): list(c.selected) for c in self.layers},
        }

    def to_json(self) -> dict[str, Any]:
        layers = {str(c.layer): c.to_json() for c in self.layers}
        return {**self.summary(), "num_experts": self.num_experts, "layers": layers}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ExpertSelection:
        layers = tuple(
            LayerChoice(int(k), tuple(v["selected"]), tuple(v["scores"]), v["share"])
            for k, v in sorted(data["layers"].items(), key=lambda kv: int(kv[0]))
        )
        return cls(
            mode=data["mode"],
            target_share=data["target_share"],
            rows=data["rows"],
            tokens=data["tokens"],
            num_experts=data["num_experts"],
            layers=layers,
        )

    def describe(self) -> str:
        return (
            f"expert selection ({self.mode}, share {self.target_share}): LoRA on "
            f"{self.trained}/{self.num_experts * len(self.layers)} experts, scored on "
            f"{self.rows} rows ({self.tokens} tokens)"
        )


def choose(
    scores: dict[int, torch.Tensor], mode: str, share: float, rows: int, tokens: int
) -> ExpertSelection:
    """`pick` on every layer's scores ([E] each)."""
    layers = []
    for layer, layer_scores in sorted(scores.items()):
        values = [float(s) for s in layer_scores.tolist()]
        selected, covered = pick(values, share)
        layers.append(LayerChoice(layer, tuple(selected), tuple(values), covered))
    num_experts = len(layers[0].scores) if layers else 0
    return ExpertSelection(mode, share, rows, tokens, num_experts, tuple(layers))


def select_experts(
    model: nn.Module, spec: ModelSpec, lora: LoraArgs, dataset: Any,
    collate: Callable[[list[Any]], dict[str, Any]], batch_size: int,
) -> ExpertSelection:  # fmt: skip
    """Score the experts on up to `lora.expert_selection_rows` rows of the (tokenised)
    `dataset`, collated as the trainer does, and choose per layer."""
    dataset, rows = sampled(dataset, lora.expert_selection_rows)
    device = next(model.parameters()).device
    inputs = batches(dataset, collate, rows, batch_size, device)
    scores, tokens = score_experts(model, spec, inputs, lora.expert_selection)
    return choose(scores, lora.expert_selection, lora.expert_selection_share, len(rows), tokens)


def check_selection(lora: LoraArgs, spec: ModelSpec) -> None:
    """Refuse a selection the run cannot honour, before anything is written."""
    if lora.expert_selection == "all":
        return
    asked = f"lora.expert_selection={lora.expert_selection}"
    if lora.expert_selection not in SCORERS:
        raise ConfigError(f"{asked} is not a score mode", f"use one of: all, {', '.join(SCORERS)}")
    if lora.train_router:
        raise ConfigError(
            f"{asked} with lora.train_router: experts are chosen by the frozen router's "
            "routing, which training the router would change",
            "set lora.train_router: false, or lora.expert_selection: all",
        )
    if "experts" not in lora.targets:
        raise ConfigError(
            f"{asked} but lora.targets has no experts, so there are no expert LoRA to select",
            "add experts to lora.targets, or set lora.expert_selection: all",
        )
    if not spec.is_moe:
        raise ConfigError(
            f"{asked} but {spec.name} has no routed experts", "set lora.expert_selection: all"
        )


# ---------------------------------------------------------------- scoring


def score_experts(
    model: nn.Module, spec: ModelSpec, inputs: Iterable[dict[str, Any]], mode: str
) -> tuple[dict[int, torch.Tensor], int]:
    """Per MoE layer, the `mode` score of each expert over `inputs` (frozen base), and the
    number of tokens scored."""
    recorder = RoutingRecorder(model, spec, weights=True)
    try:
        recorder.start()
        with measuring(model), _adapters_off(model):
            for batch in inputs:
                model(**batch)
        routed = recorder.routed()
    finally:
        recorder.remove()
    missing = sorted(set(spec.moe_layers) - set(routed))
    if missing:
        raise EngineError(
            f"expert selection read no routing for MoE layers {missing}",
            "set lora.expert_selection: all (the family's router output is not readable)",
        )
    score = SCORERS[mode]
    scores = {layer: score(idx, w, spec.num_experts) for layer, (idx, w) in routed.items()}
    return scores, int(next(iter(routed.values()))[0].shape[0])


def _adapters_off(model: nn.Module) -> contextlib.AbstractContextManager[Any]:
    disable = getattr(model, "disable_adapter", None)
    return disable() if callable(disable) else contextlib.nullcontext()


# ---------------------------------------------------------------- restricting training


def expert_wrappers(model: nn.Module, spec: ModelSpec) -> dict[int, list[Any]]:
    """MoE layer -> peft's wrappers of its fused expert stacks (gate_up/up and down)."""
    # lazy: heavy to import (peft)
    from peft.tuners.lora.layer import ParamWrapper

    layers = decoder_layers(model, spec, get_family(spec.model_type))
    return {
        i: [
            m for m in layers[i].modules()
            if isinstance(m, ParamWrapper) and m.parameter_name in PROJECTIONS
            and m.num_experts == spec.num_experts
        ]
        for i in spec.moe_layers
    }  # fmt: skip


def factor_masks(wrapper: Any, keep: torch.Tensor, adapter: str) -> tuple[torch.Tensor, ...]:
    """Masks that broadcast over lora_A [r·E, in] (rows expert-major) and lora_B [out, r·E]
    (columns expert-fastest): True where the entry belongs to an expert in `keep`."""
    rank = wrapper.lora_A[adapter].weight.shape[0] // wrapper.num_experts
    return keep.repeat_interleave(rank)[:, None], keep.repeat(rank)[None, :]


def restrict_training(
    model: nn.Module, spec: ModelSpec, selection: ExpertSelection
) -> list[RemovableHandle]:
    """Only the selected experts' LoRA trains (module docstring, step 3); the hooks' handles."""
    wrappers = expert_wrappers(model, spec)
    if not any(wrappers.values()):
        raise EngineError(
            f"expert selection found no LoRA on fused expert stacks in {spec.name}",
            "use lora.expert_mapping: explicit, or lora.expert_selection: all",
        )
    handles = []
    for layer, found in wrappers.items():
        keep = selection.keep(layer)
        for wrapper in found:
            handles += _mask_gradients(wrapper, keep)
            device = next(wrapper.lora_A.parameters()).device
            device = torch.device("cpu") if device.type == "meta" else device  # sharded load
            train_only(wrapper.get_base_layer(), keep.to(device))  # split engine: skip the rest
    return handles


def _mask_gradients(wrapper: Any, keep: torch.Tensor) -> list[RemovableHandle]:
    handles = []
    for adapter in wrapper.lora_A:
        a, b = wrapper.lora_A[adapter].weight, wrapper.lora_B[adapter].weight
        keep_a, keep_b = (m.to(a.device) for m in factor_masks(wrapper, keep, adapter))
        # a sharded load's meta factors: rank 0 checks the values it broadcasts
        if not b.is_meta and bool(b.detach().masked_select(~keep_b).any()):
            raise EngineError(
                "expert selection needs lora_B initialised to zero: the unselected experts' "
                "update would not stay zero",
                "keep peft's default init_lora_weights=True",
            )
        handles.append(a.register_hook(partial(_masked, keep_a)))
        handles.append(b.register_hook(partial(_masked, keep_b)))
    return handles


def _masked(keep: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    return grad.masked_fill(~keep, 0)


def changed_unselected(model: nn.Module, spec: ModelSpec, selection: ExpertSelection) -> list[int]:
    """MoE layers where an unselected expert's lora_B is no longer exactly zero."""
    changed = []
    for layer, found in expert_wrappers(model, spec).items():
        keep = selection.keep(layer)
        for wrapper in found:
            for adapter in wrapper.lora_B:
                keep_b = factor_masks(wrapper, keep, adapter)[1]
                b = wrapper.lora_B[adapter].weight.detach()
                if bool(b.masked_select(~keep_b.to(b.device)).any()):
                    changed.append(layer)
    return sorted(set(changed))
