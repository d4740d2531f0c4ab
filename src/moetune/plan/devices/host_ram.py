"""Host RAM a sharded run's load needs on one node (`plan --gpus N --strategy …`,
`devices.host_ram`; train's DIST-HOST-RAM check): how each strategy builds the base on its
ranks, per rank and per node, the runtime of each rank included."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.units import human_bytes

if TYPE_CHECKING:
    from moetune.plan.devices.sizes import Sizes

# one rank's host RAM besides the model: python, torch, transformers, peft, trl, the data
# and gloo – measured 0.51–0.53 GiB peak RSS per rank of a 2-process FSDP run of a 31 KB
# model on CPU (benchmarks/sharded_load.py --smoke)
RUNTIME_HOST_BYTES = 560 * 2**20


@dataclass(frozen=True)
class HostRam:
    """Host RAM of a sharded run's load, per rank and per node (bytes, runtime included).
    fsdp, every experts dtype: rank 0 loads the base (int8 / NF4 stacks quantised as they
    stream, one float stack at a time) and broadcasts it into the shards, freeing each full
    tensor once sent; the others build it on meta (quantised stacks too) and hold their
    shard plus one module in flight, so the node holds about one base as the run holds it.
    zero3, a base from_pretrained reads (bf16 experts): built under zero.Init, so every
    rank holds its partition plus the module being scattered (rank 0 reads the checkpoint,
    mapped: page cache the kernel reclaims, not the process's); the node holds about one
    base. zero3 otherwise (int8 / NF4 stacks, a published quantised base, offloaded stacks):
    every rank builds the whole base before DeepSpeed partitions it. ep (bf16 experts): every
    rank reads its E/N experts' bytes and the rest whole, so the node holds the experts once
    and the rest once per rank."""

    strategy: str
    ranks: int
    main_rank_bytes: int
    other_rank_bytes: int
    per_node_bytes: int
    how: str
    once_per_node: bool  # the node holds about one base (not `ranks` of them)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def host_ram(sizes: Sizes, gpus: int, strategy: str, world: int | None = None) -> HostRam:
    """The load's host RAM on one node of `gpus` ranks, of `world` over every node (default:
    this node's). `whole` is the base as the run holds it (quantised stacks at their stored
    bytes); in flight, the largest module in the weights' dtype: the float stack rank 0
    quantises, or the tensor being broadcast. ep splits the experts over the whole world."""
    whole = sizes.single.get("frozen_weights", 0) + sizes.single.get("trainable_weights", 0)
    run = RUNTIME_HOST_BYTES
    if strategy == "fsdp":
        flight = sizes.largest_module * sizes.weight_bytes
        main, other = run + whole + flight, run + -(-whole // gpus) + flight
        node = gpus * (run + flight) + whole  # rank 0's remainder + every rank's shards
        how = "rank 0 loads the base, the others build it on meta and receive their shards"
        return HostRam(strategy, gpus, main, other, node, how, True)
    if strategy == "zero3" and sizes.zero3_partitioned:
        each = run + -(-whole // gpus) + sizes.largest_module * sizes.weight_bytes
        how = "every rank builds its partition under zero.Init, rank 0 reading the checkpoint"
        return HostRam(strategy, gpus, each, each, gpus * each, how, True)
    if strategy == "ep" and sizes.expert_weights:
        # engine/ep_load.py: each rank reads its E/N experts' bytes (E/ep_degree in groups:
        # train/model.py's _ep_rank), every other weight whole
        group = sizes.ep_degree or world or gpus
        each = run + whole - sizes.expert_weights + -(-sizes.expert_weights // group)
        share = f"E/{sizes.ep_degree} (its group's share)" if sizes.ep_degree else "E/N"
        how = f"every rank reads its {share} routed experts' bytes and the rest of the base whole"
        return HostRam(strategy, gpus, each, each, gpus * each, how, False)  # the rest: N×
    how = f"every rank builds the whole base before {strategy} shards it"
    return HostRam(strategy, gpus, run + whole, run + whole, gpus * (run + whole), how, False)


def load_notes(ram: HostRam | None) -> tuple[str, ...]:
    """What the node's host RAM must hold while the base loads (a wall of the node, not of
    the GPUs)."""
    if ram is None or ram.ranks == 1:
        return ()
    gpus = ram.ranks
    if ram.once_per_node:
        return (
            f"host RAM at load: {ram.how}: {_rank_peaks(ram)}; the node needs about "
            f"{human_bytes(ram.per_node_bytes)} (≈ one base, not {gpus}; plus the OS)",
        )
    whole = ram.main_rank_bytes - RUNTIME_HOST_BYTES
    return (
        f"host RAM at load: {ram.how}: the node needs about {gpus} × {human_bytes(whole)} = "
        f"{human_bytes(gpus * whole)} of RAM (plus the OS; fsdp, and zero3 with bf16 experts, "
        "load it once per node)",
    )


def _rank_peaks(ram: HostRam) -> str:
    main, other = human_bytes(ram.main_rank_bytes), human_bytes(ram.other_rank_bytes)
    if main == other:
        return f"each rank peaks at {main}"
    return f"rank 0 peaks at {main}, each other rank at {other}"
