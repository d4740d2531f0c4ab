"""The run directory: what a run writes, atomically, and how a killed run resumes.

    <output.dir>/
      config.yaml         the resolved run config (--resume compares against it)
      versions.json       torch/transformers/peft/trl/... versions, git sha, device
      preflight.json      lint findings, the memory plan, errors overridden by --allow-errors
      data.json           data file, format, rows, what the loss is taken on, sha256
      coverage.json       the LoRA coverage audit of the wrapped model
      quant.json          model.experts_dtype int8/nf4: per-layer output error of the stacks
      experts_selected.json  lora.expert_selection: the experts trained per layer, scores
      metrics.jsonl       one row per logging step
      routing.jsonl       one row per routing record
      routing_shift.jsonl rollout → training routing shift per step (grpo)
      checkpoints/step-N  complete checkpoints only
      adapter/            the peft adapter (adapter_config.json + adapter_model.safetensors)
      summary.json        written last: a run with a summary is finished
      accelerate.yaml     --nproc N: the accelerate config the ranks were launched with

Checkpoints: HF Trainer writes `checkpoint-N` into `.staging/`, not atomically; once it is
done the directory is fsynced and renamed to `checkpoints/step-N` in one step, so every
entry of `checkpoints/` is complete. A kill -9 mid-save leaves a torn directory in
`.staging/`, which resume ignores and clears. JSON files go to a temp file that is renamed
over the target; JSONL logs are appended a whole line at a time, a torn last line is
dropped on read, and on resume rows past the checkpoint are cut away (atomically).
Damaged checkpoints and full disks are recovery.py's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import yaml

from moetune.config import RunConfig, dump_config, load_yaml, parse_config
from moetune.config.paths import rebase
from moetune.errors import MoetuneError
from moetune.io import PROMOTED, atomic_write_text, fsync_path, share_by_umask
from moetune.train.distributed.nodes import NODE_KEYS
from moetune.train.errors import TrainError

# Written by `moetune train --nproc` before the ranks start (train/launch.py): not foreign.
LAUNCH_FILES = ("accelerate.yaml",)
KEEP_CHECKPOINTS = 2  # committed checkpoints kept; older ones are removed after each commit
STEP_PREFIX = "step-"
_LIBRARIES = ("torch", "transformers", "peft", "trl", "accelerate", "datasets", "moetune")


# ---------------------------------------------------------------- atomic files


def fsync_tree(root: Path) -> None:
    """fsync every file under `root` and the directories, so a rename publishes whole files."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete directory `src` to `dst`; an existing `dst` is swapped out first."""
    share_by_umask(src)  # safetensors writes 0600; the user's umask decides
    fsync_tree(src)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)
    fsync_path(dst.parent)


class JsonlLog:
    """An append-only JSONL file of rows that carry a "step"."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[dict[str, Any]]:
        """Every whole row; a torn last line (a kill mid-write) is dropped."""
        if not self.path.is_file():
            return []
        rows = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
        return rows

    def append(self, row: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(row, default=str) + "\n")
            fh.flush()

    def truncate_after(self, step: int) -> None:
        """Keep the rows up to `step` (the checkpoint a run resumes from)."""
        rows = [r for r in self.read() if r.get("step", 0) <= step]
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in rows))


# ---------------------------------------------------------------- the run directory


@dataclass(frozen=True)
class RunDir:
    """Paths of one run's outputs."""

    root: Path
    replace: bool = False  # --overwrite: an earlier run here is removed once preflight passes

    @property
    def config(self) -> Path:
        return self.root / "config.yaml"

    @property
    def versions(self) -> Path:
        return self.root / "versions.json"

    @property
    def preflight(self) -> Path:
        return self.root / "preflight.json"

    @property
    def data(self) -> Path:
        return self.root / "data.json"

    @property
    def coverage(self) -> Path:
        return self.root / "coverage.json"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def staging(self) -> Path:
        """Where HF Trainer writes checkpoints before they are committed."""
        return self.root / ".staging"

    @property
    def metrics(self) -> JsonlLog:
        return JsonlLog(self.root / "metrics.jsonl")

    @property
    def routing(self) -> JsonlLog:
        return JsonlLog(self.root / "routing.jsonl")

    @property
    def shift(self) -> JsonlLog:
        return JsonlLog(self.root / "routing_shift.jsonl")

    @property
    def finished(self) -> bool:
        return self.summary.is_file()

    def checkpoints_done(self) -> list[tuple[int, Path]]:
        """(step, dir) of the committed checkpoints, oldest first."""
        if not self.checkpoints.is_dir():
            return []
        found = []
        for d in self.checkpoints.iterdir():
            step = d.name.removeprefix(STEP_PREFIX)
            complete = (d / "trainer_state.json").is_file()  # written last by HF Trainer
            if d.name.startswith(STEP_PREFIX) and step.isdigit() and complete:
                found.append((int(step), d))
        return sorted(found)

    def last_checkpoint(self) -> tuple[int, Path] | None:
        done = self.checkpoints_done()
        return done[-1] if done else None

    def started(self) -> bool:
        """True when training made progress here (a checkpoint or a logged step)."""
        return bool(self.checkpoints_done() or self.metrics.read())


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


RECORD_KEYS = ("output.ledger", "eval.results_dir")


def config_diff(old_yaml: str, cfg: RunConfig, root: Path | None = None) -> list[str]:
    """'key (old -> new)' for every field that differs between a saved and a new config;
    with `root`, the saved one's paths as found from the run dir (config/paths.py)."""
    try:
        old = _flatten(_rebased(load_yaml(old_yaml) or {}, root))
    except yaml.YAMLError:
        raise TrainError(
            "the run's saved config.yaml is not valid YAML, so --resume cannot check it",
            "restore config.yaml as moetune wrote it, or start a new output.dir",
        ) from None
    new = _flatten(yaml.safe_load(dump_config(cfg)))  # as saved: secrets masked alike
    # a field added since the run started, left at its default, changes nothing
    defaults = _flatten(yaml.safe_load(dump_config(RunConfig())))
    added = {k for k in new.keys() - old.keys() if k in defaults and new[k] == defaults[k]}
    # NODE_KEYS: where a node runs (its rank, node 0's address), and RECORD_KEYS: where the
    # attempt is recorded (a resumed lane run's new pod has its own ledger) – not what the
    # run trains
    compared = (old.keys() | new.keys() - added) - set(NODE_KEYS) - set(RECORD_KEYS)
    keys = sorted(k for k in compared if _same(k, old.get(k)) != _same(k, new.get(k)))
    return [f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in keys]


# Paths compared as the files they name: a symlinked or relative spelling of the same place
# (the saved config holds it resolved) is the same run.
PATH_KEYS = ("output.dir", "data.train_file", "data.eval_file", "model.id")


def _same(key: str, value: Any) -> Any:
    """`value` as compared: a path field's local path resolved, anything else as it is."""
    if key in PATH_KEYS and isinstance(value, str) and value and Path(value).exists():
        return str(Path(value).resolve())
    return value


def _rebased(saved: Any, root: Path | None) -> Any:
    """The saved config with its paths found from `root` (as saved when it does not parse)."""
    if root is None or not isinstance(saved, dict):
        return saved
    try:
        return load_yaml(dump_config(rebase(parse_config(saved), root)))
    except MoetuneError:
        return saved


def _check_writable(root: Path) -> None:
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=root, prefix=".probe."):
            pass
    except OSError as exc:
        raise TrainError(
            f"output dir {root} is not writable ({exc.strerror or exc})",
            "set output.dir to a directory you can write to",
        ) from None


def _check_not_foreign(run: RunDir) -> None:
    """A non-empty directory without moetune's config.yaml belongs to someone else."""
    found = sorted(p.name for p in run.root.iterdir()) if run.root.is_dir() else []
    found = [name for name in found if name not in LAUNCH_FILES]
    if found and not run.config.is_file():
        raise TrainError(
            f"{run.root} is not empty and holds no moetune run ({', '.join(found[:3])})",
            "choose an empty or new output.dir; moetune never writes over other files",
        )


def _check_resume(run: RunDir, cfg: RunConfig) -> None:
    _check_not_foreign(run)
    if not run.config.is_file():
        return  # nothing written yet: a resume starts from scratch
    diff = config_diff(run.config.read_text(encoding="utf-8"), cfg, run.root)
    if diff:
        raise TrainError(
            f"--resume with a different config than {run.config}: {'; '.join(diff)}",
            f"resume with the saved config (moetune train {run.config} --resume), "
            "or start a new output.dir",
        )


def _check_fresh(run: RunDir) -> None:
    _check_not_foreign(run)
    if run.finished:
        raise TrainError(
            f"{run.root} holds a finished run (summary.json); it is never overwritten",
            "choose a new output.dir (e.g. --set output.dir=runs/next) or pass --overwrite",
        )
    if run.started():
        last = run.last_checkpoint()
        where = f"last checkpoint: step {last[0]}" if last else "no checkpoint yet"
        raise TrainError(
            f"{run.root} holds an unfinished run ({where})",
            "pass --resume to continue it, or choose a new output.dir",
        )


def inspect_run(
    cfg: RunConfig, resume: bool, overwrite: bool = False, overwrite_promoted: bool = False
) -> RunDir:
    """The run dir of `cfg`, checked read-only: refuse to overwrite (unless asked), or to
    resume differently. A directory that is not a moetune run is never replaced, a promoted
    adapter only when `overwrite_promoted` says so."""
    overwrite = overwrite or overwrite_promoted
    run = RunDir(Path(cfg.output.dir), replace=overwrite and not resume)
    if resume:
        _check_resume(run, cfg)
    elif run.replace:
        _check_not_foreign(run)
        _check_not_promoted(run, overwrite_promoted)
    else:
        _check_fresh(run)
    return run


# What a run writes (the tree above, plus the default report and eval results); --overwrite
# removes these and nothing else, so a user's own files in the run dir survive.
RUN_OWNED = (
    "summary.json", "config.yaml", "versions.json", "preflight.json", "data.json",
    "coverage.json", "quant.json", "offload.json", "experts_selected.json", "metrics.jsonl",
    "routing.jsonl", "routing_shift.jsonl", "report.html", "checkpoints", ".staging",
    ".adapter.tmp", "adapter", "mlx", "trackers",
    "eval/ladder.json", "eval/verdict.json", "eval/rungs/*.json", "eval/rungs/*.items.jsonl",
)  # fmt: skip


def _check_not_promoted(run: RunDir, allowed: bool) -> None:
    if (run.adapter / PROMOTED).is_file() and not allowed:
        raise TrainError(
            f"{run.adapter} is a promoted adapter ({PROMOTED}); --overwrite never removes one",
            "choose a new output.dir, or pass --overwrite-promoted to replace it too",
        )


def owned_entries(root: Path) -> list[Path]:
    """moetune's files and folders in a run dir, summary.json first (a crash mid-removal
    then never leaves a run that reads as finished)."""
    found = {p for pattern in RUN_OWNED for p in root.glob(pattern)}
    return sorted(found, key=lambda p: (p.name != "summary.json", str(p)))


def _remove_earlier_run(run: RunDir) -> None:
    """--overwrite: remove the earlier run's files (folders out of sight in one rename
    first), and folders of moetune's left empty; anything else stays where it is."""
    for entry in owned_entries(run.root):
        if entry.is_dir() and not entry.is_symlink():
            trash = entry.with_name(f".{entry.name}.replaced-{os.getpid()}")
            os.replace(entry, trash)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    for folder in (run.root / "eval" / "rungs", run.root / "eval"):
        with contextlib.suppress(OSError):
            folder.rmdir()  # only when empty


def open_run(run: RunDir, cfg: RunConfig, resume_step: int | None) -> None:
    """Create the run dir and write the config; on resume, clear torn saves and later rows."""
    if run.replace:
        _remove_earlier_run(run)
    _check_writable(run.root)
    shutil.rmtree(run.staging, ignore_errors=True)  # torn saves of a killed run
    atomic_write_text(run.config, dump_config(cfg))
    for log in (run.metrics, run.routing, run.shift):
        if log.path.exists():
            log.truncate_after(resume_step or 0)


# ---------------------------------------------------------------- checkpoints


# ---------------------------------------------------------------- provenance


def git_sha() -> str | None:
    """The commit of the moetune source tree, when it runs from a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, str | None]:
    """Versions of the libraries a run depends on, Python's, and moetune's git sha."""
    found: dict[str, str | None] = {}
    for name in _LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    found["python"] = platform.python_version()
    found["git_sha"] = git_sha()
    return found


def ledger_fields(cfg: RunConfig) -> dict[str, Any]:
    """What every ledger row of this run carries: run id, config hash, versions."""
    return {
        "run_id": Path(cfg.output.dir).name,
        "config_hash": hashlib.sha256(dump_config(cfg).encode()).hexdigest()[:16],
        "versions": {k: str(v) for k, v in versions().items()},
    }
