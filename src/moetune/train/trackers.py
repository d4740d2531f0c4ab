"""output.report_to: the run in the trackers people watch – TensorBoard, Weights & Biases,
MLflow, trackio – through transformers' own integrations (TrainingArguments.report_to).

moetune adds three things around them:

- a tracker whose package is missing stops the run before anything is built or written,
  naming the extra to install (`check_trackers`);
- each tracker's files go under the run dir, `<output.dir>/trackers/`, unless the user's own
  environment variable for it says otherwise (`tracker_env`): TensorBoard's logdir, the W&B
  dir, an MLflow file store, trackio's database – nothing lands in the working directory;
- moetune's own MoE metrics reach every integration, because `TrackerCallback` sends them
  through the trainer's log: per MoE layer the load entropy, top-1 share, dead experts and
  drift of the top-1 share from the base's own; GRPO's rollout → training routing shift; and
  the plan's predicted peak beside the measured one.

Keys (the integrations prefix them, TensorBoard and W&B with `train/`):

    moe/entropy/layer_N  moe/top1_share/layer_N  moe/dead_experts/layer_N
    moe/top1_drift/layer_N (top-1 share minus the base's)   moe/entropy_min  moe/dead_experts_total
    moe/routing_shift/layer_N  moe/routing_shift_mean        (grpo)
    moe/routing_shift_top1/layer_N  moe/routing_shift_top1_mean (grpo)
    memory/peak_bytes  memory/planned_peak_bytes  memory/measured_over_planned

No key is a prefix folder of another: MLflow's file store keeps each metric as a file.
Credentials (WANDB_API_KEY, MLFLOW_TRACKING_TOKEN, …) stay in the environment the tracker
reads them from; moetune never copies them into a file or a config.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

from transformers import TrainerCallback

from moetune.errors import clip
from moetune.io import write_problem
from moetune.registry import Registry
from moetune.train.callbacks import peak_memory
from moetune.train.errors import TrainError

if TYPE_CHECKING:
    from moetune.train.routing.recorder import LayerLoad

FOLDER = "trackers"  # under the run dir
EXTRA = "pip install 'moetune[trackers]'"


@dataclass(frozen=True)
class Tracker:
    """One transformers integration: the package it needs and the environment defaults
    that keep its files in `folder` (the run's trackers/ dir)."""

    name: str  # its report_to name in transformers
    package: str  # the module that must import
    env: Callable[[Path], dict[str, str]]
    finish: Callable[[bool], None] = lambda failed: None  # ends a run its integration leaves open
    folder_key: str = ""  # the variable naming the folder it writes (a file:// URI for MLflow)


def _finish_wandb(failed: bool) -> None:
    """transformers' W&B integration never ends its run; the next run in this process
    would log into it, and an offline run's files are complete only once it ends."""
    # lazy: heavy to import (wandb)
    import wandb

    if wandb.run is not None:
        wandb.finish(exit_code=1 if failed else 0)


TRACKERS: Registry[Tracker] = Registry("tracker", TrainError)
for _tracker in (
    Tracker("tensorboard", "tensorboard",
            lambda d: {"TENSORBOARD_LOGGING_DIR": str(d / "tensorboard")},
            folder_key="TENSORBOARD_LOGGING_DIR"),
    Tracker("wandb", "wandb", lambda d: {"WANDB_DIR": str(d), "WANDB_PROJECT": "moetune"},
            finish=_finish_wandb, folder_key="WANDB_DIR"),
    Tracker("mlflow", "mlflow", lambda d: {
        "MLFLOW_TRACKING_URI": (d / "mlruns").resolve().as_uri(),
        "MLFLOW_EXPERIMENT_NAME": "moetune",
        "MLFLOW_ALLOW_FILE_STORE": "true",  # MLflow 3.x: the file store only when opted in
    }, folder_key="MLFLOW_TRACKING_URI"),
    Tracker("trackio", "trackio", lambda d: {"TRACKIO_DIR": str(d / "trackio")},
            folder_key="TRACKIO_DIR"),
):  # fmt: skip
    TRACKERS.add(_tracker.name, _tracker)


def installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def check_trackers(names: Sequence[str]) -> None:
    """Every tracker in output.report_to can be imported – else one line naming the extra,
    before any model is built."""
    for name in names:
        package = TRACKERS.get(name).package
        if not installed(package):
            raise TrainError(
                f"output.report_to lists {name}, but its package {package!r} is not installed",
                f"{EXTRA} (or drop {name} from output.report_to)",
            )


def check_tracker_dirs(names: Sequence[str]) -> None:
    """A tracker folder the user's own variable names (TENSORBOARD_LOGGING_DIR …) can be
    made and written: one line before any model is built, not a traceback after (the
    default, under the run dir, is checked with the run dir)."""
    for name in names:
        key = TRACKERS.get(name).folder_key
        folder = _local_folder(os.environ.get(key, "")) if key else None
        problem = write_problem(folder, folder=True) if folder else None
        if problem:
            raise TrainError(
                f"{name} writes to {key}={clip(folder, 80)}, which {problem}",
                f"point {key} at a writable folder (or unset it: the run dir's trackers/)",
            )


def _local_folder(value: str) -> Path | None:
    """The folder a tracker variable names: a path, or a file:// URI (a server URI: None)."""
    if "://" not in value:
        return Path(value).expanduser() if value else None
    parsed = urlparse(value)
    return Path(unquote(parsed.path)) if parsed.scheme == "file" else None


def tracker_env(names: Sequence[str], root: Path) -> dict[str, str]:
    """The variables to set for these trackers: their defaults under `root`/trackers/,
    less those the user already set."""
    folder = root / FOLDER
    wanted = {k: v for name in names for k, v in TRACKERS.get(name).env(folder).items()}
    return {k: v for k, v in wanted.items() if k not in os.environ}


@contextlib.contextmanager
def tracking(names: Sequence[str], root: Path) -> Iterator[None]:
    """The trackers' environment while the trainer is built and trains; restored after,
    once every tracker's run is ended."""
    env = tracker_env(names, root)
    os.environ.update(env)
    failed = True
    try:
        yield
        failed = False
    finally:
        try:
            for name in names:
                TRACKERS.get(name).finish(failed)
        finally:
            for key in env:
                os.environ.pop(key, None)


# ---------------------------------------------------------------- the MoE metrics


def routing_metrics(layers: list[dict[str, Any]], base: dict[int, LayerLoad]) -> dict[str, float]:
    """A routing.jsonl record's layers as tracker scalars; drift where the base was measured."""
    out: dict[str, float] = {}
    for load in layers:
        n = load["layer"]
        out[f"moe/entropy/layer_{n}"] = load["entropy"]
        out[f"moe/top1_share/layer_{n}"] = load["top1_share"]
        out[f"moe/dead_experts/layer_{n}"] = len(load["dead_experts"])
        if n in base and base[n].tokens:
            out[f"moe/top1_drift/layer_{n}"] = round(load["top1_share"] - base[n].top1_share, 6)
    if layers:
        out["moe/entropy_min"] = min(load["entropy"] for load in layers)
        out["moe/dead_experts_total"] = sum(len(load["dead_experts"]) for load in layers)
    return out


def shift_metrics(row: dict[str, Any]) -> dict[str, float]:
    """A routing_shift.jsonl record as tracker scalars."""
    out = {f"moe/routing_shift/layer_{x['layer']}": x["shift"] for x in row["layers"]}
    top1 = {
        f"moe/routing_shift_top1/layer_{x['layer']}": x["top1_shift"]
        for x in row["layers"]
        if "top1_shift" in x
    }
    if "mean_top1_shift" in row:
        top1["moe/routing_shift_top1_mean"] = row["mean_top1_shift"]
    return {**out, **top1, "moe/routing_shift_mean": row["mean_shift"]}


def memory_metrics(planned: int | None) -> dict[str, float]:
    """The measured peak so far beside the plan's prediction for this run."""
    measured = peak_memory()[0]
    out: dict[str, float] = {"memory/peak_bytes": measured}
    if planned:
        out["memory/planned_peak_bytes"] = planned
        out["memory/measured_over_planned"] = round(measured / planned, 4)
    return out


class TrackerCallback(TrainerCallback):
    """Sends the MoE metrics of a step through `log` (the trainer's own log, so every
    report_to integration gets them): what `routing` / `shift` were handed this step, and
    the memory on logging steps. Add it after the callbacks that feed it."""

    def __init__(
        self,
        log: Callable[[dict[str, float]], None],
        base: Callable[[], dict[int, LayerLoad]],
        planned_peak: int | None,
    ) -> None:
        self.log, self.base, self.planned_peak = log, base, planned_peak
        self.pending: dict[str, float] = {}

    def routing(self, row: dict[str, Any]) -> None:
        self.pending.update(routing_metrics(row["layers"], self.base()))

    def shift(self, row: dict[str, Any]) -> None:
        self.pending.update(shift_metrics(row))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        logging_step = step % max(1, int(args.logging_steps)) == 0 or step == state.max_steps
        if not (self.pending or logging_step):
            return
        row, self.pending = {**self.pending, **memory_metrics(self.planned_peak)}, {}
        if state.is_world_process_zero:
            due = control.should_log  # a log clears it: the step's own loss row must still go
            self.log(row)
            control.should_log = due


def fan_out(*writers: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    """One record to several writers (the jsonl file, then the tracker feed)."""

    def write(row: dict[str, Any]) -> None:
        for writer in writers:
            writer(row)

    return write
