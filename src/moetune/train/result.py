"""What a finished run produced: the trainer returns it, and a `--nproc` launch reads it
back from the ranks' summary.json (distributed.py), so both import it from here."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from moetune.config import RunConfig
from moetune.train.rundir.checkpoint import inspect_run


@dataclass(frozen=True)
class TrainResult:
    """What a finished run produced (summary.json's "result")."""

    run_dir: str
    adapter_dir: str
    steps: int
    final_loss: float | None
    coverage: float  # fraction of the requested LoRA targets adapted (the audit's)
    router_changed: bool
    seconds: float
    peak_memory_bytes: int  # measured: CUDA max allocated, else the process peak RSS
    planned_peak_bytes: int | None  # the plan of the configuration that ran (planned.py)
    aux_loss: bool = False
    method: str = "sft"  # train.method
    routing_shift: float | None = None  # grpo: mean rollout → training top-k set shift
    resumed_from_step: int | None = None
    errors_overridden: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # What the next launch sizes its training time from (plan/cost/estimate.py): the loop's
    # non-padding tokens (this attempt's, all processes) over its wall time, the device and
    # its catalog card (None when not in plan/cards.json), and the step it was measured on.
    tokens: int | None = None
    tokens_per_s: float | None = None
    loop_seconds: float | None = None
    device: str | None = None
    card: str | None = None
    signature: dict[str, Any] = field(default_factory=dict)
    # Which plan gave planned_peak_bytes ("offload disk, host RAM as device", "per rank of 2,
    # fsdp", "one device"): the closing line names it.
    planned_by: str | None = None
    # `--resume` of a run that had finished: this is its recorded result, nothing trained.
    already_complete: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TrainResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def finished_result(cfg: RunConfig) -> TrainResult | None:
    """`--resume` of a run that has finished (summary.json): its recorded result, where the
    run dir now is, marked `already_complete`; None when there is something left to train.
    Checked like any resume (the same config, or a refusal). Nothing is attempted, so no
    ledger row is appended: a second row would count one run twice."""
    run = inspect_run(cfg, True)
    if not run.finished:
        return None
    recorded = json.loads(run.summary.read_text(encoding="utf-8"))["result"]
    here = {"run_dir": str(run.root), "adapter_dir": str(run.adapter), "already_complete": True}
    return TrainResult.from_json({**recorded, **here})
