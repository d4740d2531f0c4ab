"""The card catalog: what each accelerator offers a training run.

The data lives in `cards.json` beside this module (one documented entry per card, with
the source of its numbers in `notes`; the host links and the disk read rate the offload
plan streams at, each with its source in `_about`); this module only types and looks it
up. Extend by adding an entry there, not by code. One card is not in the catalog: "cpu",
this host, built from its RAM and measured rates when asked for (`plan.host`, registered
with `register_host_card`).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from moetune.config.base import CARD_MEMORY_GB
from moetune.errors import UnknownCardError

GiB = 1024**3
CardKind = Literal["cuda", "unified", "mps", "cpu"]


@dataclass(frozen=True)
class HostLink:
    """The link frozen weights cross between host RAM and a device, per direction."""

    id: str
    name: str
    gb_per_s: float  # decimal GB/s, as achieved by pinned host→device copies

    @property
    def bytes_per_s(self) -> float:
        return self.gb_per_s * 1e9

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "gb_per_s": self.gb_per_s}


@dataclass(frozen=True)
class HostRates:
    """What a CPU "card" (this host, `plan.host`) computes and reads at: measured by
    `moetune doctor --calibrate`, written by hand, or conservative defaults."""

    fp32_gflops: float  # achieved matmul GFLOP/s at a step's expert shapes, all threads
    bf16_gflops: float
    memcpy_gb_per_s: float  # a large RAM-to-RAM copy, decimal GB/s
    disk_read_gb_per_s: float  # O_DIRECT sequential read of the checkpoint's file system
    calibrated: bool  # False: defaults, not this host's figures
    source: str  # where the figures come from (a file, or "defaults")

    def gflops(self, precision_bytes: int) -> float:
        """The matmul rate at the compute dtype's width (2: bf16, else fp32)."""
        return self.bf16_gflops if precision_bytes == 2 else self.fp32_gflops

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Card:
    """One accelerator.

    `memory_bytes` is the capacity as marketed (NVIDIA's board "GB" is binary, so an
    "80GB" H100 is 80 GiB); `usable_bytes` is what PyTorch reports as total memory
    (driver reserve taken; Apple: the Metal working set; DGX Spark: the unified pool CUDA
    reports). Plans compare `required_bytes` (live peak + overhead) with `usable_bytes`.
    """

    id: str
    name: str
    kind: CardKind
    memory_bytes: int
    usable_bytes: int
    bf16_tflops: float
    runpod_gpu_type_id: str | None
    usd_per_hour: float | None
    notes: str
    host_link: HostLink | None = None  # None: unified memory (offloading frees nothing)
    host_ram_bytes: int | None = None  # RAM of the card's usual node (decimal GB in the json)
    gpus_per_node: int = 1
    rates: HostRates | None = None  # the CPU card's measured rates (GPU cards: None)
    bf16: bool = True  # False: Turing / Volta (T4, V100) compute in fp16
    fp16_tflops: float | None = None  # dense fp16 tensor peak (None: bf16_tflops)
    mem_gb_per_s: float | None = None  # memory bandwidth, datasheet, decimal GB/s
    assumed: str | None = None  # a card given by its memory: what the plan assumes of it

    @property
    def is_host(self) -> bool:
        """A CPU "card": device and host are one RAM, so its peak is the process's RSS."""
        return self.kind == "cpu"

    @property
    def compute_dtype(self) -> Literal["bf16", "fp16"]:
        """The half precision a run computes in here: fp16 where the card has no bf16."""
        return "bf16" if self.bf16 else "fp16"

    @property
    def tensor_tflops(self) -> float:
        """Dense tensor peak at `compute_dtype` (0: unknown, so no time is estimated)."""
        return self.bf16_tflops if self.bf16 else (self.fp16_tflops or 0.0)

    @property
    def is_cuda(self) -> bool:
        """DGX Spark is unified memory but still a CUDA device (context, cuBLAS, allocator)."""
        return self.kind in ("cuda", "unified")

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "kind": self.kind,
            "memory_bytes": self.memory_bytes,
            "usable_bytes": self.usable_bytes,
            "bf16_tflops": self.bf16_tflops,
            "runpod_gpu_type_id": self.runpod_gpu_type_id,
            "usd_per_hour": self.usd_per_hour,
            "notes": self.notes,
            "host_link": self.host_link.to_json() if self.host_link else None,
            "host_ram_bytes": self.host_ram_bytes,
            "gpus_per_node": self.gpus_per_node,
            "rates": self.rates.to_json() if self.rates else None,
            "bf16": self.bf16,
            "compute_dtype": self.compute_dtype,
            "fp16_tflops": self.fp16_tflops,
            "mem_gb_per_s": self.mem_gb_per_s,
            "assumed": self.assumed,
        }


def _card(entry: dict[str, Any]) -> Card:
    return Card(
        id=entry["id"],
        name=entry["name"],
        kind=entry["kind"],
        memory_bytes=int(entry["memory_gib"] * GiB),
        usable_bytes=int(entry["usable_gib"] * GiB),
        bf16_tflops=float(entry["bf16_tflops"] or 0.0),
        runpod_gpu_type_id=entry.get("runpod_gpu_type_id"),
        usd_per_hour=entry.get("usd_per_hour"),
        notes=entry.get("notes", ""),
        host_link=get_link(entry["host_link"]) if entry.get("host_link") else None,
        host_ram_bytes=int(entry["host_ram_gb"] * 1e9) if entry.get("host_ram_gb") else None,
        gpus_per_node=int(entry.get("gpus_per_node", 1)),
        bf16=bool(entry.get("bf16", True)),
        fp16_tflops=float(entry.get("fp16_tflops") or entry["bf16_tflops"]),
        mem_gb_per_s=entry.get("mem_gb_per_s"),
    )


@cache
def _data() -> dict[str, Any]:
    return dict(json.loads(resources.files("moetune.plan").joinpath("cards.json").read_text()))


@cache
def _catalog() -> dict[str, Card]:
    return {c.id: c for c in (_card(e) for e in _data()["cards"])}


def get_link(link_id: str) -> HostLink:
    """A host link of the catalog (`cards.json` `links`) by id, e.g. "pcie5-x16"."""
    entry = _data()["links"][link_id]
    return HostLink(link_id, entry["name"], float(entry["gb_per_s"]))


CPU_LINK = "host-memcpy"  # a CPU "device": the copy is RAM to RAM


def disk_read_bytes_per_s() -> float:
    """The read rate assumed for train.offload disk (cards.json `disk`, with its source)."""
    return float(_data()["disk"]["read_gb_per_s"]) * 1e9


# Cards built from this machine when asked for (plan.host registers "cpu"); the registry
# imports none of them, the package's __init__ does.
_HOST_CARDS: dict[str, Callable[[], Card]] = {}


def register_host_card(card_id: str, build: Callable[[], Card]) -> None:
    """Make `get_card(card_id)` build the card from this host on each call."""
    _HOST_CARDS[card_id] = build


def card_ids() -> list[str]:
    """Every card id, in catalog order (largest datacenter cards first)."""
    return list(_catalog())


def all_cards() -> list[Card]:
    return list(_catalog().values())


def get_card(card_id: str) -> Card:
    """The card with `card_id` (case-insensitive; "cpu": this host, `plan.host`; "24GB": an
    unlisted card by its memory, `card_by_memory`), or UnknownCardError naming near ids."""
    key = card_id.strip().lower()
    if key in _HOST_CARDS:
        return _HOST_CARDS[key]()
    if (gib_ := _memory_of(key)) is not None:
        return card_by_memory(check_card_memory(gib_, f"card {card_id!r}"))
    by_lower = {k.lower(): v for k, v in _catalog().items()}
    if (card := by_lower.get(key) or by_lower.get(re.sub(r"[\s_]+", "-", key))) is not None:
        return card
    near = difflib.get_close_matches(re.sub(r"[\s_]+", "-", key), list(by_lower), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(by_lower[n].id for n in near)}?)" if near else ""
    raise UnknownCardError(
        f"unknown card {card_id!r}{hint}",
        f"use one of: {', '.join([*card_ids(), *_HOST_CARDS])}; or give an unlisted card by "
        "its memory: --card 24GB (hardware.card_memory_gb: 24)",
    )


_MEMORY = re.compile(r"^(\d+(?:\.\d+)?)\s*gi?b$")


def _memory_of(key: str) -> float | None:
    """24 from "24gb" / "24 gib"; None for anything else."""
    match = _MEMORY.match(key)
    return float(match.group(1)) if match else None


def check_card_memory(gb: float, what: str) -> float:
    """`gb`, refused where no card has that much memory (CARD_MEMORY_GB)."""
    low, high = CARD_MEMORY_GB
    if not low <= gb <= high:
        raise UnknownCardError(
            f"{what} gives a card memory of {gb:g} GB, outside {low:g} to {high:,.0f} GB",
            "give the card's memory in GB as marketed (e.g. --card 24GB), or a catalog card",
        )
    return gb


BY_MEMORY_LIKE = "RTX-4090"  # an unlisted card's driver reserve is taken as this one's share


def card_by_memory(memory_gib: float) -> Card:
    """An unlisted CUDA card known only by its memory (marketed GB, binary as NVIDIA's are):
    usable at the RTX 4090's driver-reserve share (no ECC), bf16, a PCIe 4.0 x16 host link,
    and no TFLOPS or bandwidth – so its plans fit by memory and estimate no time or cost."""
    like = _catalog()[BY_MEMORY_LIKE]
    share = like.usable_bytes / like.memory_bytes
    name = f"{memory_gib:g}GB"
    return Card(
        id=name,
        name=f"an unlisted CUDA card with {name}",
        kind="cuda",
        memory_bytes=int(memory_gib * GiB),
        usable_bytes=int(memory_gib * GiB * share),
        bf16_tflops=0.0,
        runpod_gpu_type_id=None,
        usd_per_hour=None,
        notes="given by its memory",
        host_link=get_link("pcie4-x16"),
        assumed=f"{name} card: usable {share:.1%} of it (an {BY_MEMORY_LIKE}'s driver reserve; "
        "ECC cards keep less), bf16, a PCIe 4.0 x16 host link; no TFLOPS or bandwidth, so no "
        "time or cost estimate",
    )


# What torch.cuda.get_device_name() reports for cards whose name is not their RunPod id (or
# that have none); every other card is named by its runpod_gpu_type_id, which is torch's name.
_DEVICE_NAMES = {
    "NVIDIA A100-SXM4-40GB": "A100-40GB",
    "NVIDIA A100-PCIE-40GB": "A100-40GB",
    "NVIDIA GB10": "DGX-Spark",
    "NVIDIA GH200 480GB": "GH200-96GB",
    "NVIDIA GeForce RTX 4080": "RTX-4080",
    "NVIDIA GeForce RTX 4070 Ti": "RTX-4070-Ti",
    "NVIDIA A10G": "A10G",
    "Tesla T4": "T4",
    "Tesla V100-SXM2-16GB": "V100-16GB",
    "Tesla V100-SXM2-32GB": "V100-32GB",
}


def card_for_device(device_name: str | None) -> str | None:
    """The catalog id of the device torch names `device_name` ("NVIDIA H200" -> "H200");
    None for "cpu" and any device the catalog does not hold (never a near guess: a rate
    measured on one card must not size a run on another)."""
    names = {c.runpod_gpu_type_id: c.id for c in all_cards() if c.runpod_gpu_type_id}
    by_lower = {k.lower(): v for k, v in {**names, **_DEVICE_NAMES}.items()}
    return by_lower.get(" ".join((device_name or "").split()).lower())


def local_card_ids() -> list[str]:
    """The card of each CUDA device torch sees here: its catalog id where torch's name is
    one, else the device by its memory ("16GB", rounded up from what torch reports, so the
    usable share is the estimate `card_by_memory` states). [] without CUDA."""
    # lazy: heavy to import (torch), and only a plan of this machine needs it
    import torch

    if not torch.cuda.is_available():
        return []
    props = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    return [card_for_device(p.name) or f"{math.ceil(p.total_memory / GiB)}GB" for p in props]
