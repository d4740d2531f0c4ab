"""train.offload under train.strategy ep, planned per rank: each rank's ExpertStore holds its
own E/N experts (engine/offload/load.py's `part`) and streams them a layer at a time.
Under train.ep_placement balanced the store holds the rank's placed E/N experts instead
(`hold_experts`): every expert of a layer has the same bytes, so these figures are the same
under either placement (the busiest rank differs in rows, not in stored bytes).

Per rank, from the ep per-rank plan (plan/devices/sharding.py's "ep": its LoRA state 1/N,
DDP's buckets, the all-to-all buffers) with the routed stacks taken out of the frozen
weights: the device holds the rank's resident rest and `STREAMED_LAYERS` layers of its
experts' slice (the layer running and the one prefetched, as one process streams them).
Host RAM per node is the sum of its ranks' stores (offload cpu: each rank pins its own
slice of every layer) beside each rank's process; on disk, each rank reads 1/N of the
stacks' file bytes per pass, and spills its own quantised slice in a scratch directory of
its own. The card's link and disk rate are one process's (a rank has its own link; ranks
of a node share its disk, which the note states).
"""

from __future__ import annotations

import dataclasses

from moetune.config import RunConfig
from moetune.config.keys import offload_mode
from moetune.model.spec import ModelSpec
from moetune.plan.devices.sharding import per_rank_bytes
from moetune.plan.hardware import Card, get_card
from moetune.plan.host import CPU_CARD, as_run_on, cpu_card
from moetune.plan.offload.memory import (
    CUDA_HOST_BASELINE,
    STREAMED_LAYERS,
    OffloadPlan,
    offload_plans,
    plan_offload,
)
from moetune.plan.overhead import CPU_PROCESS_BASELINE, card_overhead


def plan_offload_of_run(spec: ModelSpec, cfg: RunConfig, card: Card | str | None) -> OffloadPlan:
    """The offload plan of the run as launched: one process's, or – several ranks, which the
    launcher allows under train.strategy ep only – one rank's (`plan_ep_offload`)."""
    ranks = cfg.train.nproc * cfg.train.nnodes
    if ranks == 1:
        return plan_offload(spec, cfg, card)
    return plan_ep_offload(spec, cfg, card, ranks, cfg.train.nproc)


def offload_plans_of_run(
    spec: ModelSpec, cfg: RunConfig, cards: list[str] | None
) -> dict[str, OffloadPlan]:
    """`plan --offload` per card (offload_plans' cards), per rank where the run has several."""
    plans = offload_plans(spec, cfg, cards)
    ranks = cfg.train.nproc * cfg.train.nnodes
    if ranks == 1:
        return plans
    return {k: plan_ep_offload(spec, cfg, None if k == CPU_CARD else k, ranks, cfg.train.nproc)
            for k in plans}  # fmt: skip


def plan_ep_offload(
    spec: ModelSpec, cfg: RunConfig, card: Card | str | None, ranks: int, per_node: int
) -> OffloadPlan:
    """One rank's offload plan of `ranks` under train.strategy ep (`per_node` of them on a
    node): device figures per rank, host RAM per node, disk and bytes moved per rank."""
    one = plan_offload(spec, cfg, card)  # one process on the card: its link, rate, notes
    host = one.card == CPU_CARD
    layer = -(-one.layer_expert_bytes // ranks)  # a rank's E/N experts of one layer
    offloaded = layer * len(spec.moe_layers)
    chosen = cpu_card() if host else card if isinstance(card, Card) else get_card(str(card))
    device = _device(spec, cfg, chosen, ranks, offloaded, layer)
    peak = sum(device.values())
    in_ram = offload_mode(cfg.train.offload).in_host_ram
    if host:  # one memory: each rank's process is its device
        pinned, need = (offloaded if in_ram else 0), peak
    else:
        pinned = offloaded if in_ram else STREAMED_LAYERS * layer
        need = pinned + CUDA_HOST_BASELINE
    moved = {k: -(-v // ranks) for k, v in one.bytes_moved_per_step.items()}
    transfer = one.transfer_s / ranks
    return dataclasses.replace(
        one, device_peak_bytes=peak, device_components=device, pinned_host_bytes=pinned,
        host_ram_bytes=per_node * need, disk_bytes=-(-one.disk_bytes // ranks),
        offloaded_bytes=offloaded, layer_expert_bytes=layer, bytes_moved_per_step=moved,
        transfer_s=transfer, balance_tokens=round(transfer / one.compute_s * one.tokens_per_step)
        if one.compute_s else one.balance_tokens,
        notes=(*one.notes, _note(ranks, per_node)),
    )  # fmt: skip


def _device(spec: ModelSpec, cfg: RunConfig, card: Card, ranks: int, offloaded: int,
            layer: int) -> dict[str, int]:  # fmt: skip
    """One rank's device bytes: ep's per-rank components, its experts streamed."""
    host = card.is_host
    parts = per_rank_bytes(spec, as_run_on(cfg, card), ranks, "ep")
    frozen = parts.pop("frozen_weights", 0)  # the rest replicated + its experts as held
    in_ram = offload_mode(cfg.train.offload).in_host_ram
    out = {
        "resident_weights": frozen if host and in_ram else frozen - offloaded,
        "streamed_experts": STREAMED_LAYERS * layer,
        **parts,
    }
    if host:
        return {**out, "process_baseline": CPU_PROCESS_BASELINE}
    return {**out, "overhead": card_overhead(card, sum(out.values())).total}


def _note(ranks: int, per_node: int) -> str:
    return (
        f"per rank of {ranks} under train.strategy ep: each rank's store holds its own "
        f"1/{ranks} of the experts; host RAM is per node ({per_node} ranks' stores and "
        "processes), disk and bytes moved per rank (a node's ranks share its disk)"
    )
