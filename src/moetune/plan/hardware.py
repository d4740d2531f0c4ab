"""The card catalog: what each accelerator offers a training run.

The data lives in `cards.json` beside this module (one documented entry per card, with
the source of its numbers in `notes`); this module only types and looks it up.
Extend by adding an entry there, not by code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Any, Literal

from moetune.errors import UnknownCardError

GiB = 1024**3
CardKind = Literal["cuda", "unified", "mps"]


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
        }


def _card(entry: dict[str, Any]) -> Card:
    return Card(
        id=entry["id"],
        name=entry["name"],
        kind=entry["kind"],
        memory_bytes=int(entry["memory_gib"] * GiB),
        usable_bytes=int(entry["usable_gib"] * GiB),
        bf16_tflops=float(entry["bf16_tflops"]),
        runpod_gpu_type_id=entry.get("runpod_gpu_type_id"),
        usd_per_hour=entry.get("usd_per_hour"),
        notes=entry.get("notes", ""),
    )


@cache
def _catalog() -> dict[str, Card]:
    text = resources.files("moetune.plan").joinpath("cards.json").read_text()
    cards = (_card(e) for e in json.loads(text)["cards"])
    return {c.id: c for c in cards}


def card_ids() -> list[str]:
    """Every card id, in catalog order (largest datacenter cards first)."""
    return list(_catalog())


def all_cards() -> list[Card]:
    return list(_catalog().values())


def get_card(card_id: str) -> Card:
    """The card with `card_id` (case-insensitive), or UnknownCardError listing the ids."""
    by_lower = {k.lower(): v for k, v in _catalog().items()}
    try:
        return by_lower[card_id.strip().lower()]
    except KeyError:
        raise UnknownCardError(
            f"unknown card {card_id!r}",
            f"use one of: {', '.join(card_ids())}",
        ) from None


# What torch.cuda.get_device_name() reports for cards whose name is not their RunPod id (or
# that have none); every other card is named by its runpod_gpu_type_id, which is torch's name.
_DEVICE_NAMES = {
    "NVIDIA A100-SXM4-40GB": "A100-40GB",
    "NVIDIA A100-PCIE-40GB": "A100-40GB",
    "NVIDIA GB10": "DGX-Spark",
}


def card_for_device(device_name: str | None) -> str | None:
    """The catalog id of the device torch names `device_name` ("NVIDIA H200" -> "H200");
    None for "cpu" and any device the catalog does not hold (never a near guess: a rate
    measured on one card must not size a run on another)."""
    names = {c.runpod_gpu_type_id: c.id for c in all_cards() if c.runpod_gpu_type_id}
    by_lower = {k.lower(): v for k, v in {**names, **_DEVICE_NAMES}.items()}
    return by_lower.get(" ".join((device_name or "").split()).lower())
