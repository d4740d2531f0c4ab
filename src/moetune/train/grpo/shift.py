"""Routing shift between the rollout and the training pass of an RL step (GRPO).

An RL step runs the policy twice over the same tokens: once while sampling (generate, with
a KV cache, no grad) and once to train on them (one forward over prompt + completion). An
MoE may route the same token to a different top-k expert set in the two passes (cache and
batch numerics, dropout, a policy that moved between rollout and update) – the known source
of MoE RL instability. `ShiftRecorder` hooks the routers, keeps the rollout's top-k per
token and, when the training pass sees the same sequence, counts per layer the share of
tokens whose top-k *set* differs and the share whose first choice (highest gate weight)
differs. With `replay`, the training pass routes each token the rollout saw to the experts
the rollout chose (train/grpo/replay.py); the shares then count what the router alone would
have changed.

A base forward is a rollout call when it carries a KV cache (generate passes one, training
passes none) and a training call when autograd records it in train mode; reference and
old-log-prob passes (no grad) are neither. Rollout rows are matched to training rows by
their tokens, so shuffled or re-padded micro-batches still line up; the last generated
token is never fed back during generation, so it has no rollout routing and is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback

from moetune.plan.methods import ROLLOUTS_KEPT
from moetune.train.grpo.adapter_live import LiveCheck, cache_empty
from moetune.train.grpo.replay import gate_of, replayed
from moetune.train.routing.recorder import (
    hook_routing,
    routed_experts,
    routed_weights,
    router_modules,
)

if TYPE_CHECKING:
    from torch import nn

    from moetune.model.spec import ModelSpec


@dataclass
class _Rollout:
    """One generate call: per row the tokens fed so far and, per layer, their top-k."""

    tokens: list[list[torch.Tensor]] = field(default_factory=list)  # row -> chunks
    routes: dict[int, list[list[torch.Tensor]]] = field(default_factory=dict)  # layer -> row ->

    def routed(self, row: int, layer: int) -> torch.Tensor | None:
        """[tokens fed, k] of one row in one layer (None: the layer was not recorded)."""
        return torch.cat(self.routes[layer][row]) if layer in self.routes else None


@dataclass
class LayerShift:
    layer: int
    tokens: int  # matched tokens compared
    differ: int  # of those, tokens whose top-k expert set differs
    differ_top1: int = 0  # of those, tokens whose first choice differs

    @property
    def share(self) -> float:
        return self.differ / self.tokens if self.tokens else 0.0

    @property
    def top1_share(self) -> float:
        return self.differ_top1 / self.tokens if self.tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        shares = {"shift": round(self.share, 6), "top1_shift": round(self.top1_share, 6)}
        return {"layer": self.layer, "tokens": self.tokens, **shares}


def by_weight(output: Any, num_experts: int, top_k: int) -> torch.Tensor | None:
    """A router output's [tokens, k] indices, highest gate weight first (deepseek_v3 picks
    its top-k unsorted, so column 0 is the first choice only after this)."""
    indices = routed_experts(output, num_experts, top_k)
    weights = None if indices is None else routed_weights(output, indices)
    if indices is None or weights is None:
        return indices
    return indices.gather(1, weights.argsort(dim=-1, descending=True, stable=True))


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token, whether two [tokens, k] index tensors hold the same expert set."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)


class ShiftRecorder:
    """Hooks a (peft-wrapped) MoE's routers; `take()` returns the shift counted so far."""

    def __init__(self, model: nn.Module, spec: ModelSpec, replay: bool = False) -> None:
        self.num_experts, self.top_k, self.replay = spec.num_experts, spec.top_k, replay
        self.replayed = 0  # tokens (summed over layers) routed to the rollout's experts
        self._forced: dict[int, torch.Tensor] = {}  # layer -> the indices the last pass used
        self._phase: str | None = None
        self._shape: tuple[torch.Tensor, torch.Tensor] | None = None  # ids, mask of the call
        self._calls: dict[int, torch.Tensor] = {}
        self._rollouts: list[_Rollout] = []
        self._counts: dict[int, list[int]] = {}  # layer -> tokens, set differs, top-1 differs
        self._match: list[tuple[_Rollout, int] | None] | None = None  # per training row
        if replay:  # refuse a router without a gate rule before the first rollout
            for router in router_modules(model, spec).values():
                gate_of(router)
        self._handles = hook_routing(model, spec, self._begin, self._end, self._hook)

    def _begin(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self._phase = None
        if not isinstance(ids, torch.Tensor):
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # transformers 5.24: cache
        if cache is not None:
            self._phase = "rollout"
        elif torch.is_grad_enabled() and module.training:
            self._phase = "train"
        mask = kwargs.get("attention_mask")
        mask = mask if isinstance(mask, torch.Tensor) else torch.ones_like(ids)
        self._shape, self._calls, self._forced = (ids, mask[:, -ids.shape[1] :].bool()), {}, {}
        self._match = None
        if self._phase == "rollout" and (not self._rollouts or cache_empty(cache)):
            kept = self._rollouts[-(ROLLOUTS_KEPT - 1) :]  # the plan counts ROLLOUTS_KEPT
            self._rollouts = [*kept, _Rollout()]  # a new generate call

    def _hook(self, layer: int) -> Callable[[nn.Module, Any, Any], None]:
        def record(module: nn.Module, args: Any, output: Any) -> Any:
            if self._phase is None or self._shape is None:
                return self._recompute(layer, module, output)
            with torch.no_grad():
                indices = by_weight(output, self.num_experts, self.top_k)
            ids = self._shape[0]
            if indices is None or indices.shape[0] != ids.numel():
                return None
            self._calls[layer] = indices.reshape(*ids.shape, -1).cpu()
            if self._phase != "train" or not self.replay:
                return None
            forced = self._rollout_choice(layer).to(indices.device)
            self._forced[layer] = forced
            return replayed(module, output, forced)

        return record

    def _recompute(self, layer: int, module: nn.Module, output: Any) -> Any:
        """Gradient checkpointing re-runs the router in backward: the same forced choice."""
        forced = self._forced.get(layer)
        if forced is None or not torch.is_grad_enabled():
            return None
        own = routed_experts(output, self.num_experts, self.top_k)
        same = own is not None and own.shape == forced.shape
        return replayed(module, output, forced) if same else None

    def _rollout_choice(self, layer: int) -> torch.Tensor:
        """[tokens, k] for the training call: the rollout's experts where the rollout fed the
        token (prompt and completion, all but the last), the router's own elsewhere."""
        assert self._shape is not None
        mask = self._shape[1].cpu()
        forced = self._calls[layer].clone()
        for b, match in enumerate(self._matched()):
            rollout = None if match is None else match[0].routed(match[1], layer)
            if rollout is not None:
                at = mask[b].nonzero().squeeze(-1)[:-1]
                forced[b, at] = rollout[: len(at)]
                self.replayed += len(at)
        return forced.reshape(-1, forced.shape[-1])

    def _matched(self) -> list[tuple[_Rollout, int] | None]:
        """Per row of this training call, the first rollout row fed exactly its tokens (all
        but its last) – found once per call, shared by every layer."""
        if self._match is None:
            assert self._shape is not None
            ids, mask = (t.cpu() for t in self._shape)
            self._match = [self._find(ids[b][mask[b]][:-1]) for b in range(ids.shape[0])]
        return self._match

    def _find(self, tokens: torch.Tensor) -> tuple[_Rollout, int] | None:
        n = len(tokens)
        for rollout in self._rollouts:
            for row, chunks in enumerate(rollout.tokens):
                fed = torch.cat(chunks)
                if len(fed) >= n and torch.equal(fed[:n], tokens):
                    return rollout, row
        return None

    def _end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        phase, self._phase = self._phase, None
        if phase == "rollout":
            self._keep_rollout()
        elif phase == "train":
            self._compare()

    def _keep_rollout(self) -> None:
        assert self._shape is not None
        ids, mask = (t.cpu() for t in self._shape)
        rollout = self._rollouts[-1]
        if not rollout.tokens:
            rollout.tokens = [[] for _ in range(ids.shape[0])]
        for b in range(ids.shape[0]):
            rollout.tokens[b].append(ids[b][mask[b]])
            for layer, routes in self._calls.items():
                per_row = rollout.routes.setdefault(layer, [[] for _ in range(ids.shape[0])])
                per_row[b].append(routes[b][mask[b]])

    def _compare(self) -> None:
        assert self._shape is not None
        mask = self._shape[1].cpu()
        for layer, routes in self._calls.items():
            for b, match in enumerate(self._matched()):
                rollout = None if match is None else match[0].routed(match[1], layer)
                if rollout is not None:
                    train = routes[b][mask[b]][:-1]
                    self._count(layer, train, rollout[: len(train)])

    def _count(self, layer: int, train: torch.Tensor, rollout: torch.Tensor) -> None:
        count = self._counts.setdefault(layer, [0, 0, 0])
        count[0] += len(train)
        count[1] += int((~same_sets(train, rollout)).sum())
        count[2] += int((train[:, 0] != rollout[:, 0]).sum())

    def take(self) -> list[LayerShift]:
        """The shift per layer since the last take (layers with matched tokens only)."""
        out = [LayerShift(layer, *counts) for layer, counts in sorted(self._counts.items())]
        self._counts = {}
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


class ShiftCallback(TrainerCallback):
    """Writes the rollout→training routing shift per logged step; warns once per layer when
    its share exceeds `warn_at` (all warnings also in `.warnings`). With `live`, runs the
    adapter-live check of the first rollouts too (its verdict in `summary()`)."""

    def __init__(
        self,
        recorder: ShiftRecorder,
        warn_at: float,
        write: Callable[[dict[str, Any]], None],
        warn: Callable[[str], None] = lambda message: None,
        live: LiveCheck | None = None,
    ) -> None:
        self.recorder, self.warn_at, self.write, self.warn = recorder, warn_at, write, warn
        self.live = live
        self.warnings: list[str] = []
        self.shares: list[float] = []  # mean share over layers, per step with matches
        self.top1: list[float] = []  # the same for the first choice
        self._since_log: list[tuple[float, float]] = []  # (set, top-1) per step since a log
        self._warned: set[int] = set()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.live is not None and not self.live.done:
            self.live.on_step_end(args, state, control)  # raises on a rollout from the base
        layers = self.recorder.take()
        if not layers:
            return
        mean = sum(x.share for x in layers) / len(layers)
        top1 = sum(x.top1_share for x in layers) / len(layers)
        self.shares.append(mean)
        self.top1.append(top1)
        self._since_log.append((mean, top1))
        if args.should_save:
            row = {"step": state.global_step, "mean_shift": round(mean, 6)}
            row["mean_top1_shift"] = round(top1, 6)
            self.write({**row, "layers": [x.to_json() for x in layers]})
        for x in layers:
            if x.share > self.warn_at and x.layer not in self._warned:
                self._warned.add(x.layer)
                self.warnings.append(
                    f"routing shift at step {state.global_step}: layer {x.layer} routes "
                    f"{x.share:.0%} of tokens to other experts in training than in the "
                    f"rollout (first choice: {x.top1_share:.0%}; > train.grpo.shift_warn "
                    f"{self.warn_at:.0%}); train.grpo.routing_replay: replay removes it"
                )
                self.warn(self.warnings[-1])

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        """The loss row gains the mean shift of the steps since the last one (metrics.jsonl
        keeps it: add this callback before MetricsCallback)."""
        if logs is None or "loss" not in logs or not self._since_log:
            return
        n = len(self._since_log)
        logs["routing_shift"] = round(sum(s for s, _ in self._since_log) / n, 6)
        logs["routing_shift_top1"] = round(sum(t for _, t in self._since_log) / n, 6)
        self._since_log = []

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.live is not None:
            self.live.remove()

    def summary(self) -> dict[str, Any]:
        mean = sum(self.shares) / len(self.shares) if self.shares else None
        return {
            "steps": len(self.shares),
            "mean_shift": round(mean, 6) if mean is not None else None,
            "max_step_shift": round(max(self.shares), 6) if self.shares else None,
            "mean_top1_shift": round(sum(self.top1) / len(self.top1), 6) if self.top1 else None,
            "warn_at": self.warn_at,
            "routing_replay": "replay" if self.recorder.replay else "off",
            "replayed_tokens": self.recorder.replayed,  # summed over MoE layers
            "adapter_live": self.live.result if self.live is not None else None,
        }
