"""Expert parallelism for split LoRA: "moetune_ep", an experts implementation on a DeviceMesh.

Each of the N ranks of the mesh's "ep" dimension holds E/N routed experts, a contiguous
group (rank i: experts i·E/N … (i+1)·E/N − 1), and runs its own micro-batch. In each MoE
layer, on every rank:

1. the (token, slot) pairs are sorted by expert – so by the rank that owns it – and each
   rank learns how many rows every other rank sends it for each of its experts (an
   `all_to_all_single` of the per-expert counts: the splits are uneven);
2. the rows travel to their experts' ranks (`all_to_all_single` with those splits),
   are regrouped by local expert and go through split LoRA there (experts_lora.py: the
   frozen projection plus the expert's rank-r factors, one grouped matmul per group);
3. the results travel back (`all_to_all_single` with the splits swapped) and are weighted
   by the router on the rank the tokens came from, then summed over the k slots – the same
   operations, in the same order, as split LoRA on one process.

Both exchanges are torch's autograd-aware collective (`_functional_collectives.
all_to_all_single_autograd`, whose backward is the exchange with the splits swapped), so
backward returns each row's gradient to the rank it came from, and the gradient of an
expert's factors on its owner sums every rank's tokens. A recompute (gradient
checkpointing) reruns the same exchanges with the top-k it is given: train.strategy ep
replays the forward's there (train/distributed/ep_replay.py).

Under train.strategy ep a rank holds only its own experts' LoRA factors too (ep_lora.py:
their gradients and optimizer state are 1/N, scaled so the update is one process's on
the global batch), and rank 0 saves the adapter whole, gathered, in peft's layout. Called
alone, shard_experts leaves the factors whole: a rank computes with its experts' slices
only, another rank's slice gets a zero gradient there, and a data-parallel average of
whole factors gives what one process computes.

The frozen expert weights are read for the rank's experts only (ep_load.py) – or, loaded
whole, sliced to them (`shard_experts`) – and DDP is told to leave them alone (its start-up
broadcast would overwrite each rank's experts with rank 0's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from peft.tuners.lora.layer import ParamWrapper
from torch import nn
from torch.distributed import _functional_collectives as funcol
from transformers.integrations.moe import ExpertsInterface

from moetune.config.ep_split import check_divides
from moetune.engine.experts_lora import (
    PROJECTIONS,
    Combine,
    Dispatch,
    EngineError,
    Routing,
    _project,
    is_fused_experts,
    route_pairs,
)
from moetune.engine.offload.store import offloaded_of
from moetune.engine.quant.stacks import QUANTIZED, QuantizedStack, stacks_of
from moetune.engine.stored.linear import StoredLinear

IMPLEMENTATION = "moetune_ep"
MESH_DIM = "ep"
_SHARD = "_moetune_ep_shard"  # on an experts module: its ExpertShard
_IGNORE = "_ddp_params_and_buffers_to_ignore"  # read by torch's DistributedDataParallel
PART = "_moetune_ep_part"  # on an experts module: {stack: this rank's experts, as loaded}
READ = "_moetune_ep_read"  # on the base: expert bytes this rank read, and the whole stacks'
_MOVED = "_moetune_ep_moved"  # on an experts module: [rows sent to other ranks, received]


@dataclass(frozen=True)
class ExpertShard:
    """Which routed experts this rank holds, and the group it exchanges tokens in."""

    group: Any  # the mesh's "ep" process group
    ranks: int
    rank: int
    experts: int  # E, all ranks together
    # train.ep_placement balanced (ep_placement.py): the base's expert id at each position of
    # the stacks, whose rank groups stay contiguous (`part`); None: the base's own order
    order: tuple[int, ...] | None = None

    @property
    def local(self) -> int:
        return self.experts // self.ranks

    @property
    def part(self) -> slice:
        return slice(self.rank * self.local, (self.rank + 1) * self.local)


def ep_experts_forward(
    self: Any,  # an experts module decorated by @use_experts_implementation, sharded here
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """The experts forward registered as "moetune_ep" (same contract as grouped_mm)."""
    shard: ExpertShard | None = self.__dict__.get(_SHARD)
    if shard is None:
        raise EngineError(
            f"{type(self).__name__} runs {IMPLEMENTATION} but holds no expert shard.",
            "call shard_experts(model, mesh) on every rank before the first forward.",
        )
    num_tokens, hidden_dim = hidden_states.shape
    top_k = top_k_index.size(-1)
    if shard.order is not None:  # the router names base experts; the stacks are reordered
        top_k_index = position_of(shard.order, top_k_index.device)[top_k_index]
    route = route_pairs(top_k_index, top_k_weights, shard.experts)
    pairs = Dispatch.apply(hidden_states, route.perm, route.inverse, top_k)
    sent = _counts(route).view(shard.ranks, shard.local)  # rows per (rank, its expert)
    got = _exchange_counts(sent, shard.group)
    sends, gets = sent.sum(1).tolist(), got.sum(1).tolist()
    _count_moved(self, shard.rank, sends, gets)
    rows = _a2a(pairs, gets, sends, shard.group)
    back = _local_experts(self, rows, got, shard.part)
    out = _a2a(back, sends, gets, shard.group)
    out = out * route.weights.unsqueeze(-1)
    summed = Combine.apply(out, route.perm, route.inverse, top_k)
    return summed.view(num_tokens, hidden_dim).to(hidden_states.dtype)


def position_of(order: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[E]: where each base expert sits in stacks laid out in `order`."""
    slots = torch.empty(len(order), dtype=torch.long, device=device)
    slots[torch.tensor(order, device=device)] = torch.arange(len(order), device=device)
    return slots


def _counts(route: Routing) -> torch.Tensor:
    """Rows per expert, from the routing's group ends."""
    ends = route.offsets.long()
    return torch.diff(ends, prepend=ends.new_zeros(1))


def _count_moved(experts: Any, rank: int, sends: list[int], gets: list[int]) -> None:
    """What the summary reports: rows that really left for (and came from) other ranks."""
    moved = experts.__dict__.setdefault(_MOVED, [0, 0])
    moved[0] += sum(sends) - sends[rank]
    moved[1] += sum(gets) - gets[rank]


def ep_report(model: nn.Module) -> dict[str, Any] | None:
    """This rank's expert placement and the rows its exchanges moved (None: no ep)."""
    sharded = [m for m in model.modules() if _SHARD in m.__dict__]
    if not sharded:
        return None
    shard: ExpertShard = sharded[0].__dict__[_SHARD]
    moved = [m.__dict__.get(_MOVED, [0, 0]) for m in sharded]
    return {
        "ranks": shard.ranks,
        "experts": shard.experts,
        "experts_per_rank": shard.local,
        "first_expert": shard.part.start,
        "placement": "contiguous" if shard.order is None else "balanced",
        "layers": len(sharded),
        "held_expert_params": sum(p.numel() for m in sharded for p in m.parameters(False)),
        "held_expert_lora_params": _held_lora(model, sharded),  # E/N experts' (ep_lora.py)
        "rows_sent": sum(m[0] for m in moved),
        "rows_received": sum(m[1] for m in moved),
        **_base(model).__dict__.get(READ, {}),  # loaded partitioned: the bytes it read
    }


def _held_lora(model: nn.Module, sharded: list[Any]) -> int:
    """Elements of the LoRA factors on the sharded experts this rank holds."""
    mine = {id(m) for m in sharded}
    wrappers = [w for w in model.modules() if isinstance(w, ParamWrapper)]
    held = [w for w in wrappers if id(w.get_base_layer()) in mine]
    return sum(p.numel() for w in held for p in (*w.lora_A.parameters(), *w.lora_B.parameters()))


def _base(model: nn.Module) -> Any:
    """transformers' model under a peft model (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _exchange_counts(sent: torch.Tensor, group: Any) -> torch.Tensor:
    """[ranks, local] rows each rank sends me for each of my experts (from [ranks, local]
    rows I send each rank for each of its experts)."""
    got = torch.empty_like(sent)
    dist.all_to_all_single(got.view(-1), sent.reshape(-1).contiguous(), group=group)
    return got


def _a2a(rows: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> Any:
    """Rows to the ranks `in_splits` says, from the ranks `out_splits` says (autograd-aware)."""
    moved = funcol.all_to_all_single_autograd(rows.contiguous(), out_splits, in_splits, group)
    return funcol.wait_tensor(moved)  # before autograd sees it: the exchange has landed


def _local_experts(experts: Any, rows: torch.Tensor, got: torch.Tensor, part: slice) -> Any:
    """Received rows (by source rank, then by my expert) through my experts, in that order."""
    if rows.shape[0] == 0:  # none came: still an output of `rows`, so backward runs both
        return rows * 0  # exchanges here too, as every other rank's backward does
    local = got.shape[1]
    ids = torch.repeat_interleave(torch.arange(local, device=got.device).repeat(got.shape[0]),
                                  got.reshape(-1))  # fmt: skip
    ids, order = torch.sort(ids, stable=True)  # stable: each expert's rows keep their order
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    offsets = torch.cumsum(got.sum(0), dim=0, dtype=torch.int32)
    route = Routing(ids, order, inverse, offsets, rows.new_empty(0))
    x = Dispatch.apply(rows, order, inverse, 1)
    h = _project(experts, "gate_up_proj" if experts.has_gate else "up_proj", x, route, part)
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    out = _project(experts, "down_proj", h, route, part)
    if experts.has_post_expert_norm:
        out = experts.post_expert_norm(out)
    return Combine.apply(out, order, inverse, 1)


def register() -> None:
    """Register "moetune_ep" in transformers' experts interface (idempotent)."""
    ExpertsInterface.register(IMPLEMENTATION, ep_experts_forward)


def ep_mesh(device_type: str) -> Any:
    """A 1-D DeviceMesh named "ep" over every rank, on a process group of its own: the
    token exchanges never queue behind (or between) DDP's gradient all-reduces, which run
    on the default group. Every rank must call it, in the same order."""
    # lazy: heavy to import (torch.distributed's mesh pulls DTensor)
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.new_group(list(range(dist.get_world_size())))
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(MESH_DIM,))


def shard_experts(model: nn.Module, mesh: Any) -> list[str]:
    """Keep this rank's experts of every fused experts module and switch the model to
    "moetune_ep"; returns the names of the sliced parameters (DDP ignores them)."""
    base = _base(model)
    group, ranks = mesh.get_group(MESH_DIM), mesh.size(0)
    rank = dist.get_rank(group)
    sharded: list[Any] = [m for m in model.modules() if is_fused_experts(m)]
    if not sharded:
        raise EngineError("the model has no fused routed experts to place.",
                          "use train.strategy ddp or fsdp for a dense model.")  # fmt: skip
    for experts in sharded:
        check_divides(experts.num_experts, ranks)
        shard = ExpertShard(group, ranks, rank, experts.num_experts)
        _slice(experts, shard)
        experts.__dict__[_SHARD] = shard
    register()
    base.set_experts_implementation(IMPLEMENTATION)
    ids = {id(p) for m in sharded for p in m.parameters(recurse=False)}
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    names += _stored_tensors(model)
    model.__dict__[_IGNORE] = sorted({*model.__dict__.get(_IGNORE, []), *names})
    return names


def placed_stacks(model: nn.Module) -> list[nn.Parameter]:
    """The expert stacks (and biases) `shard_experts` placed: each rank's own experts, which
    a data-parallel wrapper must neither broadcast, shard nor reduce."""
    return [p for m in model.modules() if _SHARD in m.__dict__ for p in m.parameters(False)]


def _stored_tensors(model: nn.Module) -> list[str]:
    """Every quantised stack's buffers (this rank's experts, or a stored Linear's bytes that
    every rank read alike) and a stored Linear's zero-storage stand-in weight: frozen, so
    DDP's broadcast of rank 0's tensors would only overwrite a rank's experts (or fail on a
    stand-in, whose elements share one location)."""
    names = []
    for path, module in model.named_modules():
        if isinstance(module, QuantizedStack):
            names += [f"{path}.{n}" for n, _ in module.named_buffers(recurse=False)]
        elif isinstance(module, StoredLinear):
            names.append(f"{path}.weight")
    return names


def _slice(experts: nn.Module, shard: ExpertShard) -> None:
    """Replace each expert stack (and bias) by this rank's rows of it – read so by
    ep_load.load_partitioned, or cut here from the whole, which is freed."""
    loaded = experts.__dict__.pop(PART, {})
    _check_loaded(loaded, shard)
    quantized = _slice_quantized(experts, shard, loaded)
    streamed = offloaded_of(experts)  # train.offload: the store holds the rank's experts
    for name, ref in streamed.items():
        _check_held(name, ref.held, shard)
    for name in (*PROJECTIONS, *(f"{p}_bias" for p in PROJECTIONS)):
        if name in quantized or name in streamed:  # (reading a streamed one would fetch it)
            continue
        whole = getattr(experts, name, None)
        if not isinstance(whole, nn.Parameter):
            continue
        kept = loaded.get(name)
        if kept is None:
            kept = whole.data[shard.part].clone()  # own storage: the whole stack can go
        setattr(experts, name, nn.Parameter(kept, requires_grad=whole.requires_grad))


def _check_loaded(loaded: dict[str, Any], shard: ExpertShard) -> None:
    """Every stack ep_load.py read (float or quantised) holds this rank's E/N experts."""
    for name, kept in loaded.items():
        _check_held(name, kept.shape[0], shard)


def _check_held(name: str, held: int, shard: ExpertShard) -> None:
    """A stack loaded for another world (its part of another size) is refused."""
    if held != shard.local:
        raise EngineError(
            f"{name} was loaded with {held} experts a rank, and {shard.ranks} "
            f"ranks hold {shard.local} each",
            "load the base with the world that trains it (train.nproc)",
        )


def _slice_quantized(experts: nn.Module, shard: ExpertShard, loaded: dict[str, Any]) -> set[str]:
    """Each quantised / stored stack (engine/quant, engine/stored) down to this rank's experts:
    read so by ep_load.py (installed here in place of its stand-in) or cut here from the
    whole, every buffer by its leading expert dim. Returns the stacks' names."""
    parts = {n: s for n, s in loaded.items() if isinstance(s, QuantizedStack)}
    for name, stack in parts.items():
        experts._parameters.pop(name, None)  # its full-shape stand-in
        experts.get_submodule(QUANTIZED).add_module(name, stack)
    for name, stack in stacks_of(experts).items():
        if name not in parts:  # loaded whole: this rank's rows, the rest freed
            for buf, tensor in list(stack.named_buffers(recurse=False)):
                stack.register_buffer(buf, tensor[shard.part].clone())
            stack.shape = (shard.local, stack.shape[1], stack.shape[2])
    return set(stacks_of(experts))


register()
