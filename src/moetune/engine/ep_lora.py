"""Expert parallelism's LoRA (train.strategy ep): each rank holds only its own experts'
LoRA factors, so their gradients and AdamW state are E/N of the whole as well.

**Layout.** peft keeps a fused experts projection's factors (ParamWrapper) as A [r·E, in],
expert e's rows at e·r … e·r + r − 1 (expert-major), and B [out, r·E], expert e's columns
at j·E + e for j < r (expert-fastest). A rank holding the experts `ExpertShard.part` keeps
those experts' rows of A and columns of B, in the same layout with E/N for E – what split
LoRA reads (experts_lora._factors takes the count from the shapes). They are never trained
whole: `shard_lora` swaps them in before the optimizer exists.

**Gradient.** Each rank's loss L_r is over its own micro-batch, and the run minimises
L = (1/N)·Σ_r L_r: DDP all-reduces the replicated parameters' gradients and divides by N.
An expert's factors live on their owner only, and the token exchange's backward returns
every rank's rows to it, so after backward the owner's gradient is Σ_r ∂L_r/∂θ – N times
∂L/∂θ. DDP ignores these parameters (`_ddp_params_and_buffers_to_ignore`: nothing to
average, and its start-up broadcast would overwrite each rank's slice with rank 0's), and a
hook scales their gradient by 1/N: the update is one process's on the global batch.
Gradient clipping needs the norm of the whole: `grad_norm` adds every rank's sliced part.

**A slice no token reached.** On one process a factor gets a gradient when any of its
experts does (zero for the others), so AdamW steps every expert's slice: its moments, its
weight decay, its step count. A rank whose experts got no rows in a step (or whose experts
expert selection leaves out) has no gradient on its slice, and AdamW would skip it – its
state then lags one process's, and at the first checkpoint it has none to gather while the
other ranks wait for it. `fill_missing_grads` (before every optimizer step) asks the group
which slices got a gradient anywhere and gives those that got none here a zero one: every
rank steps each factor exactly when one process would.

**Whole again.** `whole` gathers a sliced tensor from every rank (`all_gather` over the ep
group) into peft's layout – for the saved adapter and the optimizer state's moments,
which are shaped like their parameter – and `part_of` cuts a whole one back to this
rank's slice (resume: the checkpoint holds the whole adapter and the whole state, the
same files one process writes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from peft.tuners.lora.layer import ParamWrapper
from torch import nn

from moetune.engine.expert_parallel import _IGNORE, _SHARD, ExpertShard

if TYPE_CHECKING:
    from collections.abc import Iterable

_PIECE = "_moetune_ep_piece"  # on a LoRA factor held sliced: its Piece


@dataclass(frozen=True)
class Piece:
    """Which part of a whole factor a parameter holds: A's rows or B's columns of `shard`'s
    experts, at LoRA rank `r`."""

    kind: str  # "A" ([r·E, in], rows expert-major) or "B" ([out, r·E], columns expert-fastest)
    r: int
    shard: ExpertShard

    def whole_shape(self, held: torch.Size) -> tuple[int, int]:
        rows, cols = held
        scale = self.shard.ranks  # E/N experts held of E
        return (rows * scale, cols) if self.kind == "A" else (rows, cols * scale)


def piece_of(param: torch.Tensor) -> Piece | None:
    """The Piece a parameter holds (None: it is held whole)."""
    return param.__dict__.get(_PIECE)


def experts_axis(w: torch.Tensor, kind: str, experts: int) -> torch.Tensor:
    """A view of a factor (or a moment shaped like it) with its experts first, in peft's
    layout (module docstring): A [r·E, in] -> [E, r, in], B [out, r·E] -> [E, out, r].
    Writing into the view writes into `w`."""
    if kind == "A":  # expert-major rows
        return w.view(experts, -1, w.shape[-1])
    return w.view(w.shape[0], -1, experts).permute(2, 0, 1)  # expert-fastest columns


def from_experts_axis(t: torch.Tensor, kind: str) -> torch.Tensor:
    """`experts_axis` undone: peft's layout again, contiguous."""
    if kind == "A":
        return t.reshape(-1, t.shape[-1])
    return t.permute(1, 2, 0).reshape(t.shape[1], -1)


def held_experts(shard: ExpertShard, rank: int, device: torch.device) -> slice | torch.Tensor:
    """The base experts `rank` holds, in its stacks' order: its contiguous part, or under a
    balanced placement (ep_placement.py) the base ids at those positions (on `device`)."""
    part = replace(shard, rank=rank).part
    return part if shard.order is None else torch.tensor(shard.order[part], device=device)


def part_of(whole: torch.Tensor, piece: Piece) -> torch.Tensor:
    """This rank's slice of a whole factor (or of a moment shaped like it; the base's
    expert order), in the order this rank holds its experts; own storage."""
    mine = held_experts(piece.shard, piece.shard.rank, whole.device)
    return from_experts_axis(experts_axis(whole, piece.kind, piece.shard.experts)[mine],
                             piece.kind).clone()  # fmt: skip


def whole(held: torch.Tensor, piece: Piece) -> torch.Tensor:
    """Every rank's slice of a factor (or moment) gathered into the whole, in peft's layout,
    on every rank. A collective: every rank of the ep group calls it, in the same order."""
    shard = piece.shard
    pieces = [torch.empty_like(held) for _ in range(shard.ranks)]
    dist.all_gather(pieces, held.detach().contiguous(), group=shard.group)
    out = held.new_empty(piece.whole_shape(held.shape))
    into = experts_axis(out, piece.kind, shard.experts)  # writes land in `out`
    for rank, got in enumerate(pieces):
        into[held_experts(shard, rank, out.device)] = experts_axis(got, piece.kind, shard.local)
    return out


def shard_lora(model: nn.Module) -> list[str]:
    """Keep only this rank's experts' LoRA factors on every sharded experts module (after
    shard_experts); DDP ignores them and their gradient is scaled by 1/N (module docstring).
    Returns the names of the sliced parameters."""
    sliced: list[nn.Parameter] = []
    for module in model.modules():
        experts = _experts_of(module)
        shard = None if experts is None else experts.__dict__.get(_SHARD)
        if shard is not None and shard.ranks > 1:
            sliced += _slice_wrapper(module, shard)
    ids = {id(p) for p in sliced}
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    model.__dict__[_IGNORE] = sorted({*model.__dict__.get(_IGNORE, []), *names})
    return names


def _experts_of(module: nn.Module) -> Any:
    """The experts module a peft ParamWrapper adapts (None: not a ParamWrapper)."""
    return module.get_base_layer() if isinstance(module, ParamWrapper) else None


def _slice_wrapper(wrapper: Any, shard: ExpertShard) -> list[nn.Parameter]:
    """Swap each adapter's A and B of one ParamWrapper for this rank's slices."""
    out = []
    for adapter in wrapper.lora_A:
        r = wrapper.r[adapter]
        for kind, linear in (("A", wrapper.lora_A[adapter]), ("B", wrapper.lora_B[adapter])):
            piece = Piece(kind, r, shard)
            held = nn.Parameter(part_of(linear.weight.data, piece), linear.weight.requires_grad)
            held.__dict__[_PIECE] = piece
            held.register_hook(lambda grad, n=shard.ranks: grad / n)  # Σ_r ∂L_r → ∂L
            linear.weight = held
            out.append(held)
    return out


def grad_norm(params: Iterable[torch.Tensor], group: Any) -> torch.Tensor:
    """The 2-norm of the whole gradient: the replicated parameters' (the same on every rank)
    plus every rank's sliced factors' (summed over the ep group)."""
    grads = [(p.grad, piece_of(p) is not None) for p in params if p.grad is not None]
    device = grads[0][0].device if grads else torch.device("cpu")
    squares = torch.zeros(2, dtype=torch.float64, device=device)
    for grad, sliced in grads:
        squares[int(sliced)] += grad.detach().double().pow(2).sum()
    sliced_sum = squares[1:].clone()
    dist.all_reduce(sliced_sum, group=group)
    return (squares[0] + sliced_sum[0]).sqrt()


def fill_missing_grads(params: Iterable[torch.Tensor], group: Any) -> None:
    """A zero gradient on each sliced factor that got none here while another rank's slice
    of it got one (module docstring). A collective: every rank of the ep group calls it
    before every optimizer step, with the same parameters."""
    sliced = [p for p in params if p.requires_grad and piece_of(p) is not None]
    if not sliced:
        return
    got = ranks_with([p.grad is not None for p in sliced], group, sliced[0].device)
    for param, ranks in zip(sliced, got, strict=True):
        if ranks and param.grad is None:
            param.grad = torch.zeros_like(param)


def ranks_with(flags: list[bool], group: Any, device: torch.device) -> list[int]:
    """Per flag, how many ranks of `group` (None: every rank) raised it – which parameters
    got a gradient where. A collective: every rank calls it with as many flags."""
    got = torch.tensor(flags, dtype=torch.int32, device=device)  # NCCL: device tensors only
    dist.all_reduce(got, group=group)
    return [int(n) for n in got.tolist()]


def fill_before_step(optimizer: torch.optim.Optimizer, group: Any) -> None:
    """`fill_missing_grads` before each of `optimizer`'s steps (a step pre-hook)."""

    def hook(opt: torch.optim.Optimizer, *_args: Any) -> None:
        fill_missing_grads([p for g in opt.param_groups for p in g["params"]], group)

    optimizer.register_step_pre_hook(hook)


def ep_group(model: nn.Module) -> Any:
    """The ep process group of a model whose LoRA is held sliced (None: none is)."""
    for param in model.parameters():
        piece = piece_of(param)
        if piece is not None:
            return piece.shard.group
    return None
