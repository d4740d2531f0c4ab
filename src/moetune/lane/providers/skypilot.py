"""Provider `skypilot`: a SkyPilot cluster is the pod, driven through the `sky` CLI.

The run becomes a SkyPilot task (`task_yaml`): resources from the plan (accelerators
"<card>:<gpus>", disk from the volume wall), the pod env with `HF_HUB_DISABLE_XET=1`,
setup = lane.setup, file mounts for what is staged, and the in-pod watchdog as SkyPilot's
own autostop with `down: true` and `wait_for: none` – a hard deadline counted from launch,
not an idle timer (the lane's jobs run over SSH, which SkyPilot does not count as jobs).

The cost guard's layers map onto SkyPilot's: dead-man switch / watchdog → autostop
(down); controller budget poll → `sky status`; reap → `sky down <cluster>` with the name
this run recorded, never a name guessed from a pattern. `exec` / copies go over SSH to the
cluster's name, the host alias SkyPilot writes into ~/.ssh/config. moetune does not import
SkyPilot: it may live in its own venv (lane.skypilot.sky), and tests validate the YAML
with SkyPilot's own parser in that venv.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from moetune.config import dump_config
from moetune.errors import clip
from moetune.io import atomic_write_text, write_problem
from moetune.lane.launch import launch_plan
from moetune.lane.providers.base import (
    Env,
    ExecResult,
    LaneError,
    Pod,
    PodGone,
    PodSpec,
    Provider,
    SshTarget,
    register_provider,
)
from moetune.lane.providers.ssh import SshTransport
from moetune.lane.secrets import plain_env
from moetune.lane.stage import REMOTE_CONFIG, staging
from moetune.plan.cost.walls import XET_ENV

if TYPE_CHECKING:
    from moetune.config import LaneArgs, RunConfig, SkypilotArgs

# SkyPilot's accelerator names for the catalog's cards (`sky show-gpus` lists them).
ACCELERATORS = {
    "H200": "H200",
    "H100-80GB": "H100",
    "H100-NVL": "H100-NVL",  # not offered by every cloud; SkyPilot says which
    "A100-80GB": "A100-80GB",
    "A100-40GB": "A100",
    "L40S": "L40S",
    "B200": "B200",
    "RTX-4090": "RTX4090",
    "RTX-5090": "RTX5090",
    # the smaller cards as `sky show-gpus -a` names them (SkyPilot docs, GPUs and Accelerators)
    "RTX-A6000": "A6000",
    "L4": "L4",
    "A10G": "A10G",
    "T4": "T4",
    "V100-16GB": "V100",
    "V100-32GB": "V100-32GB",
}
_NO_SKY = "install SkyPilot (pip install skypilot, or its own venv) and set lane.skypilot.sky"


def accelerators(spec: PodSpec) -> str:
    """ "H100:2": the card SkyPilot should find, times the pod's GPUs."""
    name = ACCELERATORS.get(spec.card or "")
    if name is None:
        raise LaneError(
            f"card {spec.card!r} has no SkyPilot accelerator name",
            f"set hardware.card to one of {', '.join(sorted(ACCELERATORS))}",
        )
    return f"{name}:{spec.gpu_count}"


def task_yaml(
    spec: PodSpec, watchdog_s: int, setup: list[str], run: str, mounts: dict[str, str],
    sky: SkypilotArgs,
) -> dict[str, Any]:  # fmt: skip
    """The SkyPilot task for `spec`: the pod, its walls, what it sets up and runs."""
    resources: dict[str, Any] = {
        "accelerators": accelerators(spec),
        "disk_size": spec.volume_gb + spec.container_disk_gb,  # one disk on a VM
        "autostop": {
            "idle_minutes": math.ceil(watchdog_s / 60),
            "down": True,  # stopped still bills the disk: only down ends the cost
            "wait_for": "none",  # a deadline from launch, like the in-pod watchdog
        },
    }
    if sky.cloud:
        resources["cloud"] = sky.cloud
    if sky.use_spot:
        resources["use_spot"] = True
    if sky.image:
        resources["image_id"] = f"docker:{sky.image}"
    task = {
        "name": spec.name,
        "resources": resources,
        # secrets never go into the file: named with no value, passed by `sky launch --env`
        "envs": {
            **{k: None for k in secret_keys(spec)},
            **plain_env(spec.env, spec.public_env),
            XET_ENV: "1",
        },
        "file_mounts": dict(mounts),
        "setup": "\n".join(["set -e", *setup]) if setup else None,
        "run": run,
        "num_nodes": spec.nodes,
    }
    return {k: v for k, v in task.items() if v is not None}


def secret_keys(spec: PodSpec) -> list[str]:
    """The names of the pod env's secret entries (their values reach SkyPilot by
    environment)."""
    plain = plain_env(spec.env, spec.public_env)
    return sorted(k for k in spec.env if k not in plain)


def run_task(cfg: RunConfig, spec: PodSpec, watchdog_s: int, pod_config: Path) -> dict[str, Any]:
    """The whole run as one SkyPilot task: every staged file mounted where the pod's config
    (`pod_config`, written by the caller from `staging(cfg)`) expects it, then train on all
    the pod's GPUs – for `sky launch` by hand, without moetune's controller."""
    root = f"~/{cfg.lane.workdir}/{spec.name}"
    mounts = {f"{root}/{remote}": str(local.resolve()) for local, remote in staging(cfg).files}
    mounts[f"{root}/{REMOTE_CONFIG}"] = str(pod_config.resolve())
    nproc = spec.gpu_count if cfg.train.nproc == 1 else cfg.train.nproc
    train = f"{cfg.lane.remote_moetune} train {REMOTE_CONFIG}"
    ranks = f" --nproc {nproc}" if nproc > 1 or spec.nodes > 1 else ""
    run = f"cd {root} && {train}{ranks}{node_flags(spec.nodes, cfg.train.master_port)}"
    return task_yaml(spec, watchdog_s, cfg.lane.setup, run, mounts, cfg.lane.skypilot)


def node_flags(nodes: int, port: int) -> str:
    """`moetune train`'s multi-node flags from the env SkyPilot sets on each node: its
    rank, the node count, and the head node (the first of SKYPILOT_NODE_IPS) as node 0."""
    if nodes == 1:
        return ""
    head = '"$(echo "$SKYPILOT_NODE_IPS" | head -n1)"'
    return (
        ' --nnodes "$SKYPILOT_NUM_NODES" --node-rank "$SKYPILOT_NODE_RANK"'
        f" --master-addr {head} --master-port {port}"
    )


# The idle task's run, on every node: SkyPilot's node env, kept for the lane's SSH sessions
# (which SkyPilot does not give it) – the train command of each node sources it.
NODE_ENV = ".moetune-skypilot.env"
RECORD_NODE_ENV = (
    "for k in SKYPILOT_NODE_RANK SKYPILOT_NUM_NODES SKYPILOT_NODE_IPS; do "
    'printf "export %s=%q\\n" "$k" "${!k}"; done > ~/' + NODE_ENV
)


@register_provider("skypilot")
class SkypilotProvider(Provider):
    """Clusters named `PodSpec.name`: the pod id is the cluster name; a cluster of
    num_nodes > 1 is every node, its workers reached at SkyPilot's `<cluster>-worker<i>`."""

    title = "SkyPilot"
    multi_node = True  # num_nodes: one cluster, torn down as one

    @classmethod
    def node_hosts(cls, cfg: RunConfig) -> list[str]:
        return ["head node", *(f"worker {i}" for i in range(1, cfg.train.nnodes))]

    @classmethod
    def node_command(cls, cfg: RunConfig, command: str, rank: int) -> str:
        """Every node's rank and node 0's address come from SkyPilot's env on that node."""
        flags = node_flags(cfg.train.nnodes, cfg.train.master_port)
        return f". ~/{NODE_ENV} && {command}{flags}"

    def workers(self, cfg: RunConfig, state_dir: Path) -> list[Provider]:
        return [SkypilotWorker(self.lane, state_dir, i) for i in range(1, cfg.train.nnodes)]

    def __init__(self, lane: LaneArgs, state_dir: Path) -> None:
        self.lane, self.sky = lane, lane.skypilot
        self.state_dir = state_dir
        self.workdir = lane.workdir
        self._transports: dict[str, Any] = {}

    @classmethod
    def from_config(cls, lane: LaneArgs, state_dir: Path) -> SkypilotProvider:
        return cls(lane, state_dir)

    # -- the sky CLI ------------------------------------------------------------------

    def _sky(
        self, *args: str, env: Env | None = None, timeout_s: float = 1800
    ) -> subprocess.CompletedProcess[str]:
        exe = shutil.which(self.sky.sky)
        if exe is None:
            raise LaneError(f"the SkyPilot CLI {self.sky.sky!r} is not on PATH", _NO_SKY)
        done = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout_s, check=False,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
        if done.returncode != 0:
            raise LaneError(
                f"sky {args[0]} failed (rc {done.returncode}): {_last_line(done.stderr)}",
                "run `sky check` to see which clouds have credentials",
            )
        return done

    def create(self, spec: PodSpec) -> Pod:
        """`sky launch` of an idle task (the lane runs its phases over SSH), detached."""
        path = self.state_dir / f"{spec.name}.sky.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        run = RECORD_NODE_ENV if spec.nodes > 1 else "true"
        task = task_yaml(spec, self.lane.watchdog_s or 21600, self.lane.setup, run, {}, self.sky)
        path.write_text(yaml.safe_dump(task, sort_keys=False), encoding="utf-8")
        secrets = [arg for key in secret_keys(spec) for arg in ("--env", key)]
        env = {k: spec.env[k] for k in secret_keys(spec)}
        self._sky("launch", "-c", spec.name, "--yes", "--detach-run", *secrets, str(path), env=env)
        return self.status(spec.name)

    def wait_ready(self, pod_id: str, timeout_s: float) -> Pod:
        return self.status(pod_id)  # sky launch returns once the cluster is UP

    def status(self, pod_id: str) -> Pod:
        for pod in self.list():
            if pod.id == pod_id:
                return pod
        raise PodGone(f"SkyPilot cluster {pod_id} does not exist", "it was torn down")

    def list(self) -> list[Pod]:
        """Every cluster `sky status` shows (this account's, moetune's or not)."""
        return parse_status(self._sky("status", "--refresh").stdout, self.workdir)

    def terminate(self, pod_id: str) -> None:
        """`sky down` by the exact cluster name this run recorded; gone is success."""
        self.check_id(pod_id)
        try:
            self._sky("down", "--yes", pod_id)
        except LaneError as exc:
            if "not found" not in exc.cause.lower() and "does not exist" not in exc.cause:
                raise

    def self_terminate_command(self, pod_id: str) -> str:
        # autostop (down, wait_for none) is the in-cluster deadline: nothing to arm here
        return f"echo 'cluster {shlex.quote(pod_id)} ends by SkyPilot autostop (down)'"

    # -- SSH to the cluster's alias ------------------------------------------------

    def _transport(self, pod_id: str) -> Any:
        if pod_id not in self._transports:
            known = self.state_dir / f"known_hosts.{self.check_id(pod_id)}"
            target = SshTarget(pod_id, 22, self.sky.ssh_user)  # ~/.ssh/config: sky's alias
            self._transports[pod_id] = SshTransport(target, None, known, self.workdir)
        return self._transports[pod_id]

    def exec(
        self, pod_id: str, command: str, timeout_s: float | None = None, env: Env | None = None
    ) -> ExecResult:
        result: ExecResult = self._transport(pod_id).exec(command, timeout_s, env)
        return result

    def copy_in(self, pod_id: str, local: Path, remote: str) -> None:
        self._transport(pod_id).copy_in(local, remote)

    def copy_out(self, pod_id: str, remote: str, local: Path) -> None:
        self._transport(pod_id).copy_out(remote, local)


class SkypilotWorker(SkypilotProvider):
    """Worker `index` of a cluster node 0 launched: nothing to create or tear down (the
    cluster's `sky down` ends every node); its pod id is SkyPilot's SSH alias for it."""

    def __init__(self, lane: LaneArgs, state_dir: Path, index: int) -> None:
        super().__init__(lane, state_dir)
        self.index = index

    def _cluster(self, pod_id: str) -> str:
        return pod_id.removesuffix(f"-worker{self.index}")

    def create(self, spec: PodSpec) -> Pod:
        cluster = spec.name.rsplit("-n", 1)[0]  # the worker spec's name: <cluster>-n<rank>
        return self.status(f"{cluster}-worker{self.index}")

    def status(self, pod_id: str) -> Pod:
        head = super().status(self._cluster(pod_id))
        return Pod(pod_id, pod_id, head.status, workdir=head.workdir)

    def terminate(self, pod_id: str) -> None:
        """The head's `sky down` ends this node with the cluster."""


def parse_status(text: str, workdir: str) -> list[Pod]:
    """Clusters in `sky status` output: the rows under the table header that starts with
    NAME, up to the blank line that ends it (managed jobs and services come after)."""
    pods, in_table = [], False
    for line in text.splitlines():
        cols = line.split()
        if not cols:
            in_table = False
        elif cols[0] == "NAME":
            in_table = True
        elif in_table:
            status = next((c for c in cols[1:] if c in _STATUS), "")
            pods.append(Pod(cols[0], cols[0], _STATUS.get(status, "unknown"), workdir=workdir))
    return pods


_STATUS: dict[str, Any] = {"INIT": "starting", "UP": "running", "STOPPED": "exited"}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return json.dumps(lines[-1][:300]) if lines else "(no output)"


def write_task(cfg: RunConfig, out: Path) -> tuple[Path, dict[str, Any]]:
    """`out`/task.yaml (and the pod's config `out`/run.yaml) for `sky launch`: the card and
    GPUs the launch plan picks, its walls, the staged files. Existing files are refused."""
    task_path, pod_config = out / "task.yaml", out / "run.yaml"
    problem = write_problem(out, folder=True)
    if problem:
        raise LaneError(f"sky-task --out {clip(out, 100)} {problem}", "pass --out a folder")
    for path in (task_path, pod_config):
        if path.exists():
            raise LaneError(f"{path} exists; it is never overwritten", "pass another --out")
    plan = launch_plan(cfg)
    plan.choice.require()
    atomic_write_text(pod_config, dump_config(staging(cfg).config))
    task = run_task(cfg, plan.spec, plan.walls.watchdog_s, pod_config)
    atomic_write_text(task_path, yaml.safe_dump(task, sort_keys=False))
    return task_path, task
