"""The cost guard (moetune.lane.guard): in-pod scripts run for real with sh, the budget, and
the orphan sweep that must never touch a pod it cannot prove is moetune's."""

from __future__ import annotations

import json
import math
import os
import random
import shlex
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from moetune.lane import guard
from moetune.lane.guard import (
    Budget,
    deadman_script,
    held_pod_ids,
    idle_watchdog_script,
    own_pod_ids,
    reap,
    state_pod_ids,
    sweep_targets,
)
from moetune.lane.providers.base import (
    LaneError,
    Pod,
    PodGone,
    PodStatus,
    Provider,
    TransientError,
)
from moetune.ledger import Ledger, LedgerRow

DEAD_PID = 2**31 - 1  # above any pid_max: never a live process, so never flaky
TRICKY = """touch "it's done" 'and $HOME' && echo "a;b|c" > out"""  # quotes, $, ; and |


def _wait_for(path: Path, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists():
            return True
        time.sleep(0.05)
    return path.exists()


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Any]:
    """Start a script with sh in tmp_path, a fake-bin dir first on PATH; kill leftovers."""
    procs: list[subprocess.Popen[str]] = []
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"}

    def start(script: str, shell: str = "sh") -> subprocess.Popen[str]:
        proc = subprocess.Popen([shell, "-c", script], cwd=tmp_path, env=env, text=True)
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _fake_smi(tmp_path: Path, reading: str) -> Path:
    """A `nvidia-smi` on PATH that prints whatever the file `util` holds now."""
    util = tmp_path / "util"
    util.write_text(reading)
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text(f"#!/bin/sh\ncat {shlex.quote(str(util))}\n")
    smi.chmod(0o755)
    return util


# ---------------------------------------------------------------- dead-man switch


def test_deadman_terminates_at_the_deadline_and_not_before(spawn: Any, tmp_path: Path) -> None:
    proc = spawn(deadman_script(2, "touch terminated"))
    time.sleep(0.7)
    assert not (tmp_path / "terminated").exists()
    assert proc.wait(timeout=20) == 0
    assert (tmp_path / "terminated").exists()
    log = (tmp_path / guard.GUARD_LOG).read_text()
    assert "armed: terminating this pod in 2 s" in log and "terminated" in log


def test_deadman_retries_a_failing_terminate(spawn: Any, tmp_path: Path) -> None:
    flaky = "if [ -e tried ]; then touch terminated; else touch tried; exit 3; fi"
    assert spawn(deadman_script(0, flaky, retry_s=0.1)).wait(timeout=20) == 0
    assert (tmp_path / "terminated").exists()
    assert "terminate attempt 2" in (tmp_path / guard.GUARD_LOG).read_text()


def test_deadman_gives_up_after_its_attempts_and_says_so(spawn: Any, tmp_path: Path) -> None:
    assert spawn(deadman_script(0, "exit 7", attempts=3, retry_s=0)).wait(timeout=20) == 1
    log = (tmp_path / guard.GUARD_LOG).read_text()
    assert log.count("terminate attempt") == 3 and "failed 3 times" in log


def test_quoting_survives_nohup_detaching(spawn: Any, tmp_path: Path) -> None:
    """The documented launch form: `nohup sh -c '<script>' &` returns at once."""
    detached = f"nohup sh -c {shlex.quote(deadman_script(1, TRICKY))} >/dev/null 2>&1 &"
    started = time.monotonic()
    assert spawn(detached).wait(timeout=10) == 0
    assert time.monotonic() - started < 1.0  # detached: the deadline has not passed
    assert _wait_for(tmp_path / "out", 20)
    assert (tmp_path / "it's done").exists() and (tmp_path / "and $HOME").exists()
    assert (tmp_path / "out").read_text() == "a;b|c\n"


def test_scripts_survive_the_providers_background_wrapper(spawn: Any, tmp_path: Path) -> None:
    """Provider.exec_background runs `( <script> ) > log 2>&1` under bash, on one line."""
    _fake_smi(tmp_path, "0\n")
    for script in (deadman_script(0, TRICKY), idle_watchdog_script(5, 0, TRICKY, poll_s=0.1)):
        (tmp_path / "out").unlink(missing_ok=True)
        wrapped = f"( {script} ) > bg.log 2>&1; echo $? > bg.rc"
        assert spawn(wrapped, shell="bash").wait(timeout=20) == 0
        assert (tmp_path / "bg.rc").read_text() == "0\n"
        assert (tmp_path / "out").read_text() == "a;b|c\n"


# ---------------------------------------------------------------- GPU-idle watchdog


def test_idle_watchdog_spares_busy_and_unreadable_gpus_then_reaps_idle(
    spawn: Any, tmp_path: Path
) -> None:
    util = _fake_smi(tmp_path, "[N/A]\n")  # no reading: not idle
    proc = spawn(idle_watchdog_script(5, 1 / 60, "touch terminated", poll_s=0.1))
    time.sleep(1.5)
    util.write_text("0\n90\n")  # one busy GPU keeps the pod: the busiest counts
    time.sleep(2.0)
    assert not (tmp_path / "terminated").exists()
    assert proc.poll() is None
    util.write_text("0\n3.5\n")  # every GPU under 5 %
    assert proc.wait(timeout=20) == 0
    assert (tmp_path / "terminated").exists()
    log = (tmp_path / guard.GUARD_LOG).read_text()
    order = [log.index(f"GPU {state}") for state in ("none", "busy", "idle")]
    assert order == sorted(order) and "idle for" in log


def test_idle_watchdog_without_nvidia_smi_exits_quietly(spawn: Any, tmp_path: Path) -> None:
    script = idle_watchdog_script(5, 0, "touch terminated", smi="no-such-smi-here")
    assert spawn(script).wait(timeout=10) == 0
    assert not (tmp_path / "terminated").exists()
    assert "no-such-smi-here not found" in (tmp_path / guard.GUARD_LOG).read_text()


def test_scripts_refuse_nonsense_settings() -> None:
    with pytest.raises(ValueError):
        deadman_script(-1, "true")
    with pytest.raises(ValueError):
        idle_watchdog_script(5, 10, "true", poll_s=0)


# ---------------------------------------------------------------- budget


def _pod(cost: float = 2.0, uptime: float = 1800.0, **kw: Any) -> Pod:
    return Pod(**{"id": "p1", "name": "moetune-x", "status": "running"} | kw,
               cost_per_hr=cost, uptime_s=uptime)  # fmt: skip


def test_budget_check_is_reached_at_the_limit() -> None:
    assert not Budget(None).check(1e9)
    assert not Budget(10).check(9.99)
    assert Budget(10).check(10) and Budget(10).check(12)


def test_budget_spend_and_time_left() -> None:
    pod = _pod(cost=2.0, uptime=1800)
    assert Budget(10).spent(pod) == pytest.approx(1.0)
    assert Budget(10).spent(pod, extra_uptime_s=1800) == pytest.approx(2.0)
    assert Budget(10).remaining_s(pod) == pytest.approx(9 / 2 * 3600)
    assert Budget(10).remaining_s(pod, spent_elsewhere_usd=8) == pytest.approx(0.5 * 3600)
    assert Budget(10).remaining_s(pod, spent_elsewhere_usd=50) == 0.0
    assert Budget(None).remaining_s(pod) == math.inf
    assert Budget(10).remaining_s(_pod(cost=0)) == math.inf  # a local "pod" costs nothing


# ---------------------------------------------------------------- orphan sweep


def _scenario(rng: random.Random) -> tuple[list[Pod], set[str], set[str], list[LedgerRow]]:
    """Own pods and foreign pods named exactly like moetune's; own ids known from ledger rows."""
    statuses: list[PodStatus] = ["starting", "running", "exited", "terminated", "unknown"]
    own, foreign = [], []
    for i in range(rng.randint(0, 12)):
        run = f"{rng.randrange(16**6):06x}"
        own.append(Pod(f"own{i}-{rng.random()}", f"moetune-{run}-{i}", rng.choice(statuses)))
    for i in range(rng.randint(0, 12)):
        # same name shape, sometimes the very name of one of our pods
        name = rng.choice(own).name if own and rng.random() < 0.4 else f"moetune-{i:06x}-{i}"
        foreign.append(Pod(f"foreign{i}-{rng.random()}", name, rng.choice(statuses)))
    pods = own + foreign
    rng.shuffle(pods)
    ledger_ids = [p.id for p in own] + [f"gone-{i}" for i in range(rng.randint(0, 3))]
    rows = [LedgerRow(kind="provision", status="ok", metrics={"pod_id": i}) for i in ledger_ids]
    # other kinds may mention any pod (a listing, an infra note): they prove nothing
    rows += [
        LedgerRow(kind=rng.choice(["infra", "spend", "teardown"]), status="ok",
                  metrics={"pod_id": p.id})
        for p in foreign
    ]  # fmt: skip
    held = {p.id for p in own if rng.random() < 0.3}
    return pods, {p.id for p in foreign}, held, rows


def test_sweep_never_touches_foreign_or_held_pods_and_misses_no_orphan() -> None:
    swept_total = 0
    for seed in range(500):
        pods, foreign_ids, held, rows = _scenario(random.Random(seed))
        targets = sweep_targets(pods, own_pod_ids(rows), held)
        ids = [p.id for p in targets]
        assert not set(ids) & foreign_ids, f"seed {seed}: foreign pod terminated"
        assert not set(ids) & held, f"seed {seed}: a live run's pod terminated"
        eligible = [
            p.id
            for p in pods
            if p.id not in foreign_ids and p.id not in held and p.status != "terminated"
        ]
        assert ids == eligible, f"seed {seed}"  # all of them, in the provider's order
        swept_total += len(ids)
    assert swept_total > 500  # the scenarios really exercised the sweep


def test_own_pod_ids_reads_provision_rows_only() -> None:
    rows = [
        LedgerRow(kind="provision", status="ok", metrics={"pod_id": "a"}),
        LedgerRow(kind="provision", status="failed", metrics={"pod_id": "b"}),  # made, then failed
        LedgerRow(kind="provision", status="failed", metrics={"pod_id": None}),
        LedgerRow(kind="provision", status="failed", metrics={"pod_id": ""}),
        LedgerRow(kind="provision", status="ok", metrics={}),
        LedgerRow(kind="infra", status="ok", metrics={"pod_id": "c"}),
    ]
    assert own_pod_ids(rows) == {"a", "b"}


def _state(root: Path, run: str, content: Any) -> None:
    (root / run).mkdir(parents=True)
    text = content if isinstance(content, str) else json.dumps(content)
    (root / run / "state.json").write_text(text)


def test_held_pod_ids_are_live_unfinished_runs_only(tmp_path: Path) -> None:
    me = os.getpid()
    _state(tmp_path, "live", {"pod_id": "p-live", "pid": me, "finished": False})
    _state(tmp_path, "done", {"pod_id": "p-done", "pid": me, "finished": True})
    _state(tmp_path, "dead", {"pod_id": "p-dead", "pid": DEAD_PID, "finished": False})
    _state(tmp_path, "nopod", {"pod_id": None, "pid": me, "finished": False})
    _state(tmp_path, "torn", '{"pod_id": "p-torn", "pid": ')
    for bad in (0, -1, True, "1"):  # 0 / -1 would signal whole process groups
        _state(tmp_path, f"bad{bad}", {"pod_id": f"p-bad{bad}", "pid": bad})
    (tmp_path / "state.json").write_text(json.dumps({"pod_id": "p-top", "pid": me}))
    assert held_pod_ids(tmp_path) == {"p-live"}
    assert state_pod_ids(tmp_path) == {"p-live", "p-done", "p-dead"} | {
        f"p-bad{b}" for b in (0, -1, True, "1")
    }
    assert held_pod_ids(tmp_path / "missing") == set()


# ---------------------------------------------------------------- reap


class FakeProvider(Provider):
    """status/terminate only; terminate fails transiently `flaky` times first."""

    def __init__(self, pods: dict[str, Pod], flaky: int = 0) -> None:
        self.pods, self.flaky, self.calls = pods, flaky, 0

    def status(self, pod_id: str) -> Pod:
        if pod_id not in self.pods:
            raise PodGone(f"no pod {pod_id}")
        return self.pods[pod_id]

    def terminate(self, pod_id: str) -> None:
        self.calls += 1
        if self.calls <= self.flaky:
            raise TransientError("HTTP 502")
        self.pods.pop(pod_id, None)

    def create(self, spec: Any) -> Pod:
        raise NotImplementedError

    def wait_ready(self, pod_id: str, timeout_s: float) -> Pod:
        raise NotImplementedError

    def exec(self, pod_id: str, command: str, timeout_s: float | None = None) -> Any:
        raise NotImplementedError

    def copy_in(self, pod_id: str, local: Path, remote: str) -> None:
        raise NotImplementedError

    def copy_out(self, pod_id: str, remote: str, local: Path) -> None:
        raise NotImplementedError

    def list(self) -> list[Pod]:
        return list(self.pods.values())

    def self_terminate_command(self, pod_id: str) -> str:
        return "true"


FakeProvider.name = "fake"


def test_reap_terminates_by_id_and_ledgers_the_cost(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(guard.time, "sleep", lambda s: None)
    prov = FakeProvider({"p1": _pod(cost=3.0, uptime=3600)}, flaky=2)
    ledger = Ledger(tmp_path / "ledger.jsonl")
    assert reap(prov, ledger, "p1", {"p1"}) == pytest.approx(3.0)
    assert prov.list() == [] and prov.calls == 3
    (row,) = ledger.read().rows
    assert (row.kind, row.cost_usd, row.metrics["pod_id"]) == ("teardown", 3.0, "p1")
    assert reap(prov, ledger, "p1", {"p1"}) == 0.0  # already gone: success, costs nothing more


def test_reap_gives_up_on_a_provider_that_stays_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(guard.time, "sleep", lambda s: None)
    prov = FakeProvider({"p1": _pod()}, flaky=10)
    ledger = Ledger(tmp_path / "ledger.jsonl")
    with pytest.raises(TransientError):
        reap(prov, ledger, "p1", {"p1"})
    assert prov.calls == 3
    (row,) = ledger.read().rows  # the failed attempt is in the ledger too
    assert (row.status, row.reason) == ("infra-failed", "HTTP 502")


@pytest.mark.parametrize("pod_id", ["p2", "../p1", "/tmp/p1", "p1/..", ".p1", "p1\nrm -rf ~"])
def test_reap_refuses_ids_not_recorded_or_not_ids(tmp_path: Path, pod_id: str) -> None:
    from moetune.lane.guard import ReapRefused

    prov = FakeProvider({"p1": _pod(), "p2": _pod()})
    ledger = Ledger(tmp_path / "ledger.jsonl")
    with pytest.raises(LaneError) as err:
        reap(prov, ledger, pod_id, {"p1", "../p1", "/tmp/p1", "p1/..", ".p1", "p1\nrm -rf ~"})
    assert isinstance(err.value, ReapRefused) == (pod_id == "p2")  # else: not an id at all
    assert "\n" not in err.value.cause and prov.calls == 0 and len(prov.pods) == 2
    assert not ledger.path.exists()


def test_each_provider_checks_its_own_id_shape() -> None:
    from moetune.lane.providers.runpod import RunpodProvider

    assert RunpodProvider.check_id(object.__new__(RunpodProvider), "x7k2m9p4q1w8e3")
    with pytest.raises(LaneError, match="is not a runpod pod id"):
        RunpodProvider.check_id(object.__new__(RunpodProvider), "x7k2.m9p4")
