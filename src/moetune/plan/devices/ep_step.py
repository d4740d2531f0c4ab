"""Step time under expert parallelism (`plan --gpus G --nodes M --strategy ep`): each rank's
compute plus its all-to-all exchanges over the links they cross.

Compute: the rank's tokens per optimizer step (micro-batch × grad_accum) at the training
FLOPs per token (plan.cost.estimate: 4·N_active, 6·N_active with the checkpointed recompute)
on the card's dense tensor peak at the calibrated MFU – the same figure a one-device step
gets, since every rank runs its own micro-batch through its share of the experts.

All-to-all, as moetune's ep runs it (engine/expert_parallel.py): in every MoE layer a
micro-batch is dispatched to its experts' ranks and combined back (2 exchanges), the backward
sends the gradients the same ways (2 more) and the checkpointed recompute repeats the
forward's (2 more). Each exchange moves top-k hidden states per token in the weights' dtype.
Routing assumed balanced (EP_SKEW): a rank sends 1/N of its token copies to each rank (its
own share stays put), so (G-1)/N of them cross the node's GPU link and (N-G)/N the
inter-node network, at the same time. moetune waits for each exchange before computing on it
(no overlap), so the step is compute + exchanges. The links' figures are their peak rates
per direction (plan/devices/interconnect.py): the exchange times are a floor.

With train.ep_degree the exchanges stay within a group of ep_degree consecutive ranks
(train/distributed/ep_mesh.py): a rank sends 1/ep_degree of its copies to each group peer,
so a group inside one node crosses no network at all. FSDP2's all-gathers and
reduce-scatters of the rest (over every rank) are not counted here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from moetune.config import RunConfig
from moetune.model.spec import ModelSpec
from moetune.plan.cost.estimate import MFU, flops_per_token
from moetune.plan.devices.interconnect import Link, gpu_link, node_link
from moetune.plan.hardware import Card
from moetune.plan.step import DTYPE_BYTES

FORWARD_EXCHANGES = 2  # dispatch and combine
RECOMPUTE_EXCHANGES = 2  # the checkpointed recompute's forward again


@dataclass(frozen=True)
class EpStepTime:
    """One rank's step on `nodes` × `gpus_per_node` cards: compute and all-to-all seconds."""

    card: str
    nodes: int
    gpus_per_node: int
    tokens: int  # this rank's tokens per optimizer step
    exchanges: int  # all-to-all exchanges per step (every MoE layer, every micro-batch)
    copy_bytes: int  # one exchange: this rank's token copies (top-k hidden states), all ranks
    intra_node_bytes: int  # per step, to peers on this rank's node
    inter_node_bytes: int  # per step, to peers on other nodes
    gpu_link: Link
    node_link: Link | None  # None on one node
    compute_s: float | None  # None: the card has no tensor peak in the catalog
    group: int = 0  # ranks one all-to-all spans (train.ep_degree; 0: every rank)

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def all_to_all_s(self) -> float:
        """Both links carry their share at once: the slower one sets the time."""
        intra = self.intra_node_bytes / self.gpu_link.bytes_per_s
        inter = self.inter_node_bytes / self.node_link.bytes_per_s if self.node_link else 0.0
        return max(intra, inter)

    @property
    def step_s(self) -> float | None:
        return None if self.compute_s is None else self.compute_s + self.all_to_all_s

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["gpu_link"], out["node_link"] = self.gpu_link.to_json(), None
        if self.node_link:
            out["node_link"] = self.node_link.to_json()
        return {**out, "ranks": self.ranks, "all_to_all_s": self.all_to_all_s,
                "step_s": self.step_s, "skew_assumed": "balanced"}  # fmt: skip

    def describe(self) -> str:
        moved = self.intra_node_bytes + self.inter_node_bytes
        where = f"{self.gpu_link.name}" + (f" and {self.node_link.name}" if self.node_link else "")
        compute = "unknown" if self.compute_s is None else f"{self.compute_s * 1e3:.0f} ms"
        where_ran = f"{self.nodes} node(s) × {self.gpus_per_node}"
        where_ran += f", groups of {self.group}" if self.group else ""
        return (
            f"ep step on {self.card} ({where_ran}): compute "
            f"{compute} + all-to-all {self.all_to_all_s * 1e3:.0f} ms – {moved / 1e9:.2f} GB "
            f"per rank per step over {where} ({self.inter_node_bytes / 1e9:.2f} GB of it "
            "between nodes; balanced routing, peak link rates, no overlap)"
        )


def exchanges_per_step(spec: ModelSpec, cfg: RunConfig) -> int:
    """All-to-all exchanges one rank runs per optimizer step."""
    per_layer = 2 * FORWARD_EXCHANGES  # forward + backward
    if cfg.train.gradient_checkpointing:
        per_layer += RECOMPUTE_EXCHANGES
    return per_layer * len(spec.moe_layers) * cfg.train.grad_accum


def ep_step_time(
    spec: ModelSpec, cfg: RunConfig, card: Card, gpus_per_node: int, nodes: int = 1
) -> EpStepTime:
    """One rank's step with the routed experts over `nodes` × `gpus_per_node` cards (each
    all-to-all within a group of train.ep_degree consecutive ranks, where set)."""
    t = cfg.train
    ranks = min(nodes * gpus_per_node, t.ep_degree or nodes * gpus_per_node)  # one exchange's
    local = min(ranks, gpus_per_node)  # of them on this rank's node
    micro = t.seq_len * t.batch_size
    copy = micro * spec.top_k * spec.hidden_size * DTYPE_BYTES[cfg.model.dtype]
    n = exchanges_per_step(spec, cfg)
    tokens = micro * t.grad_accum
    peak = card.tensor_tflops * 1e12 * MFU
    network = node_link(card, gpus_per_node) if ranks > local else None
    flops = tokens * flops_per_token(spec.active_params, t.gradient_checkpointing)
    return EpStepTime(
        card=card.id, nodes=nodes, gpus_per_node=gpus_per_node, tokens=tokens, exchanges=n,
        copy_bytes=copy,
        intra_node_bytes=n * copy * (local - 1) // ranks,
        inter_node_bytes=n * copy * (ranks - local) // ranks,
        gpu_link=gpu_link(card, gpus_per_node), node_link=network,
        compute_s=flops / peak if peak else None, group=t.ep_degree or 0,
    )  # fmt: skip
