"""GM-1's statistics: t-intervals over seeds, gaps, and routing health from router logits.

Routing health reuses the training stage's `LayerLoad` (train/routing/recorder.py): the routing
decision of a token is the top-k of its router logits, and each layer's load gives the
normalised entropy H/ln E, the max load share, the dead experts (no token over the whole
held-out set) and the collapse flag (one expert the first choice of > 50 % of tokens).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moetune.train.routing.recorder import LayerLoad, layer_load

# two-sided 95 % Student-t quantiles t(0.975, df) for df = 1..30
_T975 = (12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004,
         2.262157, 2.228139, 2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905,
         2.109816, 2.100922, 2.093024, 2.085963, 2.079614, 2.073873, 2.068658, 2.063899,
         2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272)  # fmt: skip
_Z975 = 1.959964


def t975(df: int) -> float:
    """t(0.975, df): the table to 30, a Cornish-Fisher expansion beyond (error < 1e-4)."""
    if df < 1:
        raise ValueError("a t-interval needs at least two values")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True)
class Interval:
    """Mean of `n` values with its 95 % t-interval (`half` None for a single value)."""

    mean: float
    sd: float
    n: int
    half: float | None

    @property
    def low(self) -> float | None:
        return None if self.half is None else self.mean - self.half

    @property
    def high(self) -> float | None:
        return None if self.half is None else self.mean + self.half

    def to_json(self, digits: int = 5) -> dict[str, float | int | None]:
        r = lambda v: None if v is None else round(v, digits)  # noqa: E731
        return {"mean": r(self.mean), "low": r(self.low), "high": r(self.high),
                "half_width": r(self.half), "sd": r(self.sd), "n": self.n}  # fmt: skip


def t_interval(values: Sequence[float]) -> Interval:
    """mean ± t(0.975, n-1) · s / √n with the sample standard deviation s."""
    n = len(values)
    if not n:
        raise ValueError("no values")
    mean = sum(values) / n
    if n == 1:
        return Interval(mean, 0.0, 1, None)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return Interval(mean, sd, n, t975(n - 1) * sd / math.sqrt(n))


def gap_pct(moe: float, dense: float) -> float:
    """(CE_moe − CE_dense) / CE_dense in percent: positive means the MoE is worse."""
    return 100 * (moe - dense) / dense


def routing_health(router_logits: Sequence[torch.Tensor], top_k: int) -> list[LayerLoad]:
    """Per MoE layer, the load of the top-k decisions in its router logits [tokens, E]
    (one tensor per layer, all held-out tokens concatenated)."""
    loads = []
    for layer, logits in enumerate(router_logits):
        flat = logits.reshape(-1, logits.shape[-1])
        indices = flat.float().topk(top_k, dim=-1).indices
        loads.append(layer_load(layer, indices, flat.shape[-1]))
    return loads
