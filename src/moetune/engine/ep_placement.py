"""Balanced expert placement (`train.ep_placement: balanced`): each rank's experts chosen
from the base's measured routing so the ranks receive about the same rows.

Contiguous placement gives rank i experts i·E/N … (i+1)·E/N − 1; a base whose busy experts
sit side by side sends most rows to one rank, which then sets every step's pace and its
all-to-all buffers. Here, per MoE layer:

1. **groups** – the layer's per-expert loads (top-k assignments of the base on training rows,
   train/routing/recorder.py's `LayerLoad.counts`) are bin-packed greedily: experts by load,
   heaviest first (ties: lower id), each to the rank with the least load so far that still
   has room (E/N experts a rank; ties: lower rank). The heaviest rank then exceeds the
   mean by at most one expert's load (the last one it took).
2. **order** – the groups, each in ascending id, laid end to end: the layer's stacks are
   reordered to it, so each rank's experts stay one contiguous slice (`ExpertShard.part`)
   and everything that slices by `part` (split LoRA, the LoRA factors) is unchanged.
3. **moving the experts** – each rank sends every other rank the experts of its new group
   it holds, with one `all_to_all_single` per stack (uneven splits); no rank ever holds
   more than its E/N experts plus the ones in flight. Under train.offload the stacks are
   in the rank's ExpertStore, not parameters: nothing is exchanged, the store reads its
   placed experts from the base's files instead (offload/load.py's `hold_experts`), the one
   reader the load used, and drops the ones it held first.
4. **the router stays as it is** – frozen, in the base's ids (its saved hash, the routing
   records and the recompute's replay all see base ids); the experts forward maps the ids
   it is given to positions (`ExpertShard.order`).
5. **the LoRA factors** – each rank holds its experts' slices only (ep_lora.py's
   `shard_lora`, before placing): the slices travel with their experts, by the same
   exchange. A factor's Piece then knows the order, so the whole adapter and the optimizer
   state a checkpoint holds are gathered in the base's expert order (peft's layout, the
   files one process writes) and a resume cuts each rank's slice back out in its live order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetune.engine.ep_lora import _PIECE, experts_axis, from_experts_axis, piece_of
from moetune.engine.expert_parallel import _SHARD, ExpertShard
from moetune.engine.experts_lora import _STATE, EngineError
from moetune.engine.offload.load import hold_experts
from moetune.engine.offload.store import offloaded_of


def shard_of(module: nn.Module) -> ExpertShard | None:
    """The experts a module holds under ep (None: not an experts module placed by ep)."""
    return module.__dict__.get(_SHARD)


def balanced_groups(loads: Sequence[int | float], ranks: int) -> list[list[int]]:
    """E/N experts a rank, bin-packed by load (module docstring, step 1); each ascending."""
    per_rank = len(loads) // ranks
    totals, groups = [0.0] * ranks, [[] for _ in range(ranks)]  # type: list[float], list[list[int]]
    for expert in sorted(range(len(loads)), key=lambda e: (-loads[e], e)):
        rank = min((r for r in range(ranks) if len(groups[r]) < per_rank),
                   key=lambda r: (totals[r], r))  # fmt: skip
        groups[rank].append(expert)
        totals[rank] += loads[expert]
    return [sorted(g) for g in groups]


def rank_loads(loads: Sequence[int | float], order: Sequence[int], ranks: int) -> list[float]:
    """Rows each rank receives when the stacks are laid out in `order`."""
    local = len(order) // ranks
    return [float(sum(loads[e] for e in order[r * local : (r + 1) * local])) for r in range(ranks)]


def place(experts: nn.Module, order: Sequence[int]) -> None:
    """Lay this rank's share of `experts` (placed contiguously by shard_experts, its LoRA
    factors sliced by shard_lora) out in `order`: its stacks and factor slices exchanged.
    Every rank of the group calls it for the same module, with the same order."""
    shard: ExpertShard | None = experts.__dict__.get(_SHARD)
    if shard is None or shard.order is not None:
        raise EngineError(
            f"{type(experts).__name__} is not placed contiguously by shard_experts",
            "place the experts once, after shard_experts and before the first step",
        )
    if sorted(order) != list(range(shard.experts)):
        raise EngineError(f"a placement must name each of the {shard.experts} experts once",
                          "build it with balanced_groups")  # fmt: skip
    factors = [f for w in experts.__dict__.get(_STATE, {}).values() for f in _factors_of(w)]
    placed = replace(shard, order=tuple(order))
    for stack in experts.parameters(recurse=False):
        stack.data = _regroup(stack.data, shard, order)
    for factor in factors:  # the same exchange, experts axis first (ep_lora.experts_axis)
        piece = piece_of(factor)
        assert piece is not None  # _factors_of refused whole ones
        moved = _regroup(experts_axis(factor.data, piece.kind, shard.local), shard, order)
        factor.data = from_experts_axis(moved, piece.kind)
        factor.__dict__[_PIECE] = replace(piece, shard=placed)
    experts.__dict__[_SHARD] = placed
    if offloaded_of(experts):  # train.offload: the rank's store reads its placed experts
        hold_experts(experts, order[shard.part])


def _factors_of(wrapper: Any) -> list[nn.Parameter]:
    """Every adapter's A and B of one wrapper, each held sliced (refused whole: a whole
    factor would keep the base's order while its experts move)."""
    factors = [m.weight for a in wrapper.lora_A for m in (wrapper.lora_A[a], wrapper.lora_B[a])]
    if any(piece_of(f) is None for f in factors):
        raise EngineError("a balanced placement moves sliced LoRA factors, and these are whole",
                          "slice them first (engine/ep_lora.py shard_lora)")  # fmt: skip
    return factors


def _regroup(local: torch.Tensor, shard: ExpertShard, order: Sequence[int]) -> torch.Tensor:
    """This rank's rows of the stack laid out in `order`, from the contiguous ones it holds:
    one all_to_all_single over the group (module docstring, step 3)."""
    per, me = shard.local, shard.rank
    groups = [order[k * per : (k + 1) * per] for k in range(shard.ranks)]
    mine = [[e - me * per for e in sorted(g) if e // per == me] for g in groups]  # by dest
    sends = [len(m) for m in mine]
    gets = [sum(1 for e in groups[me] if e // per == src) for src in range(shard.ranks)]
    rows = local[[i for m in mine for i in m]].reshape(sum(sends), -1).contiguous()
    got = rows.new_empty(sum(gets), rows.shape[1])
    dist.all_to_all_single(got, rows, gets, sends, group=shard.group)
    arrived = sorted(groups[me])  # by source rank, each ascending: ascending overall
    return got[[arrived.index(e) for e in groups[me]]].reshape(local.shape)
