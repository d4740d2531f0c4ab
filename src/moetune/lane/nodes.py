"""Several nodes on the lane (train.nnodes > 1): node 0 is the launch's pod, nodes 1 … N-1
are workers, each its own pod (provider ssh: one host each; skypilot: the workers of the
one cluster). Every pod is provisioned, guarded and staged the same way; the walls (disk,
RAM, node 0's port) are checked on every node before any node trains; each node runs
`moetune train … --nnodes N --node-rank R --master-addr <node 0> --master-port P` (its
provider says where node 0's address comes from); node 0 writes the run, which is banked
and evaluated from it alone. Spend is the sum over the nodes, so the budget counts them
all, and teardown ends every node.
"""

from __future__ import annotations

import time
from contextlib import suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.config import RunConfig
from moetune.lane.providers import provider_class
from moetune.lane.providers.base import LaneError, PodGone, PodSpec, Provider
from moetune.lane.stage import REMOTE_CONFIG, REMOTE_RUN
from moetune.model import load_spec
from moetune.plan.cost.walls import snapshot_bytes
from moetune.train.distributed.nodes import (
    node_ram_bytes,  # what `moetune train` checks on each node
)
from moetune.units import human_bytes

if TYPE_CHECKING:
    from moetune.lane.phases import Lane

WORKER_EXIT_WAIT_S = 300.0  # after node 0 ends, how long the workers get to end too


@dataclass
class Worker:
    """Node `rank` (≥ 1): the provider that reaches it and the pod it gets."""

    rank: int
    provider: Provider
    spec: PodSpec


def make_workers(
    provider: Provider, cfg: RunConfig, spec: PodSpec, state_dir: Path
) -> list[Worker]:
    """Nodes 1 … N-1 of a launch whose node 0 is `provider`'s pod `spec` (none for one)."""
    found = provider.workers(cfg, state_dir)
    return [Worker(r, p, worker_spec(spec, r)) for r, p in enumerate(found, start=1)]


def worker_spec(spec: PodSpec, rank: int) -> PodSpec:
    """Node `rank`'s pod: node 0's spec under its own name (create's idempotency key)."""
    return replace(spec, name=f"{spec.name}-n{rank}")


def train_command(cfg: RunConfig, gpu_count: int, rank: int | None = None) -> str:
    """`moetune train` as a pod runs it: on all its GPUs, resuming from the pod's own
    checkpoints; with node `rank`'s multi-node flags when train.nnodes > 1."""
    resume = f"test -d {REMOTE_RUN}/checkpoints && echo --resume || true"
    # a multi-GPU pod trains on all its GPUs (accelerate; train.nproc as configured wins)
    gpus = gpu_count if cfg.train.nproc == 1 and gpu_count > 1 else 0
    nproc = f" --nproc {gpus}" if gpus else ""
    command = f"{cfg.lane.remote_moetune} train {REMOTE_CONFIG}{nproc} $({resume})"
    if rank is None or cfg.train.nnodes == 1:
        return command
    return provider_class(cfg.lane.provider).node_command(cfg, command, rank)


def node_plan(cfg: RunConfig, spec: PodSpec) -> list[dict[str, Any]]:
    """What `--dry-run` shows of each node: its rank, where it runs, its pod and command."""
    cls = provider_class(cfg.lane.provider)
    hosts = [*cls.node_hosts(cfg), *[cls.title] * cfg.train.nnodes]  # a host not set yet: "ssh"
    names = [spec.name, *(worker_spec(spec, r).name for r in range(1, cfg.train.nnodes))]
    return [
        {"rank": r, "host": hosts[r], "pod": names[r],
         "command": train_command(cfg, spec.gpu_count, r)}
        for r in range(cfg.train.nnodes)
    ]  # fmt: skip


# ---------------------------------------------------------------- on the lane's pods


def pod_ids(lane: Lane) -> list[tuple[Provider, str]]:
    """(provider, pod id) of every node provisioned so far, node 0 first."""
    ids = [(w.provider, lane.state.node_pods[w.rank - 1]) for w in lane.workers]
    return [(lane.provider, lane.pod), *((p, i) for p, i in ids if i)]


def provision_workers(lane: Lane) -> None:
    """Each worker's pod, its id saved before anything else can fail (reap-by-id)."""
    lane.state.node_pods += [""] * (len(lane.workers) - len(lane.state.node_pods))
    for w in lane.workers:
        pod = w.provider.create(w.spec)
        lane.state.node_pods[w.rank - 1] = pod.id
        lane.save()
        lane.row("provision", pod_id=pod.id, node_rank=w.rank, pod_name=pod.name,
                 card=w.spec.card, cost_per_hr=pod.cost_per_hr,
                 volume_gb=w.spec.volume_gb)  # fmt: skip
        w.provider.wait_ready(pod.id, lane.cfg.lane.ready_timeout_s)
        lane.say(f"node {w.rank}: pod {pod.id} ready")


def check_walls(lane: Lane) -> None:
    """Disk and RAM on every node, node 0's rendezvous port free: one LaneError naming
    every node that falls short, before any node starts training."""
    cfg = lane.cfg
    disk = 0 if Path(cfg.model.id).exists() else snapshot_bytes(load_spec(cfg.model.id))
    ram = node_ram_bytes(cfg)
    short = [
        why
        for rank, (provider, pod) in enumerate(pod_ids(lane))
        for why in node_shortfalls(provider, pod, rank, disk, ram, cfg.train.master_port)
    ]
    if short:
        raise LaneError(
            "; ".join(short), "free the disk, RAM or port named, or pick other hosts (--hosts)"
        )


PROBE = (
    "df -B1 --output=avail . | tail -n1; awk '/MemAvailable/ {print $2 * 1024}' /proc/meminfo; "
    "(exec 3<>/dev/tcp/127.0.0.1/%d) 2>/dev/null && echo busy || echo free"
)


def node_shortfalls(
    provider: Provider, pod: str, rank: int, disk: int, ram: int, port: int
) -> list[str]:
    """What node `rank` lacks: disk for the base, RAM for its ranks, node 0's port."""
    got = provider.exec(pod, PROBE % int(port), 60).stdout.split()
    if len(got) != 3 or not got[0].isdigit():
        return [f"node {rank}: could not read its disk, RAM and ports ({' '.join(got)[:80]})"]
    free_disk, free_ram = int(got[0]), int(float(got[1]))
    short = []
    if free_disk < disk:
        short.append(f"node {rank}: {human_bytes(free_disk)} disk free, the base needs "
                     f"{human_bytes(disk)}")  # fmt: skip
    if free_ram < ram:
        short.append(f"node {rank}: {human_bytes(free_ram)} RAM free, its ranks need "
                     f"{human_bytes(ram)}")  # fmt: skip
    if rank == 0 and got[2] == "busy":
        short.append(f"node 0: train.master_port {port} is in use (the rendezvous listens there)")
    return short


def train_nodes(lane: Lane) -> None:
    """Every worker's `moetune train` detached (re-attached on resume), then node 0's,
    watched with the workers: a worker that fails ends the run with its log's tail."""
    for w in lane.workers:
        pod = lane.state.node_pods[w.rank - 1]
        command = train_command(lane.cfg, lane.spec.gpu_count, w.rank)
        if w.provider.poll_background(pod, "train.log") not in (None, 0):
            w.provider.exec_background(pod, command, "train.log", env=lane.walls.env)

    def on_poll() -> None:
        lane.sync_checkpoints()
        check_workers(lane, wait_s=0)

    lane.attach_or_start("train.log", train_command(lane.cfg, lane.spec.gpu_count, 0), on_poll)
    check_workers(lane, wait_s=WORKER_EXIT_WAIT_S)


def check_workers(lane: Lane, wait_s: float) -> None:
    """LaneError when a worker's train ended non-zero; with `wait_s`, wait that long for
    each still running (node 0 is done: its peers end with it)."""
    deadline = time.monotonic() + wait_s
    for w in lane.workers:
        pod = lane.state.node_pods[w.rank - 1]
        while (rc := w.provider.poll_background(pod, "train.log")) is None and wait_s:
            if time.monotonic() > deadline:
                raise LaneError(f"node {w.rank} still trains {wait_s:g} s after node 0 ended",
                                "see its train.log; teardown ends it")  # fmt: skip
            time.sleep(min(lane.cfg.lane.poll_s, 1.0))
        if rc not in (None, 0):
            tail = w.provider.tail(pod, "train.log").strip()[-1500:]
            raise LaneError(
                f"train failed on node {w.rank} (pod {pod}, rc {rc}); last lines:\n{tail}",
                f"moetune launch {lane.state.config_path} --resume {lane.state.run_id}",
            )


def workers_spend(lane: Lane) -> float:
    """What the workers' pods cost so far (each one's highest reading kept)."""
    spent = lane.state.node_spent
    spent += [0.0] * (len(lane.state.node_pods) - len(spent))
    for n, (w, pod) in enumerate(zip(lane.workers, lane.state.node_pods, strict=False)):
        if pod:
            with suppress(PodGone, LaneError):  # gone: its last reading stands
                spent[n] = max(spent[n], w.provider.status(pod).spent_usd)
    return sum(spent)


def teardown_workers(lane: Lane) -> list[str]:
    """Terminate every worker's pod (retried; idempotent); the causes of those that failed."""
    pods = zip(lane.workers, lane.state.node_pods, strict=False)
    return [f"node {w.rank} ({pod}): {why}" for w, pod in pods if pod and (why := end(w, pod))]


def end(worker: Worker, pod: str) -> str:
    """Terminate one worker's pod, retried: "" when it ended, else the last cause."""
    for attempt in range(3):
        try:
            worker.provider.terminate(pod)
            return ""
        except LaneError as err:
            cause = err.cause
            time.sleep(2**attempt)
    return cause
