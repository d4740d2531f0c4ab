"""The plan of the configuration that ran: the figure a run's measured peak is compared with.

The preflight's memory plan (`plan.make_plan`) is one device holding every weight. A run that
streams its frozen experts (train.offload) or splits the model over ranks (train.nproc)
holds something else, so summary.json, preflight.json, the closing line, the ledger row and
the report take their planned figure from here. Kinds, first that applies:

- ``offload`` – `plan.offload.plan_offload` for the run's card (under ep, one rank's:
  `plan.devices.ep_offload`). On a CUDA card the figure is the device's live tensors (its
  overhead apart), met by `torch.cuda.max_memory_allocated`;
  elsewhere the device is host RAM and the figure is all the process needs (device + host:
  resident weights, two streamed layers, the step, the process baseline), met by its peak RSS.
- ``per_rank`` – `plan.devices.sharding.per_rank_bytes`: one rank's share with train.strategy,
  met by this (the main) rank's own peak.
- ``memory`` – the preflight's memory plan itself (live tensors on one device).

Off CUDA the measured peak is the process RSS, so every kind's figure there is the process:
its tensors plus the measured process baseline (`plan.overhead.CPU_PROCESS_BASELINE`).

Quantised experts (model.experts_dtype) and a base kept as published are counted by the
plans themselves, given the run's config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moetune.config import RunConfig
from moetune.config.keys import offload_mode
from moetune.model.spec import ModelSpec
from moetune.plan.devices.ep_offload import plan_offload_of_run
from moetune.plan.devices.sharding import per_rank_bytes
from moetune.plan.hardware import Card, all_cards, card_for_device, get_card
from moetune.plan.overhead import CPU_PROCESS_BASELINE, overhead_for


@dataclass(frozen=True)
class RunPlan:
    """The planned peak of the run as configured, and what it is compared with."""

    kind: str  # offload | per_rank | memory
    label: str  # a few words for the closing line ("offload disk, host RAM as device")
    peak_bytes: int  # the planned figure the measured peak is compared with
    required_bytes: int | None  # with the card's overhead, where the plan states one
    compared: str  # what `peak_bytes` holds and which measured figure meets it
    components: dict[str, int]  # `peak_bytes` by component
    detail: dict[str, Any] = dataclasses.field(default_factory=dict)  # the source plan

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


Builder = Callable[[ModelSpec, RunConfig, str, Any], RunPlan | None]


def _offload(spec: ModelSpec, cfg: RunConfig, device: str, memory: Any) -> RunPlan | None:
    if not offload_mode(cfg.train.offload).streams:
        return None
    card = offload_card(cfg, device)
    plan = plan_offload_of_run(spec, cfg, card)  # several ranks (ep): one rank's store
    if card is None:  # one memory: the process is the device
        return RunPlan(
            "offload", f"offload {plan.offload}, host RAM as device", plan.device_peak_bytes,
            None, "the process's planned peak RSS (device = host RAM: resident weights, two "
            "streamed layers, the step's tensors, the process baseline) vs its measured peak "
            "RSS", dict(plan.device_components), plan.to_json(),
        )  # fmt: skip
    parts = {k: v for k, v in plan.device_components.items() if k != "overhead"}
    return RunPlan(
        "offload", f"offload {plan.offload}, {card.id}", sum(parts.values()),
        plan.device_peak_bytes, "live tensors on the device with the experts streamed "
        "(overhead apart) vs torch.cuda.max_memory_allocated", parts, plan.to_json(),
    )  # fmt: skip


def _per_rank(spec: ModelSpec, cfg: RunConfig, device: str, memory: Any) -> RunPlan | None:
    ranks = cfg.train.nproc * cfg.train.nnodes
    if ranks <= 1:
        return None
    parts = per_rank_bytes(spec, cfg, ranks, cfg.train.strategy)
    peak = sum(parts.values())
    required = peak + overhead_for("cuda", peak).total if device == "cuda" else None
    return RunPlan(
        "per_rank", f"per rank of {ranks}, {cfg.train.strategy}", peak, required,
        f"one rank's live tensors with {cfg.train.strategy} over {ranks} ranks vs the main "
        "rank's measured peak", parts,
        {"ranks": ranks, "strategy": cfg.train.strategy},
    )  # fmt: skip


def _memory(spec: ModelSpec, cfg: RunConfig, device: str, memory: Any) -> RunPlan | None:
    if memory is None:
        return None
    return RunPlan(
        "memory",
        "one device",
        memory.peak_bytes,
        memory.required_bytes,
        "live tensors on one device vs torch.cuda.max_memory_allocated",
        dict(memory.components),
        {"estimator": memory.estimator},
    )


def _as_process(plan: RunPlan, device: str) -> RunPlan:
    """Off CUDA the measured peak is the process's peak RSS, which holds the Python process
    (torch, transformers, TRL: ~600 MiB measured) besides the tensors: the figure compared
    with it is the tensors plus that baseline, like with like (without it a tiny model's run
    read "measured 5× planned"). The offload plan on host RAM counts it already."""
    if device == "cuda" or "process_baseline" in plan.components:
        return plan
    tensors = plan.compared.split(" vs ")[0]
    return dataclasses.replace(
        plan,
        peak_bytes=plan.peak_bytes + CPU_PROCESS_BASELINE,
        compared=f"the process's planned peak RSS ({tensors} + the measured process "
        "baseline) vs its measured peak RSS",
        components={**plan.components, "process_baseline": CPU_PROCESS_BASELINE},
    )


BUILDERS: tuple[Builder, ...] = (_offload, _per_rank, _memory)  # the first that applies


def plan_of_run(spec: ModelSpec, cfg: RunConfig, device: str, memory: Any) -> RunPlan | None:
    """The plan of `cfg` exactly as it runs on `device` (cuda | mps | cpu); `memory` is the
    preflight's MemoryPlan (None: none was made)."""
    plan = next((p for b in BUILDERS if (p := b(spec, cfg, device, memory)) is not None), None)
    return None if plan is None else _as_process(plan, device)


def offload_card(cfg: RunConfig, device: str) -> Card | None:
    """The card an offloaded run streams to: hardware.card, else the one torch names, else
    (a GPU the catalog lacks) the first with a host link – the live tensors it plans do not
    depend on which. None off CUDA: host RAM is the device."""
    if device != "cuda":
        return None
    named = cfg.hardware.card or card_for_device(torch.cuda.get_device_name())
    if named is not None:
        return get_card(named)
    return next(c for c in all_cards() if c.host_link is not None)
