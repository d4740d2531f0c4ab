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
   more than its E/N experts plus the ones in flight.
4. **the router stays as it is** – frozen, in the base's ids (its saved hash, the routing
   records and the recompute's replay all see base ids); the experts forward maps the ids
   it is given to positions (`ExpertShard.order`).
5. **the LoRA factors** (whole on every rank) are reordered the same way, and serialised
   in the base's order: a state-dict hook puts them back for every save (the adapter, a
   checkpoint), a load pre-hook reorders what a resume loads. The saved adapter equals one
   process's; the optimizer state follows the live order, so a resume must place the same
   way (the placement is kept in the run dir).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moetune.engine.expert_parallel import _SHARD, ExpertShard
from moetune.engine.experts_lora import _STATE, EngineError


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
    """Lay this rank's share of `experts` (placed contiguously by shard_experts) out in
    `order`: its stacks exchanged, its LoRA factors reordered. Every rank of the group calls
    it for the same module, with the same order."""
    shard: ExpertShard | None = experts.__dict__.get(_SHARD)
    if shard is None or shard.order is not None:
        raise EngineError(
            f"{type(experts).__name__} is not placed contiguously by shard_experts",
            "place the experts once, after shard_experts and before the first step",
        )
    if sorted(order) != list(range(shard.experts)):
        raise EngineError(f"a placement must name each of the {shard.experts} experts once",
                          "build it with balanced_groups")  # fmt: skip
    for stack in experts.parameters(recurse=False):
        stack.data = _regroup(stack.data, shard, order)
    for wrapper in experts.__dict__.get(_STATE, {}).values():
        _reorder_factors(wrapper, order)
    experts.__dict__[_SHARD] = replace(shard, order=tuple(order))


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


def _reorder_factors(wrapper: Any, order: Sequence[int]) -> None:
    """peft's factors of every adapter (A [r·E, in] rows expert-major, B [out, r·E] columns
    expert-fastest) in `order`; saved and loaded in the base's order (hooks)."""
    experts, perm = wrapper.num_experts, torch.tensor(order)
    inverse = torch.argsort(perm)
    for adapter in wrapper.lora_A:
        for module, axis in ((wrapper.lora_A[adapter], 0), (wrapper.lora_B[adapter], 1)):
            with torch.no_grad():
                module.weight.copy_(_permuted(module.weight, perm, axis, experts))
            module.register_state_dict_post_hook(_saving(inverse, axis, experts))
            module.register_load_state_dict_pre_hook(_loading(perm, axis, experts))


def _permuted(w: torch.Tensor, perm: torch.Tensor, axis: int, experts: int) -> torch.Tensor:
    """Experts of a factor reordered: position j gets expert perm[j]."""
    perm = perm.to(w.device)
    if axis == 0:  # A: [r·E, in], expert-major
        return w.view(experts, -1, w.shape[-1])[perm].reshape(w.shape)
    return w.view(w.shape[0], -1, experts)[:, :, perm].reshape(w.shape)  # B: expert-fastest


def _saving(inverse: torch.Tensor, axis: int, experts: int) -> Any:
    def hook(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        key = prefix + "weight"
        if key in state:
            state[key] = _permuted(state[key], inverse, axis, experts)

    return hook


def _loading(perm: torch.Tensor, axis: int, experts: int) -> Any:
    def hook(module: nn.Module, state: dict[str, Any], prefix: str, *_args: Any) -> None:
        key = prefix + "weight"
        if key in state:
            state[key] = _permuted(state[key], perm, axis, experts)

    return hook
