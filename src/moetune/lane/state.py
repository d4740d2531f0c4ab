"""A launch's state, persisted after every phase so `moetune launch --resume RUN_ID` continues
where a crashed or killed controller stopped. Lives in <ledger dir>/lane/<run id>/."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moetune.io import atomic_write_json
from moetune.lane.providers.base import LaneError


@dataclass
class LaneState:
    run_id: str
    provider: str
    config_path: str  # the run.yaml launched (absolute)
    pod_name: str
    pod_id: str | None = None
    workdir: str | None = None  # the run's dir on the pod
    done: list[str] = field(default_factory=list)  # finished phases, in order
    banked: dict[str, Any] | None = None  # {"dir", "sha256"} once the adapter is safe here
    synced: str | None = None  # the newest checkpoint mirrored here from the pod
    verdict: str | None = None
    promoted: str | None = None
    spent_usd: float = 0.0  # pod spend recorded so far (all pods of this run)
    pid: int = field(default_factory=os.getpid)  # the controller holding the run
    finished: bool = False
    started: float = field(default_factory=time.time)
    next_step: str | None = None  # what to do after a failure, in words
    accept_thin_margin: bool = False  # --accept-thin-margin: every ledger row says so
    node_pods: list[str] = field(default_factory=list)  # nodes 1 … N-1's pod ids ("": none yet)
    node_spent: list[float] = field(default_factory=list)  # what each of those cost so far

    @staticmethod
    def root(ledger_path: str) -> Path:
        return Path(ledger_path).parent / "lane"

    def dir(self, ledger_path: str) -> Path:
        return self.root(ledger_path) / self.run_id

    def sync_dir(self, ledger_path: str) -> Path:
        """This machine's mirror of the pod's run dir (config, logs, committed checkpoints)."""
        return self.dir(ledger_path) / "run-sync"

    def save(self, ledger_path: str) -> None:
        atomic_write_json(self.dir(ledger_path) / "state.json", asdict(self))

    @classmethod
    def load(cls, ledger_path: str, run_id: str) -> LaneState:
        path = cls.root(ledger_path) / run_id / "state.json"
        if not path.is_file():
            known = sorted(p.parent.name for p in cls.root(ledger_path).glob("*/state.json"))
            raise LaneError(
                f"no launch state for run {run_id!r} in {path.parent.parent}",
                f"resume one of: {', '.join(known) or 'none recorded'}",
            )
        return cls(**json.loads(path.read_text(encoding="utf-8")))
