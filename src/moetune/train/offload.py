"""train.offload (cpu | disk) in a run: refused up front where it cannot work, the base
loaded with its expert stacks in an ExpertStore (engine/offload/store.py), and what the store
measured written to offload.json.

The offloaded weights are the base's own (or its quantised copy): a checkpoint holds the
adapter only, so --resume needs nothing new.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from moetune.config import RunConfig
from moetune.config.keys import offload_mode, splits
from moetune.io import atomic_write_json
from moetune.model.fixes.registry import apply_fixes
from moetune.model.weight_files import checkpoint_files
from moetune.train.distributed.nodes import check_one_process
from moetune.train.errors import TrainError
from moetune.units import human_bytes

if TYPE_CHECKING:
    from torch import nn

    from moetune.engine.offload.store import Mode
    from moetune.train.rundir.checkpoint import RunDir
    from moetune.train.setup import Placement

# experts_dtype -> scratch bytes per base byte, an upper bound (int8 + row scales, NF4 + absmax)
_SPILL_RATIO = {"int8": 0.55, "nf4": 0.32}
FILE = "offload.json"


def check_offload(cfg: RunConfig, engine: str, model_dir: str | None) -> None:
    """Refuse, before anything is written, what offload cannot do."""
    mode = cfg.train.offload
    if not offload_mode(mode).streams:
        return
    fix = "set train.offload: none"
    if cfg.model.is_gguf:
        raise TrainError("train.offload streams safetensors weights; a GGUF base has none",
                         f"train the original safetensors base, or {fix}")  # fmt: skip
    if not splits(engine):
        raise TrainError(
            f"train.offload={mode} streams expert stacks inside moetune's split-LoRA engine, "
            f"but this run resolves to lora.engine {engine}",
            f"set lora.engine: moetune (lora.targets with experts, a family it serves), or {fix}",
        )
    check_one_process(cfg)  # several ranks: under train.strategy ep only
    if model_dir is not None:
        _check_files(cfg, Path(model_dir))


def _check_files(cfg: RunConfig, model_dir: Path) -> None:
    files = checkpoint_files(model_dir)
    if not files:
        raise TrainError(
            f"train.offload={cfg.train.offload} reads the base's safetensors files; "
            f"{model_dir} has none",
            "save the base with save_pretrained, or set train.offload: none",
        )
    ratio = _SPILL_RATIO.get(cfg.model.experts_dtype)
    if not offload_mode(cfg.train.offload).on_disk or ratio is None:
        return
    need = int(ratio * sum(f.stat().st_size for f in files))
    target = Path(cfg.output.dir).resolve()
    while not target.exists():
        target = target.parent
    free = shutil.disk_usage(target).free
    if free < need:
        raise TrainError(
            f"offload disk with {cfg.model.experts_dtype} experts writes ~{need / 2**30:.1f} GiB "
            f"of quantised stacks under {cfg.output.dir}; only {free / 2**30:.1f} GiB are free",
            "free disk space, set train.offload: cpu, or model.experts_dtype: bf16",
        )


def local_dir(model_id: str) -> str | None:
    """The base's directory when it is local (a hub id is checked once downloaded)."""
    return model_id if os.path.isdir(model_id) else None


def load_offloaded_model(
    cfg: RunConfig, place: Placement, dtype: torch.dtype, model_dir: str, scratch: Path,
    stored: bool, part: tuple[int, int] | None = None,
) -> nn.Module:  # fmt: skip
    """The base with its expert stacks in host RAM or left in its files (`stored`: in the
    bytes of a base published quantised); `part`: (rank, ranks) of train.strategy ep – the
    store holds that rank's experts only, and its scratch is a directory of its own."""
    # lazy: heavy to import (moetune)
    from moetune.engine import IMPLEMENTATION, register
    from moetune.engine.offload.load import load_offloaded

    _check_files(cfg, Path(model_dir))
    device = place.device
    if part is not None:  # ranks of every node may share output.dir: nothing collides
        scratch = scratch / f"rank{os.environ.get('RANK', part[0])}"
        device = rank_device(device)
    scratch.mkdir(parents=True, exist_ok=True)
    model, _, report = load_offloaded(
        model_dir, cast("Mode", cfg.train.offload), device, dtype,
        experts_dtype=cfg.model.experts_dtype, double_quant=cfg.model.experts_double_quant,
        scratch_dir=scratch, stored=stored, part=part,
    )  # fmt: skip
    apply_fixes(model)
    register()  # offloaded stacks only stream through moetune's experts forward
    model.set_experts_implementation(IMPLEMENTATION)
    if report is not None:
        model.__dict__["_moetune_quant_report"] = report  # train/model.py writes quant.json
    return model


def rank_device(device: str) -> str:
    """The device a rank's store streams to: its own GPU (the launcher's LOCAL_RANK, the one
    accelerate gives the rank), never whichever one is current when the store is made."""
    if device != "cuda":
        return device
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}"


def write_offload_json(run: RunDir, model: nn.Module, save: bool = True) -> dict[str, Any] | None:
    """offload.json: the store's measurements over the run (peak device bytes of experts,
    bytes moved and read by phase), written where `save` (rank 0). Under train.strategy ep
    every rank calls it: its top level is rank 0's store, as one process's, and `ranks` holds
    every rank's (each streams its own experts), gathered on rank 0."""
    # lazy: heavy to import (moetune)
    from moetune.engine.offload.store import store_of

    store = store_of(model)
    if store is None:
        return None
    stats = store.stats.to_json()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        ranks: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(ranks, stats)
        stats["ranks"] = ranks
    if save:
        atomic_write_json(run.root / FILE, stats)
    return stats


# per train.offload mode, the counter of what a fetch brings in and its word: disk reads the
# files, cpu copies from host RAM (which bytes_read does not count)
_COUNTERS = {"disk": ("bytes_read", "read"), "cpu": ("bytes_moved", "copied")}


class StoreMeter:
    """Per optimizer step of an offloaded run, from the store's own counters: the bytes it
    read, the rate its reader read them at (bytes over its load time), and what bound the
    step – the share of the step the training thread waited on the store (`wait_s`)."""

    BOUND_SHARE = 0.5  # waiting more than half the step: reading bounds it

    def __init__(self, stats: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.stats, self.clock = stats, clock
        self.counter, self.verb = _COUNTERS.get(stats.mode, _COUNTERS["disk"])
        self._mark = self._now()

    def _now(self) -> tuple[float, int, float, float]:
        s = self.stats
        return self.clock(), int(sum(getattr(s, self.counter).values())), s.load_s, s.wait_s

    def step(self) -> dict[str, Any]:
        """The figures since the last call (the last optimizer step)."""
        now = self._now()
        seconds, read, load, wait = (a - b for a, b in zip(now, self._mark, strict=True))
        self._mark = now
        share = wait / seconds if seconds > 0 else 0.0
        return {
            "read_bytes": int(read),
            "read_bytes_per_s": read / load if load > 0 else 0.0,
            "wait_share": round(share, 3),
            "bound": "read" if share > self.BOUND_SHARE else "compute",
        }

    def totals(self) -> dict[str, Any]:
        """Since the run began: every metrics.jsonl row carries them (cumulative, so any two
        rows give the reads and the waiting between them)."""
        _, read, load, wait = self._now()
        return {f"offload_{self.counter}": read, "offload_load_s": round(load, 3),
                "offload_wait_s": round(wait, 3)}  # fmt: skip

    def line(self) -> str:
        """ "read 1.2 GiB at 310.0 MiB/s · read-bound (waited 62% of the step)"."""
        s = self.step()
        return (
            f"{self.verb} {human_bytes(s['read_bytes'])} at "
            f"{human_bytes(s['read_bytes_per_s'])}/s · "
            f"{s['bound']}-bound (waited {s['wait_share']:.0%} of the step)"
        )


def store_meter(model: nn.Module) -> StoreMeter | None:
    """The meter of an offloaded model's store; None without train.offload."""
    # lazy: heavy to import (moetune)
    from moetune.engine.offload.store import store_of

    store = store_of(model)
    return StoreMeter(store.stats) if store is not None else None
