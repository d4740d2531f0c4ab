"""The remote lane's phases: provision → guard → stage → fetch base → train → BANK → eval →
fetch results → gate → promote, with teardown on every exit path.

Each phase is a method registered in `PHASES`; after each one the state is saved, so
`--resume RUN_ID` continues after a local crash. The adapter is copied off the pod and
verified (bank) before eval starts, so an eval overrun costs an eval, never the training
run. A pod that is gone on resume is replaced: phases whose results live on this machine
(bank, fetch results, gate, promote) stay done, the rest run again on the new pod.
"""

from __future__ import annotations

import secrets
import shlex
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape

from moetune.config import RunConfig, dump_config
from moetune.errors import MoetuneError
from moetune.io import adapter_digest
from moetune.lane import nodes
from moetune.lane.guard import Budget, deadman_script, idle_watchdog_script
from moetune.lane.providers.base import LaneError, Pod, PodGone, PodSpec, Provider
from moetune.lane.secrets import launch_secrets, scrub, scrub_error
from moetune.lane.stage import REMOTE_CONFIG, REMOTE_RUN, staging
from moetune.lane.state import LaneState
from moetune.ledger import Ledger, LedgerRow, Status
from moetune.model import load_spec
from moetune.plan.cost.walls import snapshot_bytes

PhaseFn = Callable[["Lane"], None]
PHASES: dict[str, PhaseFn] = {}
LOCAL_RESULTS = ("bank", "fetch_results", "gate", "promote")  # survive a lost pod
# Infra failures people search for (docs/knowledge.md §8): recorded as the row's signature.
SIGNATURES = (
    "Disk quota exceeded", "No space left on device", "Background writer channel closed",
    "CUDA out of memory", "Connection closed", "Connection refused", "Killed",
)  # fmt: skip


def phase(name: str) -> Callable[[PhaseFn], PhaseFn]:
    def add(fn: PhaseFn) -> PhaseFn:
        PHASES[name] = fn
        return fn

    return add


class BudgetReached(LaneError):
    """The run's spend reached lane.max_usd."""


@dataclass
class Walls:
    """The four walls as this launch applies them (sized in `moetune.lane.plan`)."""

    volume_gb: int
    watchdog_s: int
    env: dict[str, str]


class Lane:
    """One launch: a config, a provider, the persisted state and the local outputs."""

    def __init__(
        self, cfg: RunConfig, provider: Provider, state: LaneState, walls: Walls,
        spec: PodSpec, console: Console | None = None, workers: list[nodes.Worker] | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.provider, self.state, self.walls, self.spec = (
            cfg,
            provider,
            state,
            walls,
            spec,
        )
        self.console = console or Console(stderr=True)
        self.workers = workers or []  # nodes 1 … N-1 of a multi-node run (lane.nodes)
        self.out = Path(cfg.output.dir)
        self.secrets = launch_secrets(cfg)  # masked in every row, message and error
        self.ledger = Ledger(cfg.output.ledger, secrets=self.secrets)

    # ------------------------------------------------------------ running the phases

    def run(self) -> LaneState:
        """Every phase not yet done, in order; teardown whatever happens."""
        if self.state.finished:
            return self.state
        self._forget_lost_pod()
        try:
            with _signals_raise():
                for name, fn in PHASES.items():
                    if name not in self.state.done:
                        self.say(f"[bold]{name}[/]")
                        fn(self)
                        self.state.done.append(name)
                        self.save()
            self.state.finished = True
        except BaseException as err:
            if isinstance(err, KeyboardInterrupt | BudgetReached):
                self.salvage()
            self.failed(err)
            raise
        finally:
            self.teardown()
            self.save()
        return self.state

    def save(self) -> None:
        self.state.save(self.cfg.output.ledger)

    def say(self, text: str) -> None:
        shown = scrub(text, self.secrets)
        self.console.print(f"[dim]{escape(self.state.run_id)}[/] {shown}", highlight=False)

    def row(self, kind: str, status: Status = "ok", reason: str = "", **metrics: Any) -> None:
        """A ledger row of this launch; `cost_usd` goes to the row's cost field."""
        cost = metrics.pop("cost_usd", None)
        base: dict[str, Any] = {"provider": self.state.provider, "pod_id": self.state.pod_id}
        if self.workers:
            base["nodes"] = len(self.workers) + 1
        if self.state.accept_thin_margin:
            base["accept_thin_margin"] = True
        self.ledger.append(
            LedgerRow(
                kind=kind,
                status=status,
                run_id=self.state.run_id,
                reason=reason[:300],
                metrics=base | metrics,
                cost_usd=cost,
            )
        )

    def _forget_lost_pod(self) -> None:
        """On resume: a pod that is gone (torn down, reaped, died) takes its pod-side phases
        with it; a replacement gets a new name (names are create's idempotency key)."""
        if not self.state.done:
            return
        alive = False
        if self.state.pod_id is not None:
            with suppress(PodGone):
                alive = self.provider.status(self.state.pod_id).status in ("running", "starting")
        if alive:
            return
        self.say("the earlier pod is gone; a new one takes over")
        nodes.teardown_workers(self)  # its peers go too: the new nodes rendezvous afresh
        self.state.node_pods = []
        self.state.done = [p for p in self.state.done if p in LOCAL_RESULTS]
        self.state.pod_id = None
        self.state.pod_name = f"{self.state.pod_name.rsplit('-', 1)[0]}-{secrets.token_hex(3)}"
        self.spec = replace(self.spec, name=self.state.pod_name)

    def pod_work_left(self) -> bool:
        """Whether anything still needs a pod: training (until banked) or eval (until its
        results are here)."""
        needs_eval = bool(self.cfg.eval.rungs) and "fetch_results" not in self.state.done
        return not self.state.banked or needs_eval

    @property
    def pod(self) -> str:
        assert self.state.pod_id is not None
        return self.state.pod_id

    # ------------------------------------------------------------ failure and teardown

    def failed(self, err: BaseException) -> None:
        """A ledger row for the failure and the clear next step; the error's text masked."""
        scrub_error(err, self.secrets)
        cause = getattr(err, "cause", None) or f"{type(err).__name__}: {err}"
        status: Status = "cancelled" if isinstance(err, KeyboardInterrupt | BudgetReached) else (
            "infra-failed" if isinstance(err, PodGone | LaneError) else "failed"
        )  # fmt: skip
        banked = (self.state.banked or {}).get("dir")
        if banked:
            self.state.next_step = (
                f"the adapter is banked at {banked}; evaluate it here: moetune eval "
                f"{self.state.config_path} --adapter {banked} --provider local"
            )
        else:
            self.state.next_step = (
                f"moetune launch {self.state.config_path} --resume {self.state.run_id}"
            )
        signature = next((sig for sig in SIGNATURES if sig in str(cause)), None)
        cost = self.spend() if self.state.pod_id else None
        done = list(self.state.done)
        self.row("launch", status, str(cause), phases_done=done, signature=signature, cost_usd=cost)
        if isinstance(err, MoetuneError):
            err.fix = self.state.next_step if banked else err.fix
        else:
            self.say(f"next: {escape(self.state.next_step)}")

    def teardown(self) -> None:
        """Terminate every node's pod (retried; idempotent) and ledger what they all cost."""
        if self.state.pod_id is None:
            return
        spent = self.spend()
        extra: dict[str, Any] = {"node_pods": self.state.node_pods} if self.workers else {}
        failed = nodes.teardown_workers(self)
        for attempt in range(3):
            try:
                self.provider.terminate(self.state.pod_id)
                break
            except LaneError as err:
                if attempt == 2:
                    failed.append(err.cause)
                time.sleep(0 if attempt == 2 else 2**attempt)
        if failed:
            self.row("teardown", "infra-failed", "; ".join(failed), cost_usd=spent, **extra)
            return
        self.row("teardown", cost_usd=spent, **extra)
        self.say(f"pod {self.state.pod_id} terminated (${spent:.2f})")
        self.state.pod_id = None

    def spend(self) -> float:
        """What every node's pod cost so far (the budget counts them all)."""
        elsewhere = nodes.workers_spend(self)
        try:
            pod = self.provider.status(self.pod)
        except (PodGone, LaneError):
            return round(self.state.spent_usd, 4)
        self.state.spent_usd = max(self.state.spent_usd, pod.spent_usd + elsewhere)
        return round(self.state.spent_usd, 4)

    # ------------------------------------------------------------ pod commands

    def run_on_pod(
        self, command: str, timeout_s: float = 600, on: tuple[Provider, str] | None = None
    ) -> str:
        """`command` on the pod (or node `on`) with the walls' env (secrets included:
        process env only)."""
        provider, pod = on or (self.provider, self.pod)
        got = provider.exec(pod, command, timeout_s, env=self.walls.env)
        if got.rc != 0:
            raise LaneError(
                f"`{command.split()[0]}` failed on pod {pod} (rc {got.rc}): "
                f"{(got.stderr or got.stdout).strip()[-300:]}",
                "see the output above; fix it and `moetune launch --resume`",
            )
        return got.stdout

    def wait_background(self, log: str, on_poll: Callable[[], None] = lambda: None) -> None:
        """Start-and-wait done by polling: a drop or restart of this side never stops the pod's
        work; each poll checks the pod is alive and the budget holds."""
        budget = Budget(self.cfg.lane.max_usd)
        while (rc := self.provider.poll_background(self.pod, log)) is None:
            on_poll()
            spent = self.spend()
            if budget.check(spent):
                raise BudgetReached(
                    f"spend ${spent:.2f} reached lane.max_usd ${self.cfg.lane.max_usd}",
                    "raise lane.max_usd, or resume with --resume once you decide",
                )
            time.sleep(self.cfg.lane.poll_s)
        if rc != 0:
            tail = self.provider.tail(self.pod, log)
            raise LaneError(
                f"{log} failed on pod {self.pod} (rc {rc}); last lines:\n{tail.strip()[-1500:]}",
                f"moetune launch {self.state.config_path} --resume {self.state.run_id}",
            )

    def moetune(self, args: str) -> str:
        return f"{self.cfg.lane.remote_moetune} {args}"

    def attach_or_start(
        self, log: str, command: str, on_poll: Callable[[], None] = lambda: None
    ) -> None:
        """Wait for `log`'s command: re-attach when an earlier controller started it on this
        pod (a resumed launch), start it otherwise; LaneError unless it exits 0."""
        rc = self.provider.poll_background(self.pod, log)
        if rc != 0:
            if rc is not None:  # never started, or died: (re)start it
                self.provider.exec_background(self.pod, command, log, env=self.walls.env)
            self.wait_background(log, on_poll)

    def sync_checkpoints(self) -> None:
        """Mirror the pod's run dir here whenever it commits a new checkpoint, so a lost pod
        costs the steps since then, not the run (a new pod resumes from the mirror)."""
        newest = self.provider.exec(
            self.pod, f"ls -v {REMOTE_RUN}/checkpoints 2>/dev/null | tail -n 1"
        ).stdout.strip()
        if not newest or newest == self.state.synced:
            return
        with suppress(LaneError):  # a checkpoint rotated away mid-copy: the next poll retries
            self.provider.copy_out(
                self.pod, REMOTE_RUN, self.state.sync_dir(self.cfg.output.ledger)
            )
            self.state.synced = newest
            self.save()

    def salvage(self) -> None:
        """Stopped mid-training (budget, Ctrl-C): copy the committed checkpoints off the pod."""
        if self.state.banked or self.state.pod_id is None or "stage" not in self.state.done:
            return
        with suppress(LaneError):
            self.provider.copy_out(self.pod, f"{REMOTE_RUN}/checkpoints", self.out / "checkpoints")
            self.row(
                "bank", "cancelled", "partial: checkpoints only", dir=str(self.out / "checkpoints")
            )


@contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGTERM/SIGHUP end the run like Ctrl-C does, so teardown runs (finally)."""

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


# ---------------------------------------------------------------- the phases, in order


@phase("provision")
def provision(lane: Lane) -> None:
    if not lane.pod_work_left():
        return
    pod = lane.provider.create(lane.spec)
    lane.state.pod_id = pod.id
    lane.save()  # the id is recorded before anything else can fail: reap-by-id stays possible
    lane.row("provision", pod_name=pod.name, card=lane.spec.card, cost_per_hr=pod.cost_per_hr,
             volume_gb=lane.spec.volume_gb)  # fmt: skip
    ready: Pod = lane.provider.wait_ready(pod.id, lane.cfg.lane.ready_timeout_s)
    lane.state.workdir = ready.workdir
    lane.say(f"pod {escape(pod.id)} ready ({lane.state.provider})")
    nodes.provision_workers(lane)


@phase("guard")
def guard(lane: Lane) -> None:
    """The dead-man switch first: whatever happens here, the pod ends by the deadline."""
    if not lane.pod_work_left():
        return
    for provider, pod in nodes.pod_ids(lane):  # every node ends by the deadline
        kill = provider.self_terminate_command(pod)
        provider.exec_background(pod, deadman_script(lane.walls.watchdog_s, kill), "deadman.log")
        if lane.spec.card and provider.remote:
            lane_args = lane.cfg.lane
            idle = idle_watchdog_script(lane_args.idle_gpu_percent, lane_args.idle_minutes, kill)
            provider.exec_background(pod, idle, "idlewatch.log")


@phase("stage")
def stage(lane: Lane) -> None:
    if not lane.pod_work_left():
        return
    plan = staging(lane.cfg)
    config = lane.state.dir(lane.cfg.output.ledger) / REMOTE_CONFIG
    config.write_text(dump_config(plan.config))
    for provider, pod in nodes.pod_ids(lane):  # every node trains from the same files
        for local, remote in [*plan.files, (config, REMOTE_CONFIG)]:
            provider.copy_in(pod, local, remote)
        for command in lane.cfg.lane.setup:
            lane.run_on_pod(command, timeout_s=1800, on=(provider, pod))
    mirror = lane.state.sync_dir(lane.cfg.output.ledger)
    if mirror.is_dir():  # a replacement pod: training resumes from the last mirrored checkpoint
        lane.provider.copy_in(lane.pod, mirror, REMOTE_RUN)
    if lane.state.banked:  # a replacement pod for eval: it scores the banked adapter
        lane.provider.copy_in(lane.pod, Path(lane.state.banked["dir"]), f"{REMOTE_RUN}/adapter")


@phase("fetch_base")
def fetch_base(lane: Lane) -> None:
    """Hub bases download on the pod, hf-xet off, after checking the disk can hold them."""
    if not lane.pod_work_left():
        return
    if lane.workers and not lane.state.banked:
        nodes.check_walls(lane)  # disk, RAM, port on every node before any downloads
    if Path(lane.cfg.model.id).exists():
        return
    need = snapshot_bytes(load_spec(lane.cfg.model.id))
    for target in nodes.pod_ids(lane) if not lane.state.banked else [(lane.provider, lane.pod)]:
        free = int(lane.run_on_pod("df -B1 --output=avail . | tail -1", on=target).strip() or 0)
        if free < need:
            raise LaneError(
                f"pod disk has {free / 1e9:.0f} GB free, the snapshot needs {need / 1e9:.0f} GB",
                "raise lane.volume_gb (the walls size it from the model; was it overridden?)",
            )
        repo = shlex.quote(lane.cfg.model.id)
        lane.run_on_pod(
            "python3 -c 'import sys; from huggingface_hub import snapshot_download; "
            f"snapshot_download(sys.argv[1])' {repo}",
            timeout_s=6 * 3600,
            on=target,
        )


@phase("train")
def train(lane: Lane) -> None:
    if lane.state.banked:
        return
    if lane.workers:
        nodes.train_nodes(lane)
        return
    command = nodes.train_command(lane.cfg, lane.spec.gpu_count)
    lane.attach_or_start("train.log", command, on_poll=lane.sync_checkpoints)


RUN_FILES = ("config.yaml", "versions.json", "preflight.json", "data.json", "coverage.json",
             "metrics.jsonl", "routing.jsonl", "summary.json")  # fmt: skip


@phase("bank")
def bank(lane: Lane) -> None:
    """The adapter off the pod, verified, before anything else can go wrong."""
    adapter = lane.out / "adapter"
    lane.provider.copy_out(lane.pod, f"{REMOTE_RUN}/adapter", adapter)
    digest = adapter_digest(adapter)  # the digest eval records: banked = evaluated
    lane.state.banked = {"dir": str(adapter), "sha256": digest}
    lane.save()
    lane.row("bank", adapter=str(adapter), sha256=digest)
    lane.say(f"adapter banked at {escape(str(adapter))}")
    merge_pod_ledger(lane)  # the pod's train row, before the pod can be lost
    for name in RUN_FILES:  # the run's record, for the report; an absent one is not fatal
        with suppress(LaneError):
            lane.provider.copy_out(lane.pod, f"{REMOTE_RUN}/{name}", lane.out / name)


@phase("eval")
def evaluate(lane: Lane) -> None:
    if not lane.cfg.eval.rungs or "fetch_results" in lane.state.done:
        return
    # --no-gate-exit: a NO-GO is a result the gate phase decides here, not a failed command
    command = f"eval {REMOTE_CONFIG} --overwrite --json --no-gate-exit"
    lane.attach_or_start("eval.log", lane.moetune(command))


@phase("fetch_results")
def fetch_results(lane: Lane) -> None:
    if lane.cfg.eval.rungs:
        lane.provider.copy_out(lane.pod, f"{REMOTE_RUN}/eval", lane.out / "eval")
    merge_pod_ledger(lane)


def merge_pod_ledger(lane: Lane) -> None:
    """The pod's own ledger rows (train, eval, gate) join the local ledger, once each."""
    copy = lane.state.dir(lane.cfg.output.ledger) / "pod-ledger.jsonl"
    try:
        lane.provider.copy_out(lane.pod, "ledger.jsonl", copy)
    except LaneError:
        return
    seen = {r.id for r in lane.ledger.read().rows}
    for row in Ledger(copy).read().rows:
        if row.id not in seen:
            lane.ledger.append(row.model_copy(update=as_launched(row, lane.cfg, lane.state.run_id)))


def as_launched(row: LedgerRow, cfg: RunConfig, run_id: str) -> dict[str, Any]:
    """A pod row's fields under this launch: its run id, and – a train row's measured rate
    being keyed by its step signature – the base as the launch names it, not the pod's
    staged copy ("model"), so the next launch of this config on that card finds it."""
    signature = row.metrics.get("signature")
    if row.kind != "train" or not isinstance(signature, dict):
        return {"run_id": run_id}
    metrics = {**row.metrics, "signature": {**signature, "model": cfg.model.id}}
    return {"run_id": run_id, "metrics": metrics}


@phase("gate")
def gate(lane: Lane) -> None:
    # lazy: heavy to import (torch via moetune.evaluate)
    from moetune.evaluate import gate_results

    if not lane.cfg.eval.rungs:
        return
    doc = gate_results(lane.out / "eval", ledger=lane.cfg.output.ledger)
    lane.state.verdict = doc["verdict"]
    lane.say(f"gate: {doc['verdict']} – {escape(doc['reason'])}")


@phase("promote")
def promote(lane: Lane) -> None:
    # lazy: heavy to import (torch via moetune.evaluate)
    from moetune.evaluate import promote as promote_adapter

    if lane.state.verdict == "GO" and lane.state.banked:
        marker = promote_adapter(
            lane.out / "eval", lane.cfg.output.ledger, adapter=Path(lane.state.banked["dir"])
        )
        lane.state.promoted = str(marker)
