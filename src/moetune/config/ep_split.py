"""Which worlds `train.strategy ep` can split a model's routed experts over, decided once.

The plan (`plan --strategy ep`, plan/devices/sharding.py), the launcher (train/distributed/
ep_checks.py, ep_mesh.py) and the engine that places the experts (engine/expert_parallel.py,
ep_load.py, offload/load.py) all ask these questions; each is answered here, in one wording,
from plain integers (this floor sits below the model and the engine, and imports neither):

* the model has routed experts at all;
* train.ep_degree divides the ranks into whole expert groups;
* a group of ranks splits the experts E/N a rank, evenly, leaving no rank none (ep places
  E/N contiguous experts a rank; an uneven split is not built).
"""

from __future__ import annotations

from moetune.errors import ConfigError


def check_ep_split(name: str, experts: int | None, ranks: int, ep_degree: int | None) -> None:
    """Every check `--strategy ep` on `ranks` ranks makes of a model with `experts` routed
    experts (None or 0: a dense model), groups of `ep_degree` ranks (None: one group)."""
    check_routed(name, experts)
    assert experts  # check_routed refused None and 0
    if ep_degree is not None:
        check_groups(ep_degree, ranks)
    check_divides(experts, ep_degree or ranks, ranks if ep_degree is not None else None)


def check_routed(name: str, experts: int | None) -> None:
    """ep places routed experts: a dense model has none to place."""
    if not experts:
        raise ConfigError(
            f"train.strategy ep places routed experts, and {name} has none",
            "use train.strategy (plan: --strategy) ddp or fsdp for a dense model",
        )


def check_groups(ep_degree: int, ranks: int) -> None:
    """train.ep_degree ranks a group: whole groups only."""
    if ranks % ep_degree:
        fits = [n for n in range(1, min(ep_degree, ranks) + 1) if ranks % n == 0]
        raise ConfigError(
            f"train.ep_degree {ep_degree} does not divide the {ranks} ranks into expert groups",
            f"use train.ep_degree {fits[-1]} (a divisor of {ranks}), a multiple of "
            f"{ep_degree} ranks, or leave train.ep_degree unset (one group of all ranks)",
        )


def check_divides(experts: int, group: int, ranks: int | None = None) -> None:
    """E/N experts a rank over a `group` of ranks: refuse a split that is uneven or leaves
    a rank none. `ranks`: the whole world, where the group is train.ep_degree's (its
    divisors must divide the world too); None: the group is every rank."""
    what = "train.ep_degree" if ranks is not None else "train.nproc × train.nnodes"
    fits = [n for n in range(1, min(experts, group) + 1)
            if experts % n == 0 and (ranks is None or ranks % n == 0)]  # fmt: skip
    if ranks is None:
        fix = (f"use {fits[-1]} ranks (train.nproc × train.nnodes; plan: --gpus × --nodes), "
               f"a divisor of {experts}, or train.strategy fsdp")  # fmt: skip
    else:
        fix = f"use train.ep_degree {fits[-1]}, a divisor of both {experts} and {ranks}"
    if group > experts:
        raise ConfigError(
            f"{group} expert-parallel ranks for {experts} routed experts leave a rank none "
            f"({what})",
            fix,
        )
    if experts % group:
        raise ConfigError(
            f"{experts} routed experts do not split evenly over {group} ranks ({what}; ep "
            "places E/N contiguous experts a rank, an uneven split is not built)",
            fix,
        )
