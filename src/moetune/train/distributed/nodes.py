"""Several nodes: `moetune train RUN --nproc N --nnodes M --node-rank K --master-addr A
--master-port P`, the same command on each of M machines (K = 0 … M-1).

Each launcher starts its N ranks through accelerate's multi-node launch (num_machines,
machine_rank, main_process_ip / port: torchrun's static rendezvous at A:P, hosted by node
0). Global rank 0 – node 0, local rank 0 – alone ledgers and writes the run dir, its
summary and the adapter, as on one node (trainer.py, setup.py). Every rank writes its RNG
state into the staged checkpoint, as on one node, so `--resume` needs output.dir on
storage the nodes share. The launcher of node K > 0 keeps its accelerate config in a
temporary folder, reads no summary and reports only that its ranks ended.

A node that dies takes its ranks with it (the launcher's PDEATHSIG, then torchrun stops
its workers); the ranks of the other nodes see their peers' sockets close at the next
collective (gloo: "Connection closed by peer", NCCL: a remote error) and stop, and rank 0
ledgers the attempt failed with a cause that says a node died. A node that vanishes
without closing its sockets is bounded by the collective timeout (TrainingArguments'
ddp_timeout, 30 min by default) and torchrun's rendezvous timeout (10 min) at start.

Node K > 0 waits for node 0 at most train.rdzv_timeout_s, whatever answers there: a port
that accepts is not taken for node 0 until torch's own TCPStore client, run in a child
process killed at the deadline, has connected to it (torchrun's client waits on another
service's silence forever).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetune.config import RunConfig
from moetune.config.keys import offload_mode
from moetune.config.sections import TrainArgs
from moetune.model import load_spec
from moetune.plan.devices.host_ram import host_ram
from moetune.plan.devices.sharding import run_sizes
from moetune.train.errors import TrainError
from moetune.units import human_bytes

# Where this process runs, not what it trains: a node's --resume may differ in them.
NODE_KEYS = ("train.node_rank", "train.master_addr", "train.master_port", "train.rdzv_timeout_s")
# What torch's gloo and NCCL backends raise when a peer rank's process is gone.
PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "nccl communicator was aborted",
)


def world(t: TrainArgs) -> int:
    """Ranks over all nodes: train.nproc on each of train.nnodes."""
    return t.nproc * t.nnodes


def check_nodes(t: TrainArgs) -> None:
    """Refuse a multi-node launch that cannot rendezvous, before anything is written."""
    if t.nnodes > 1 and not t.master_addr:
        raise TrainError(
            f"train.nnodes={t.nnodes} but no train.master_addr: the nodes cannot find node 0",
            "pass --master-addr with node 0's address (the same on every node)",
        )
    if t.node_rank >= t.nnodes:
        raise TrainError(
            f"train.node_rank={t.node_rank} with train.nnodes={t.nnodes}: ranks are 0 to "
            f"{t.nnodes - 1}",
            f"pass --node-rank between 0 and {t.nnodes - 1} (0 on the node at master_addr)",
        )
    if t.nnodes > 1 and t.master_addr:
        check_address(t.master_addr)


ADDRESS_FIX = "pass --master-addr with node 0's IP address or a host name that resolves"


def check_address(addr: str) -> None:
    """Refuse a master address that does not parse (999.1.1.1) or resolve: torchrun would
    retry it until its rendezvous times out, printing only its own warnings."""
    looks_numeric = re.fullmatch(r"[0-9.]+", addr) or ":" in addr
    if looks_numeric:
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            raise TrainError(
                f"train.master_addr {addr!r} is not an IP address", ADDRESS_FIX
            ) from None
        return
    try:
        socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as err:
        why = getattr(err, "strerror", None) or str(err)
        raise TrainError(
            f"train.master_addr {addr!r} does not resolve ({why})", ADDRESS_FIX
        ) from None


def await_master(t: TrainArgs, say: Callable[[str], None]) -> None:
    """Node K > 0: wait (up to train.rdzv_timeout_s) for node 0 to listen at master_addr:
    master_port, saying whom it awaits; node 0: say how long it waits for the others."""
    where = f"{t.master_addr}:{t.master_port}"
    if t.nnodes == 1:
        return
    if t.node_rank == 0:
        say(f"node 0 of {t.nnodes}: waiting up to {t.rdzv_timeout_s} s for the other "
            f"{t.nnodes - 1} node(s) to join at {where} (train.rdzv_timeout_s)")  # fmt: skip
        return
    say(f"node {t.node_rank} of {t.nnodes}: waiting up to {t.rdzv_timeout_s} s for node 0 "
        f"at {where}")  # fmt: skip
    deadline = time.monotonic() + t.rdzv_timeout_s
    if not _answers(str(t.master_addr), t.master_port, t.rdzv_timeout_s):
        raise TrainError(
            f"node 0 did not answer at {where} within {t.rdzv_timeout_s} s (train.rdzv_timeout_s)",
            "start node 0's launcher (--node-rank 0) with the same --master-addr and "
            "--master-port, check that port is open between the nodes, or raise --rdzv-timeout",
        )
    # Something accepts there; only torch's store may be trusted to end the wait: torchrun's
    # client waits on any other listener's silence past every timeout it is given.
    if not _is_store(str(t.master_addr), t.master_port, deadline - time.monotonic()):
        raise TrainError(
            f"something answers at {where} but is not node 0's rendezvous (torch's TCPStore "
            f"did not reply within {t.rdzv_timeout_s} s, train.rdzv_timeout_s)",
            "another service holds that port on node 0: pass --master-port with a free port "
            "on every node (and start node 0's launcher first)",
        )


# Run in a child so the wait can be ended at the deadline whatever the listener does.
STORE_PROBE = (
    "import datetime, sys\n"
    "from torch.distributed import TCPStore\n"
    "TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, wait_for_workers=False,\n"
    "         timeout=datetime.timedelta(seconds=float(sys.argv[3])))\n"
)


def _is_store(host: str, port: int, within_s: float) -> bool:
    """Whether a torch TCPStore client connects to host:port within `within_s` (a child
    process, killed at the deadline: the client itself may never return)."""
    left = max(within_s, 1.0)
    argv = [sys.executable, "-c", STORE_PROBE, host, str(port), f"{left:g}"]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=left)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def never_met(cfg: RunConfig, started: float) -> TrainError | None:
    """Node 0's failed launch that lasted the whole rendezvous timeout and wrote nothing in
    the run dir (its rank 0 writes there once the nodes have met): the others never came."""
    t = cfg.train
    if t.nnodes == 1 or t.node_rank != 0 or time.time() - started < t.rdzv_timeout_s:
        return None
    root = Path(cfg.output.dir)
    if any(p.stat().st_mtime >= started for p in root.rglob("*") if p.name != "accelerate.yaml"):
        return None
    return TrainError(
        f"the other {t.nnodes - 1} node(s) did not join node 0 at {t.master_addr}:"
        f"{t.master_port} within {t.rdzv_timeout_s} s (train.rdzv_timeout_s)",
        "start every node's launcher with the same --nnodes, --master-addr and "
        "--master-port (each its own --node-rank), or raise --rdzv-timeout",
    )


def _answers(host: str, port: int, within_s: float) -> bool:
    """Whether something accepts a TCP connection at host:port before `within_s` ends."""
    deadline = time.monotonic() + within_s
    while True:
        left = deadline - time.monotonic()
        with contextlib.suppress(OSError), socket.create_connection((host, port), max(left, 0.1)):
            return True
        if left <= 0:
            return False
        time.sleep(min(0.5, max(left, 0.0)))


def check_one_process(cfg: RunConfig) -> None:
    """Refuse, in the launcher, train.offload on several ranks – never let each rank refuse
    it inside, after its own trace – but under train.strategy ep, where each rank streams its
    own experts (engine/offload/load.py's `part`; under train.ep_placement balanced its
    placed ones, `hold_experts`); there, what cannot reach the stores."""
    t = cfg.train
    if not offload_mode(t.offload).streams or world(t) == 1:
        return
    fix = "set train.offload: none"
    if t.strategy != "ep":
        raise TrainError(
            f"train.offload={t.offload} streams one process's expert stacks under "
            f"train.strategy {t.strategy}, and this launch asks for {world(t)} "
            f"({t.nproc} per node × {t.nnodes} node(s))",
            f"set train.strategy: ep (each rank streams its own experts), pass --nproc 1 "
            f"--nnodes 1, or {fix}",
        )
    if t.ep_degree is not None:
        raise TrainError(
            f"train.offload={t.offload} with train.ep_degree {t.ep_degree}: FSDP2 shards the "
            "rest over expert groups, and the offloaded stacks are no parameters it can hold",
            f"drop train.ep_degree (one expert group over every rank), or {fix}",
        )


def check_port(t: TrainArgs) -> None:
    """Node 0 hosts the rendezvous on master_port: refuse a port something listens on
    (accelerate would raise ConnectionError with its trace once the launch has begun)."""
    if t.nnodes == 1 or t.node_rank != 0:
        return
    with socket.socket() as sock:
        sock.settimeout(1.0)
        busy = sock.connect_ex(("127.0.0.1", t.master_port)) == 0
    if busy:
        raise TrainError(
            f"train.master_port {t.master_port} is in use on this node (node 0 listens there)",
            "pass --master-port with a free port, the same on every node",
        )


def check_devices(t: TrainArgs, device: str) -> None:
    """N ranks per node take one GPU each – or, on CPU, one core each (more ranks than
    cores only thrash, each paying its ~0.5 GB of RAM): refuse more ranks than that."""
    if device != "cuda":
        cores = len(os.sched_getaffinity(0))  # the cores this process may use, not the host's
        if t.nproc > cores:
            raise TrainError(
                f"train.nproc={t.nproc} CPU ranks on this node, which lets this process use "
                f"{cores} core(s)",
                f"pass --nproc {cores} or fewer (one rank per core)",
            )
        return
    # lazy: heavy to import (torch)
    import torch

    have = torch.cuda.device_count()
    if t.nproc > have:
        raise TrainError(
            f"train.nproc={t.nproc} ranks on this node, which has {have} GPU(s)",
            f"pass --nproc {have} or fewer (one rank per GPU), or train.device: cpu",
        )


def check_host_ram(cfg: RunConfig) -> None:
    """Refuse a launch whose ranks need more host RAM than this node has free: the plan's
    figure for this node's train.nproc ranks (each rank's runtime, measured, plus the base
    as the strategy loads it – plan.sharding.host_ram)."""
    t = cfg.train
    need = node_ram_bytes(cfg)
    free = available_ram_bytes()
    if need > free:
        raise TrainError(
            f"train.nproc={t.nproc} ranks need about {human_bytes(need)} of host RAM at load "
            f"(the plan's figure for this node), and {human_bytes(free)} is free",
            f"pass a smaller --nproc (about {max(1, t.nproc * free // need)}), or free memory",
        )


def node_ram_bytes(cfg: RunConfig) -> int:
    """Host RAM this node's ranks need at load, from the plan (plan.sharding.host_ram)."""
    sizes = run_sizes(load_spec(cfg.model.id), cfg)
    return host_ram(sizes, cfg.train.nproc, cfg.train.strategy, world(cfg.train)).per_node_bytes


def available_ram_bytes() -> int:
    """Host RAM free for new processes now (psutil's `available`)."""
    # lazy: heavy to import (psutil)
    import psutil

    return int(psutil.virtual_memory().available)


def machine_fields(t: TrainArgs, port: int) -> dict[str, Any]:
    """accelerate config keys for the machines: num_processes counts every node's ranks."""
    fields: dict[str, Any] = {
        "num_machines": t.nnodes,
        "machine_rank": t.node_rank,
        "num_processes": world(t),
        "main_process_port": port if t.nnodes == 1 else t.master_port,
    }
    if t.nnodes > 1:
        fields["main_process_ip"] = t.master_addr
    return fields


@contextlib.contextmanager
def config_home(cfg: RunConfig) -> Iterator[Path]:
    """Where the launcher writes accelerate.yaml: the run dir on node 0 (created here), a
    temporary folder on the others, which write nothing in the user's output dir."""
    if cfg.train.node_rank == 0:
        root = Path(cfg.output.dir)
        root.mkdir(parents=True, exist_ok=True)
        yield root
        return
    with tempfile.TemporaryDirectory(prefix=f"moetune-node{cfg.train.node_rank}-") as tmp:
        yield Path(tmp)


def peer_gone(exc: BaseException) -> bool:
    """An error that says another rank's process is gone (its node died)."""
    text = str(exc).lower()
    return any(marker in text for marker in PEER_GONE)


@contextlib.contextmanager
def node_loss_stops(cfg: RunConfig) -> Iterator[None]:
    """A collective whose peers vanished ends the attempt with one line that says so (the
    ledger row's cause), not with the backend's trace."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        if world(cfg.train) == 1 or not peer_gone(exc):
            raise
        raise TrainError(
            f"a node died: another rank of the {world(cfg.train)} on {cfg.train.nnodes} node(s) "
            f"is gone ({_first_sentence(str(exc))})",
            "restart every node's launcher with --resume once the node is back",
        ) from None


def _first_sentence(text: str) -> str:
    """The backend's message without its source location ("[…/pair.cc:537] Read error …")."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line.split(". ")[0][:200]


@dataclass(frozen=True)
class NodeDone:
    """What the launcher of node K > 0 reports: node 0 holds the run's results."""

    node_rank: int
    nnodes: int
    nproc: int

    def to_json(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "nnodes": self.nnodes, "nproc": self.nproc,
                "status": "ok", "results_on": "node 0"}  # fmt: skip

    def line(self) -> str:
        return (
            f"node {self.node_rank} of {self.nnodes}: its {self.nproc} rank(s) finished; "
            "node 0 wrote the run dir, summary and ledger row"
        )
