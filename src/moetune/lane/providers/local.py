"""Provider `local`: a pod is a directory on this machine and its commands are subprocesses.

The "free hardware" route – the same phases as a rented GPU, on the card you have – and
the test bed of the phases. A pod's background commands run in their own process groups
(their pids in `*.pid`), so terminate can end them all; a `TERMINATED` file marks the pod
ended while its files (user data) stay.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from moetune.io import atomic_write_json, file_digests
from moetune.lane.providers.base import (
    Env,
    ExecResult,
    LaneError,
    Pod,
    PodGone,
    PodSpec,
    Provider,
    TransientError,
    register_provider,
)
from moetune.lane.transfer import verify_tree

if TYPE_CHECKING:
    from moetune.config import RunConfig

TERMINATED = "TERMINATED"


@register_provider("local")
class LocalProvider(Provider):
    """Pods under `base_dir` (lane.workdir, relative to the working directory)."""

    title = "this machine"
    remote = False  # no card to rent, no pod walls
    setup_s = 0.0

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir.resolve()

    @classmethod
    def from_run(cls, cfg: RunConfig, state_dir: Path) -> LocalProvider:
        """Pods in `pods/` beside the run's ledger."""
        return cls(Path(cfg.output.ledger).parent / "pods")

    def _path(self, pod_id: str) -> Path:
        """`base_dir/pod_id`, refused when the id is no id or the folder is a link: a pod
        never reaches outside `base_dir`."""
        path = self.base_dir / self.check_id(pod_id)
        if path.is_symlink() or (path / TERMINATED).is_symlink():
            raise LaneError(f"local pod {pod_id!r} is a symlink, not a pod", "moetune pods list")
        return path

    def _dir(self, pod_id: str) -> Path:
        path = self._path(pod_id)
        if not (path / "pod.json").is_file():
            raise PodGone(f"local pod {pod_id} does not exist", "moetune pods list")
        return path

    def _live(self, pod_id: str) -> Path:
        path = self._dir(pod_id)
        if (path / TERMINATED).exists():
            raise PodGone(f"local pod {pod_id} was terminated", "launch again or --resume")
        return path

    def create(self, spec: PodSpec) -> Pod:
        path = self._path(spec.name)
        path.mkdir(parents=True, exist_ok=True)
        if not (path / "pod.json").is_file():  # idempotent by name
            # the env travels per exec; to_json shows only its public entries
            atomic_write_json(path / "pod.json", {"spec": spec.to_json(), "created": time.time()})
        return self.status(spec.name)

    def wait_ready(self, pod_id: str, timeout_s: float) -> Pod:
        return self.status(pod_id)

    def status(self, pod_id: str) -> Pod:
        path = self._dir(pod_id)
        created = json.loads((path / "pod.json").read_text())["created"]
        ended = (path / TERMINATED).exists()
        return Pod(
            id=pod_id,
            name=pod_id,
            status="terminated" if ended else "running",
            uptime_s=0.0 if ended else time.time() - created,
            workdir=str(path),
        )

    def exec(
        self, pod_id: str, command: str, timeout_s: float | None = None, env: Env | None = None
    ) -> ExecResult:
        path = self._live(pod_id)
        full = {**os.environ, **env} if env else None
        try:
            done = subprocess.run(
                ["bash", "-c", command], cwd=path, capture_output=True, text=True,
                timeout=timeout_s, env=full,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            raise TransientError(f"command timed out after {timeout_s} s in pod {pod_id}") from None
        return ExecResult(done.returncode, done.stdout, done.stderr)

    def copy_in(self, pod_id: str, local: Path, remote: str) -> None:
        _copy(local, self._live(pod_id) / remote)

    def copy_out(self, pod_id: str, remote: str, local: Path) -> None:
        source = self._dir(pod_id) / remote  # files stay readable after terminate
        if not source.exists():
            raise LaneError(f"{remote} does not exist in pod {pod_id}", "check the phase logs")
        tmp = local.parent / f".{local.name}.partial"
        try:
            _copy(source, tmp)
            verify_tree(tmp, file_digests(source))
        except (OSError, LaneError) as err:
            _remove(tmp)  # never a half copy: `local` is complete or absent
            cause = err.cause if isinstance(err, LaneError) else (err.strerror or str(err))
            raise LaneError(
                f"copy of {remote} failed: {cause}", "free space, then --resume"
            ) from None
        _remove(local)
        tmp.rename(local)

    def terminate(self, pod_id: str) -> None:
        path = self._path(pod_id)
        if not path.is_dir() or (path / TERMINATED).exists():
            return  # already gone: success
        subprocess.run(["bash", "-c", self.self_terminate_command(pod_id)], check=False)

    def list(self) -> list[Pod]:
        if not self.base_dir.is_dir():
            return []
        names = (p.parent.name for p in sorted(self.base_dir.glob("*/pod.json")))
        return [self.status(n) for n in names if self._is_pod(n)]

    def _is_pod(self, name: str) -> bool:
        """A folder here is a pod when its name is an id and it is no symlink."""
        return bool(self.id_pattern.fullmatch(name)) and not (self.base_dir / name).is_symlink()

    def self_terminate_command(self, pod_id: str) -> str:
        """Mark the pod ended and signal the process groups of its jobs – only pid files
        holding a plain number above 1 (never -1, 0 or init's group)."""
        path = shlex.quote(str(self._path(pod_id)))
        return (
            f"touch {path}/{TERMINATED}; for f in {path}/*.pid; do "
            '[ -f "$f" ] && [ ! -L "$f" ] || continue; g=$(cat "$f"); '
            'case "$g" in ""|*[!0-9]*) continue;; esac; '
            '[ "$g" -gt 1 ] && kill -TERM -- "-$g" 2>/dev/null; done; true'
        )


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.is_dir():
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
    else:
        shutil.copy2(src, dst)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
