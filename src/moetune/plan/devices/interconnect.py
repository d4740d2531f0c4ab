"""The links expert parallelism's all-to-all crosses: GPU to GPU inside a node, and node to
node. Peak rates per direction, decimal GB/s, from the vendors' datasheets and reference
systems (docs/plan.md, "Expert parallelism's step time"):

- NVLink per GPU: H100 / H200 SXM 900 GB/s total = 450 per direction (NVLink 4), B200 and
  GB200 1.8 TB/s = 900 (NVLink 5), V100 SXM2 300 GB/s = 150 (NVLink 2). Cards without an
  NVLink switch among 8 (PCIe boards – H100 NVL and A100 PCIe pair only through bridges,
  L40S, the GeForce and RTX cards) exchange over their PCIe host link (cards.json `links`).
- Between nodes, one NIC per GPU in NVIDIA's reference systems: DGX H100 / H200 / B200 (and
  the GB200 trays) 8× ConnectX-7 400 Gb/s InfiniBand NDR = 50 GB/s per GPU; DGX A100 8×
  ConnectX-6 200 Gb/s HDR = 25 GB/s per GPU. Any other node: one 100 Gb/s Ethernet port
  (12.5 GB/s) shared by its GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetune.plan.hardware import Card

NVLINK = {  # card id -> (link, GB/s per direction)
    "H100-80GB": ("NVLink 4", 450.0),
    "H200": ("NVLink 4", 450.0),
    "B200": ("NVLink 5", 900.0),
    "GB200": ("NVLink 5", 900.0),
    "V100-32GB": ("NVLink 2", 150.0),
    "V100-16GB": ("NVLink 2", 150.0),
}
NIC_PER_GPU = {  # card id -> (link, GB/s per GPU per direction)
    "H100-80GB": ("InfiniBand NDR 400 Gb/s per GPU", 50.0),
    "H200": ("InfiniBand NDR 400 Gb/s per GPU", 50.0),
    "B200": ("InfiniBand NDR 400 Gb/s per GPU", 50.0),
    "GB200": ("InfiniBand NDR 400 Gb/s per GPU", 50.0),
    "A100-80GB": ("InfiniBand HDR 200 Gb/s per GPU", 25.0),
    "A100-40GB": ("InfiniBand HDR 200 Gb/s per GPU", 25.0),
}
NODE_ETHERNET_GB_S = 12.5  # one 100 Gb/s port per node, shared by its GPUs


@dataclass(frozen=True)
class Link:
    """One link a rank's exchange crosses, at its rate per rank and direction."""

    name: str
    gb_per_s: float  # decimal GB/s available to one rank

    @property
    def bytes_per_s(self) -> float:
        return self.gb_per_s * 1e9

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "gb_per_s": self.gb_per_s}


def gpu_link(card: Card, gpus_per_node: int) -> Link:
    """GPU to GPU inside a node: NVLink where the card has it among 8, else its host link
    (peer-to-peer over PCIe). A unified-memory machine is one device: several of them are
    several machines, on the network."""
    if card.id in NVLINK:
        name, rate = NVLINK[card.id]
        return Link(name, rate)
    if card.host_link is not None:
        return Link(card.host_link.name, card.host_link.gb_per_s)
    return node_link(card, gpus_per_node)


def node_link(card: Card, gpus_per_node: int) -> Link:
    """Node to node, per rank: the reference system's NIC per GPU, else a shared 100 GbE."""
    if card.id in NIC_PER_GPU:
        name, rate = NIC_PER_GPU[card.id]
        return Link(name, rate)
    share = NODE_ETHERNET_GB_S / max(1, gpus_per_node)
    return Link(f"100 Gb/s Ethernet per node, shared by {gpus_per_node} GPU(s)", share)
