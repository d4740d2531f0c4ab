"""The recompute of gradient checkpointing routes every token to the experts it went to in
forward (train.strategy ep with train.gradient_checkpointing).

Checkpointing re-runs each decoder layer in backward, its router included. A router that
is not deterministic across calls (jitter noise outside the saved RNG state, a kernel
with non-deterministic reductions, a gate that reads a step counter) could route a token
differently in the recompute: under ep its rows would travel to another rank than in
forward, and backward would differentiate a graph the loss never saw.

So every MoE layer's router keeps the forward's top-k (indices and weights) of each
micro-batch, and its recompute takes them back. Trainers (transformers', TRL's) run one
forward then its backward per micro-batch; a second training forward while a choice waits
is refused, since autograd, not this module, would pick which pass recomputes first. The
weights' values are the forward's; their gradient flows through the recompute's own router
logits at those experts (the family's gate rule, as GRPO's routing replay recomputes them),
so the router and the hidden states get their gradient as before. The forward goes through
the same replay of its own choice: its values are the router's, and checkpointing sees the
same operations (and saved tensors) in forward and recompute.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from moetune.train.errors import TrainError
from moetune.train.grpo.replay import GATES, innermost, replayed
from moetune.train.routing.recorder import routed_experts, routed_weights

_Choice = tuple[torch.Tensor, torch.Tensor]  # [tokens, k] indices, their weights


def in_backward() -> bool:
    """True inside an autograd backward – where checkpointing's recompute runs (torch's own
    checkpoint tells the two apart the same way)."""
    return bool(torch._C._current_graph_task_id() != -1)


class RecomputeReplay:
    """Forward hooks on the routers: keep each forward's top-k, replay it in the recompute."""

    def __init__(self, routers: Iterable[nn.Module], num_experts: int, top_k: int) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.rerouted = 0  # (token, slot) choices the recompute's router alone would change
        self._kept: dict[int, deque[_Choice]] = {}
        self._handles: list[RemovableHandle] = []
        for router in routers:
            _require_gate(router)
            self._handles.append(router.register_forward_hook(self._hook))

    def _hook(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not (module.training and torch.is_grad_enabled()):
            return None  # evaluation, a reference pass: nothing is recomputed
        kept = self._kept.setdefault(id(module), deque())
        own = routed_experts(output, self.num_experts, self.top_k)
        if own is None:
            raise TrainError(f"cannot read the top-k of router {type(module).__name__}",
                             "set train.gradient_checkpointing false")  # fmt: skip
        if not in_backward():
            _require_replayed(module, kept)
            choice = (own.detach().clone(), _detached(routed_weights(output, own), own))
            kept.append(choice)
            # the same autograd operations as the recompute's: checkpointing matches the
            # tensors the two save one by one
            return _values_from(replayed(module, output, choice[0]), *choice)
        return self._replay(module, output, own, kept)

    def _replay(self, module: nn.Module, output: Any, own: torch.Tensor, kept: Any) -> Any:
        if not kept or kept[0][0].shape != own.shape:
            raise TrainError(
                f"the recompute of router {type(module).__name__} has no forward choice of "
                f"its {own.shape[0]} tokens to replay (a forward ran outside the step)",
                "set train.gradient_checkpointing false, and report it",
            )
        indices, weights = kept.popleft()
        self.rerouted += int((own.sort(-1).values != indices.sort(-1).values).sum())
        out = replayed(module, output, indices)
        return _values_from(out, indices, weights)

    def pending(self) -> int:
        """Forward choices not replayed yet (0 after each step's backward)."""
        return sum(len(q) for q in self._kept.values())

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles, self._kept = [], {}


def _require_replayed(module: nn.Module, kept: Any) -> None:
    """A forward while an earlier one's choice waits: the recompute could take the wrong
    one (the order in which backward recomputes two passes is autograd's), so refuse."""
    if kept:
        raise TrainError(
            f"router {type(module).__name__} ran a second training forward before the "
            "checkpointed recompute of the first; the recompute could replay the wrong routing",
            "run one forward and its backward per micro-batch, or set "
            "train.gradient_checkpointing false",
        )


def _detached(weights: torch.Tensor | None, indices: torch.Tensor) -> torch.Tensor:
    if weights is None:  # a router giving logits only: replayed() recomputes all of them
        return torch.empty(0)
    return weights.detach().reshape(indices.shape).clone()


def _values_from(output: Any, indices: torch.Tensor, forward: torch.Tensor) -> Any:
    """`output` with its weights' values set to the forward's, their gradient kept."""
    if not forward.numel() or not isinstance(output, tuple | list):
        return output
    parts = list(output)
    floats = [i for i, t in enumerate(parts[1:], 1)  # the weights: float, shaped like indices
              if isinstance(t, torch.Tensor) and t.is_floating_point()
              and t.numel() == indices.numel()]  # fmt: skip
    if not floats:
        return output
    live = parts[floats[-1]]  # replayed() put the recompute's weights there (as in its rule)
    # the forward's values exactly (+ 0), the gradient of the recompute's live weights
    parts[floats[-1]] = forward.to(live.dtype).reshape(live.shape) + (live - live.detach())
    return tuple(parts)


def _require_gate(router: nn.Module) -> None:
    name = type(innermost(router)).__name__
    if name not in GATES.names():
        raise TrainError(
            f"train.strategy ep replays each forward's routing in the checkpointed recompute, "
            f"and router {name} has no gate rule to recompute its weights",
            "set train.gradient_checkpointing false, or add the family's rule to "
            "moetune.train.grpo.replay.GATES",
        )
