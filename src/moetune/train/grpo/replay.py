"""Routing replay (train.grpo.routing_replay: replay, "R3"): the training pass of an RL step
routes each token the rollout saw to the experts the rollout chose.

The router still runs: its logits are today's, and the gate weights over the replayed
experts are recomputed from them with the family's own rule (softmax or sigmoid scores,
renormalised over the top-k where the family does, scaled where it does), so the loss stays
differentiable through the gate weights as far as it was before. Only the discrete choice –
the top-k indices – is taken from the rollout. A router class without a registered rule is
refused when replay is on (its weights would be guessed).

`GATES` maps a router class name (transformers' modeling files) to its `Gate`; every entry
is checked in tests by replaying a router's own choice and getting its own weights back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from moetune.registry import Registry
from moetune.train.errors import TrainError

if TYPE_CHECKING:
    from torch import nn


def _softmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().softmax(dim=-1)


def _sigmoid(logits: torch.Tensor) -> torch.Tensor:
    return logits.float().sigmoid()


@dataclass(frozen=True)
class Gate:
    """How a family turns router logits into the weights of its chosen experts."""

    score: Callable[[torch.Tensor], torch.Tensor]  # logits -> per-expert scores (fp32)
    normalise: bool | None  # renormalise over the top-k; None: the router's norm_topk_prob
    scaled: bool = False  # multiply by the router's routed_scaling_factor
    eps: float = 0.0  # added to the normalising sum (deepseek_v3 guards a zero sum)

    def weights(self, router: Any, logits: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        """[tokens, k] weights of `indices` from `logits` [tokens, experts], as `router` would."""
        picked = self.score(logits.reshape(indices.shape[0], -1)).gather(1, indices.long())
        norm = self.normalise if self.normalise is not None else router.norm_topk_prob
        if norm:
            picked = picked / (picked.sum(dim=-1, keepdim=True) + self.eps)
        if self.scaled:
            picked = picked * router.routed_scaling_factor
        return picked


SOFTMAX_NORM_FLAG = Gate(_softmax, None)
SOFTMAX_NORMALISED = Gate(_softmax, True)
SIGMOID = Gate(_sigmoid, None, scaled=True, eps=1e-20)

GATES: Registry[Gate] = Registry("router gate rule", TrainError)
for _name, _gate in (
    ("Qwen2MoeTopKRouter", SOFTMAX_NORM_FLAG),
    ("Qwen3MoeTopKRouter", SOFTMAX_NORM_FLAG),
    ("Qwen3NextTopKRouter", SOFTMAX_NORM_FLAG),
    ("OlmoeTopKRouter", SOFTMAX_NORM_FLAG),
    ("MixtralTopKRouter", SOFTMAX_NORMALISED),  # normalises always, no flag
    ("DeepseekV2TopkRouter", Gate(_softmax, False, scaled=True)),
    ("DeepseekV3TopkRouter", SIGMOID),
    ("Glm4MoeTopkRouter", SIGMOID),
    ("Dots1TopkRouter", SIGMOID),
):
    GATES.add(_name, _gate)


def innermost(module: nn.Module) -> Any:
    """The router class under any peft wrappers (their `base_layer`)."""
    inner: Any = module  # peft wrappers are typed loosely
    while hasattr(inner, "base_layer"):
        inner = inner.base_layer
    return inner


def gate_of(router: nn.Module) -> Gate:
    """The registered gate rule of a router, or a one-line refusal with the fix."""
    name = type(innermost(router)).__name__
    if name not in GATES.names():
        raise TrainError(
            f"train.grpo.routing_replay: replay has no gate rule for router {name}",
            "set train.grpo.routing_replay: off, or add the family's rule to "
            "moetune.train.grpo.replay.GATES",
        )
    return GATES.get(name)


def replayed(router: nn.Module, output: Any, indices: torch.Tensor) -> Any:
    """The router's `output` (logits, weights, indices) with `indices` [tokens, k] in place of
    its own choice and their weights recomputed from its logits (grad flows through them)."""
    parts = list(output) if isinstance(output, tuple | list) else [output]
    logits = parts[0]
    at = [i for i, t in enumerate(parts) if _is_indices(t)]
    floats = [i for i, t in enumerate(parts[1:], 1) if _is_weights(t, indices)]
    weights = gate_of(router).weights(innermost(router), logits, indices)
    if at:
        parts[at[0]] = indices.to(parts[at[0]].dtype).reshape(parts[at[0]].shape)
    if floats:
        old = parts[floats[-1]]
        parts[floats[-1]] = weights.to(old.dtype).reshape(old.shape)
    return tuple(parts) if isinstance(output, tuple | list) else parts[0]


def _is_indices(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dim() >= 2


def _is_weights(t: Any, indices: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() == indices.numel()
