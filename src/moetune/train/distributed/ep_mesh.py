"""Expert parallelism with FSDP2 (`train.ep_degree`): a 2-D DeviceMesh, torch's own pieces.

`init_device_mesh` lays the N ranks out as ("dp_shard", "ep") = (N / ep_degree, ep_degree):

* "ep" – ep_degree consecutive ranks form one expert group: they split the routed experts
  E/ep_degree a rank and exchange tokens among themselves (engine/expert_parallel.py runs on
  the mesh's "ep" dimension, each group on its own process group). The N / ep_degree groups
  hold the same experts: the "dp_shard" dimension replicates the frozen stacks.
* every other parameter – attention, dense MLPs, shared experts, embeddings, norms, and all
  the LoRA factors (the experts' too: they stay whole, as under DDP) – is FSDP2-sharded
  (`fully_shard`) over the whole mesh flattened, one FSDP unit per decoder layer and one for
  the root, as torchtitan shards a MoE's non-expert weights over its dp_shard × ep ranks
  (ep borrows its ranks from the data-parallel dimension there too). So each rank holds 1/N
  of them; their gradients are reduce-scattered over all N ranks.

The frozen expert stacks are `ignored_params` of every unit: they differ between the ranks
of a group, so FSDP must neither shard nor reduce them. FSDP2 averages each gradient over
the N ranks, as DDP does, and a rank's expert LoRA gradient is nonzero only on the experts
it holds; the average is (1/N)·Σ_ranks – one process's gradient on the global batch. The
ranks of two groups that hold the same expert both contribute their own tokens' share.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import nn

from moetune.config.ep_split import check_divides, check_groups
from moetune.train.distributed.ep_unused import track_reached
from moetune.train.errors import TrainError

DP_DIM = "dp_shard"  # the mesh dimension that replicates the experts (and shards the rest)
EP_DIM = "ep"  # = engine.expert_parallel.MESH_DIM, checked in ep_fsdp_mesh
FLAT_DIM = "dp_shard_ep"  # both flattened: the ranks the rest is sharded over
UNUSED = "set_reduce_scatter_unused_params"  # FSDP2: zeros for parameters with no gradient


def ep_fsdp_mesh(device_type: str, ep_degree: int) -> Any:
    """The ("dp_shard", "ep") mesh over every rank. Every rank must call it, in order."""
    # lazy: heavy to import (torch.distributed's mesh pulls DTensor; moetune's engine pulls
    # transformers)
    from torch.distributed.device_mesh import init_device_mesh

    from moetune.engine.expert_parallel import MESH_DIM

    assert MESH_DIM == EP_DIM  # the engine exchanges tokens on this dimension's groups
    world = dist.get_world_size()
    check_ep_degree(ep_degree, world, None)
    shape = (world // ep_degree, ep_degree)
    return init_device_mesh(device_type, shape, mesh_dim_names=(DP_DIM, EP_DIM))


def check_ep_degree(ep_degree: int, world: int, experts: int | None) -> None:
    """ep_degree ranks a group: it must divide the world (whole groups) and E (whole experts
    a rank; config/ep_split.py decides both, as the plan does), and FSDP2 must reduce-scatter
    unused gradients (`shard_rest`); one line each."""
    # lazy: heavy to import (FSDP2 pulls DTensor)
    from torch.distributed.fsdp import FSDPModule

    if not hasattr(FSDPModule, UNUSED):
        raise TrainError(
            f"train.ep_degree needs FSDP2's {UNUSED}, which this torch lacks (a rank whose "
            "experts no token reaches would leave the others waiting in the reduce-scatter)",
            "upgrade torch (pip install -U torch), or leave train.ep_degree unset",
        )
    check_groups(ep_degree, world)
    if experts is not None:
        check_divides(experts, ep_degree, world)


def shard_rest(model: nn.Module, mesh: Any, layers: Iterable[nn.Module]) -> int:
    """FSDP2 over the flattened mesh for everything but the placed expert stacks: one unit
    per decoder layer in `layers`, then the root. Returns how many stack Parameters it left
    to their expert groups. Call after `shard_experts` (it replaces the stacks)."""
    # lazy: heavy to import (FSDP2 pulls DTensor)
    from torch.distributed.fsdp import fully_shard

    from moetune.engine.expert_parallel import placed_stacks

    # torch names no public flatten yet; torchtitan builds its dp_shard_cp mesh the same way
    flat = mesh[(DP_DIM, EP_DIM)]._flatten(FLAT_DIM)
    ignored, units = set(placed_stacks(model)), [*layers, model]
    for unit in units:
        fully_shard(unit, mesh=flat, ignored_params=ignored)
    # a rank whose experts no row reached (or expert selection left out) has no gradient on
    # their LoRA, and every rank must join the same reduce-scatter: FSDP2 puts a zero in
    # for it – what one process's gradient holds for those experts
    getattr(model, UNUSED)(True)
    track_reached(model, units)  # and no rank's backward reached: None again (ep_unused.py)
    return len(ignored)
