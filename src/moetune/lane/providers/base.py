"""The one interface every provider implements: a pod is created, waited on, used through
`exec` / `copy_in` / `copy_out`, listed, and terminated – and nothing else.

A "pod" is whatever runs the work: a RunPod pod, a directory on an SSH host, a directory
on this machine. Providers are registered by name (`PROVIDERS`) and constructed from the
run config (`from_run`), so the phases never ask which one they drive.

What the rest of moetune must know about a provider – whether its pods are remote, the
volume and watchdog a pod gets by default, its paid setup time, the secrets it reads – are
class-level traits here, set by each provider on its own class; nothing outside
lane/providers/ compares a provider's name (tests/test_lane_traits.py greps for it).

Rules every provider keeps:
- `terminate` is idempotent: a pod that is already gone is success, never an error
  (a watchdog may have reaped it first).
- `create` is idempotent by `PodSpec.name`: when an earlier attempt's answer was lost, the
  retry adopts the pod with exactly that name instead of renting a second one.
- Errors a user can act on are `LaneError`s (one-line cause + fix); transient transport
  faults are `TransientError`s, which callers may retry; a pod that vanished is `PodGone`.
- Secrets (API keys) never appear in an exception, a log line or a ledger row.
"""

from __future__ import annotations

import re
import shlex
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from moetune.errors import MoetuneError
from moetune.ledger import public_env
from moetune.plan.cost.walls import XET_ENV
from moetune.registry import Registry

if TYPE_CHECKING:
    from moetune.config import LaneArgs, RunConfig

Env = Mapping[str, str]
PodStatus = Literal["starting", "running", "exited", "terminated", "unknown"]


class LaneError(MoetuneError):
    """A remote-lane operation failed in a way the user must act on."""


class TransientError(LaneError):
    """A fault worth retrying (HTTP 5xx, timeouts, a dropped connection)."""


class PodGone(LaneError):
    """The pod no longer exists (terminated, reaped by a watchdog, or never created)."""


@dataclass(frozen=True)
class SshTarget:
    """Where a pod's sshd listens."""

    host: str
    port: int = 22
    user: str = "root"


@dataclass(frozen=True)
class PodSpec:
    """What to create. `name` is unique per run attempt (`moetune-<run id>-<nonce>`)."""

    name: str
    card: str | None = None  # card id from the catalog (plan/cards.json)
    gpu_type_id: str | None = None  # the provider's id for the card (RunPod: "NVIDIA H200")
    gpu_count: int = 1  # per node
    nodes: int = 1  # machines of gpu_count GPUs each (train.nnodes)
    image: str = "runpod/pytorch:2.8.0-py3.11-cuda12.8.1-cudnn-devel-ubuntu22.04"
    volume_gb: int = 50
    container_disk_gb: int = 30
    env: dict[str, str] = field(default_factory=dict)
    ports: str = "22/tcp"
    cloud_type: str = "ALL"  # RunPod: ALL | SECURE | COMMUNITY
    public_env: tuple[str, ...] = ()  # env names whose values may be shown; the rest: secrets

    def to_json(self) -> dict[str, Any]:
        """The spec as it may be shown or stored: every secret env value masked."""
        shown = {*self.public_env, XET_ENV}  # the walls' own entry is moetune's, not a secret
        return {**asdict(self), "env": public_env(self.env, shown)}


@dataclass(frozen=True)
class Pod:
    """A pod as the provider reports it now."""

    id: str
    name: str
    status: PodStatus
    cost_per_hr: float = 0.0
    uptime_s: float = 0.0
    gpu_util_percent: float | None = None
    ssh: SshTarget | None = None
    workdir: str = ""  # absolute path on the pod where a run's files live

    @property
    def spent_usd(self) -> float:
        return self.cost_per_hr * self.uptime_s / 3600

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "spent_usd": round(self.spent_usd, 4)}


@dataclass(frozen=True)
class ExecResult:
    rc: int
    stdout: str
    stderr: str


SETUP_S = 600.0  # pod start, image pull, pip install, staging: paid time before the first step


class Provider(ABC):
    """Operations on pods. Subclasses set `name` and implement every method; `id_pattern`
    is the shape of this provider's pod ids (no separators, no leading dot: an id is
    never a path). The traits below default to a remote provider's."""

    name: ClassVar[str]
    id_pattern: ClassVar[re.Pattern[str]] = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
    title: ClassVar[str] = ""  # as messages name it ("RunPod"); default: `name`
    remote: ClassVar[bool] = True  # pods on another machine: a card is chosen, walls apply
    default_volume_gb: ClassVar[int | None] = None  # what a pod gets without lane.volume_gb
    default_watchdog_s: ClassVar[int | None] = None  # its deadline without lane.watchdog_s
    setup_s: ClassVar[float] = SETUP_S  # paid time before the first training step
    multi_node: ClassVar[bool] = False  # places train.nnodes > 1 nodes, one pod each

    # -- several nodes (train.nnodes > 1): node 0 is this provider's pod, nodes 1 … N-1
    # are `workers`' pods; see moetune.lane.nodes.

    @classmethod
    def check_nodes(cls, cfg: RunConfig) -> None:
        """LaneError (one line) when this provider cannot place train.nnodes nodes."""
        if cfg.train.nnodes > 1 and not cls.multi_node:
            raise LaneError(
                f"provider {cls.name} runs one node, not train.nnodes={cfg.train.nnodes}",
                "launch several nodes with provider ssh (lane.ssh.hosts) or skypilot, or set "
                "train.nnodes: 1",
            )

    @classmethod
    def node_hosts(cls, cfg: RunConfig) -> list[str]:
        """Where each node runs, node 0 first, as a person reads it (the plan shows it)."""
        return [cls.title] * cfg.train.nnodes

    @classmethod
    def node_command(cls, cfg: RunConfig, command: str, rank: int) -> str:
        """`command` (a `moetune train`) as node `rank` runs it: with the multi-node flags,
        node 0's address from train.master_addr (providers that know it override this)."""
        t = cfg.train
        return (
            f"{command} --nnodes {t.nnodes} --node-rank {rank} --master-addr "
            f"{shlex.quote(t.master_addr or '')} --master-port {t.master_port}"
        )

    def workers(self, cfg: RunConfig, state_dir: Path) -> list[Provider]:
        """The providers of nodes 1 … N-1 (one each); none for one node."""
        return []

    @classmethod
    def from_run(cls, cfg: RunConfig, state_dir: Path) -> Provider:
        """The provider a run config asks for; `state_dir` keeps its state (host keys …)."""
        return cls.from_config(cfg.lane, state_dir)

    @classmethod
    def from_config(cls, lane: LaneArgs, state_dir: Path) -> Provider:
        """Built from the `lane` section alone (a provider that needs more overrides
        `from_run` instead)."""
        raise NotImplementedError(f"provider {cls.name} is built by from_run")

    @classmethod
    def secret_names(cls, lane: LaneArgs) -> dict[str, str]:
        """Environment variables holding this provider's credentials (CI maps them from
        secrets by these names), each with the config field that names it; none by default."""
        return {}

    @classmethod
    def secret_values(cls, lane: LaneArgs) -> list[str]:
        """The credential values this machine would use (masked in everything a launch
        shows or stores); none by default."""
        return []

    def check_id(self, pod_id: str) -> str:
        """`pod_id` when it has this provider's id shape, else LaneError (one line)."""
        if not self.id_pattern.fullmatch(pod_id):
            raise LaneError(
                f"{pod_id!r} is not a {self.name} pod id (ids are never paths)",
                "pass the id exactly as `moetune pods list` shows it",
            )
        return pod_id

    @abstractmethod
    def create(self, spec: PodSpec) -> Pod:
        """Rent/prepare a pod for `spec` (idempotent by spec.name); returns at once."""

    @abstractmethod
    def wait_ready(self, pod_id: str, timeout_s: float) -> Pod:
        """Block until the pod accepts `exec` (LaneError on timeout, PodGone if it vanished)."""

    @abstractmethod
    def status(self, pod_id: str) -> Pod:
        """The pod now (PodGone when it no longer exists)."""

    @abstractmethod
    def exec(
        self, pod_id: str, command: str, timeout_s: float | None = None, env: Env | None = None
    ) -> ExecResult:
        """Run a shell command in the pod's workdir; its exit code, stdout and stderr. `env`
        joins the command's process environment – never its text, argv or a file, so
        secrets passed this way appear nowhere on the pod but in that environment."""

    @abstractmethod
    def copy_in(self, pod_id: str, local: Path, remote: str) -> None:
        """Copy a local file or directory to `remote` (relative paths: under the workdir)."""

    @abstractmethod
    def copy_out(self, pod_id: str, remote: str, local: Path) -> None:
        """Copy a remote file or directory to `local`; resumes after a drop, then verifies
        every file's sha256 against the pod's (LaneError on a mismatch)."""

    @abstractmethod
    def terminate(self, pod_id: str) -> None:
        """End the pod and its cost; idempotent (already gone is success)."""

    @abstractmethod
    def list(self) -> list[Pod]:
        """Every pod this account/host has – moetune's and anyone else's."""

    @abstractmethod
    def self_terminate_command(self, pod_id: str) -> str:
        """A shell command that, run inside the pod, terminates it (the dead-man switch)."""

    # Long stages run detached, so a dropped connection never kills a training run; the
    # controller polls for the exit code. Built on `exec`, so every provider has them.
    # `log_name` is the log file (relative to the workdir); the exit code goes to <log>.rc.

    def exec_background(
        self, pod_id: str, command: str, log_name: str, env: Env | None = None
    ) -> None:
        """Start `command` detached in the pod (with `env`), output appended to `log_name`."""
        log = shlex.quote(log_name)
        body = f"( {command} ) >> {log} 2>&1; echo $? > {log}.rc.tmp && mv {log}.rc.tmp {log}.rc"
        started = self.exec(
            pod_id,
            f"rm -f {log}.rc; nohup setsid bash -c {shlex.quote(body)} > /dev/null 2>&1 "
            f"< /dev/null & echo $! > {log}.pid",
            env=env,
        )
        if started.rc != 0:
            raise LaneError(f"could not start {log_name} in pod {pod_id}: {started.stderr[:200]}")

    def poll_background(self, pod_id: str, log_name: str) -> int | None:
        """None while the command runs; its exit code when done; -1 when it was killed
        without an exit code, or never started."""
        log = shlex.quote(log_name)
        out = self.exec(
            pod_id,
            f"cat {log}.rc 2>/dev/null"
            f" || {{ kill -0 $(cat {log}.pid) 2>/dev/null && echo running; }} || echo lost",
        ).stdout.strip()
        if out == "running":
            return None
        return int(out) if out.lstrip("-").isdigit() else -1

    def tail(self, pod_id: str, log_name: str, lines: int = 20) -> str:
        """The last lines of a background command's log (for error messages)."""
        return self.exec(pod_id, f"tail -n {int(lines)} {shlex.quote(log_name)} 2>/dev/null").stdout


PROVIDERS: Registry[type[Provider]] = Registry("provider", LaneError)


def register_provider(name: str) -> Callable[[type[Provider]], type[Provider]]:
    def add(cls: type[Provider]) -> type[Provider]:
        cls.name = name
        cls.title = cls.title or name
        return PROVIDERS.add(name, cls)

    return add
