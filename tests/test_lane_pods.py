"""`moetune pods list|reap|sweep` on local pods: list tells moetune's pods from others, reap
ends one by id with its cost in the ledger, sweep ends only moetune's unheld pods – by the
ids it recorded, never by name – and `workflow github` emits a workflow actionlint accepts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.lane.providers.base import PodSpec
from moetune.lane.providers.local import LocalProvider
from moetune.ledger import Ledger, LedgerRow


@pytest.fixture()
def pods(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Own pods (in the ledger or a state file), a held one, and look-alike foreign pods."""
    monkeypatch.chdir(tmp_path)
    provider = LocalProvider(tmp_path / ".moetune" / "pods")
    ledger = Ledger(tmp_path / ".moetune" / "ledger.jsonl")
    ids = {}
    for role in ("own", "own-state", "held", "foreign"):
        ids[role] = provider.create(PodSpec(name=f"moetune-run-{role}")).id
    for role in ("own", "held"):
        ledger.append(LedgerRow(kind="provision", status="ok", metrics={"pod_id": ids[role]}))
    for role, pid in (("held", os.getpid()), ("own-state", 2**31 - 1)):  # alive / dead controller
        state = tmp_path / ".moetune" / "lane" / role / "state.json"
        state.parent.mkdir(parents=True)
        state.write_text(json.dumps({"pod_id": ids[role], "pid": pid, "finished": False}))
    return ids


def invoke(*args: str) -> dict:
    out = CliRunner().invoke(app, [*args, "--provider", "local", "--json"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_list_marks_moetune_pods(pods: dict[str, str]) -> None:
    listed = {p["id"]: p["moetune"] for p in invoke("pods", "list")}
    assert listed == {pods["own"]: True, pods["own-state"]: True, pods["held"]: True,
                      pods["foreign"]: False}  # fmt: skip


def test_sweep_ends_only_own_unheld_pods(pods: dict[str, str], tmp_path: Path) -> None:
    dry = invoke("pods", "sweep")
    assert sorted(dry["targets"]) == sorted([pods["own"], pods["own-state"]])
    assert dry["terminated"] == {}
    done = invoke("pods", "sweep", "--yes")
    assert sorted(done["terminated"]) == sorted([pods["own"], pods["own-state"]])
    status = {p["id"]: p["status"] for p in invoke("pods", "list")}
    assert status[pods["foreign"]] == "running" and status[pods["held"]] == "running"
    rows = Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows
    assert sorted(r.metrics["pod_id"] for r in rows if r.kind == "teardown") == sorted(
        [pods["own"], pods["own-state"]]
    )


def _job(pod: Path) -> subprocess.Popen[bytes]:
    """A live process group whose id sits in `pod`'s pid file, as a pod's job's does."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    pod.mkdir(parents=True, exist_ok=True)
    (pod / "train.log.pid").write_text(str(proc.pid))
    return proc


def test_reap_ends_an_own_pod_by_id_idempotently(pods: dict[str, str], tmp_path: Path) -> None:
    job = _job(tmp_path / ".moetune" / "pods" / pods["own"])
    assert invoke("pods", "reap", pods["own"])["terminated"] == pods["own"]
    assert job.wait(timeout=10) == -15  # its process group got SIGTERM
    assert invoke("pods", "reap", pods["own"])["terminated"] == pods["own"]
    status = {p["id"]: p["status"] for p in invoke("pods", "list")}
    assert status[pods["own"]] == "terminated" and status[pods["foreign"]] == "running"


def _tree(root: Path) -> dict[str, float]:
    return {str(p): p.lstat().st_mtime for p in root.rglob("*")}


def test_reap_refuses_foreign_pods_paths_symlinks_and_unrecorded_ids(
    pods: dict[str, str], tmp_path: Path
) -> None:
    """The tester's `pods reap ../../somewhere`, and its cousins: each is refused in one line
    with exit != 0, and nothing anywhere is written or signalled."""
    base = tmp_path / ".moetune" / "pods"
    elsewhere = tmp_path / "somewhere"  # looks like a pod: pod.json and a live job
    (elsewhere / "pod.json").parent.mkdir()
    (elsewhere / "pod.json").write_text(json.dumps({"spec": {}, "created": 0}))
    jobs = [_job(elsewhere), _job(base / pods["foreign"])]
    (base / "moetune-run-link").symlink_to(elsewhere)
    Ledger(tmp_path / ".moetune" / "ledger.jsonl").append(  # recorded, yet a symlink
        LedgerRow(kind="provision", status="ok", metrics={"pod_id": "moetune-run-link"})
    )
    before = _tree(tmp_path)
    paths = ["../../somewhere", "../../" + str(elsewhere)[1:], str(elsewhere), ".", "..", ""]
    for pod_id in [pods["foreign"], "moetune-run-link", "moetune-run-never", *paths]:
        out = CliRunner().invoke(app, ["pods", "reap", pod_id, "--provider", "local"])
        assert out.exit_code == 2, (pod_id, out.output)
        assert len(out.output.strip().splitlines()) == 1 and "Traceback" not in out.output
        assert (
            "refused" in out.output
            or "is not a local pod id" in out.output
            or ("symlink" in out.output)
        ), out.output
    assert _tree(tmp_path) == before  # no TERMINATED file, no ledger row, nothing at all
    assert all(job.poll() is None for job in jobs)  # no signal reached either job
    for job in jobs:
        job.kill()
        job.wait()


@pytest.mark.skipif(shutil.which("actionlint") is None and not Path(
    ".venv/bin/actionlint").exists(), reason="actionlint is not installed")  # fmt: skip
def test_workflow_github_cli_passes_actionlint(tmp_path: Path) -> None:
    config = Path("configs/qwen3-30b-a3b/lora_h200.yaml").resolve()
    out = tmp_path / "wf.yml"
    got = CliRunner().invoke(
        app, ["workflow", "github", str(config), "--out", str(out), "--set", "lane.provider=runpod"]
    )
    assert got.exit_code == 0, got.output
    binary = shutil.which("actionlint") or str(Path(".venv/bin/actionlint").resolve())
    lint = subprocess.run([binary, str(out)], capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    text = out.read_text()
    assert "secrets.RUNPOD_API_KEY" in text and "lane.provider=runpod" in text


def test_workflow_github_has_json_and_it_masks_lane_env_values(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"  # the sweep found no --json (every command has one)
    run.write_text("model: {id: Qwen/Qwen3-30B-A3B}\n"
                   "lane: {provider: runpod, env: {DB_PASS: zq-sweep-secret-7f3a}}\n")  # fmt: skip
    out = tmp_path / "wf.yml"
    got = CliRunner().invoke(app, ["workflow", "github", str(run), "--out", str(out), "--json"])
    assert got.exit_code == 0, got.output
    doc = json.loads(got.stdout)
    assert doc["workflow"] == out.read_text() and doc["out"] == str(out)
    assert doc["deadline_s"] > 0 and "secrets.RUNPOD_API_KEY" in doc["workflow"]
    assert "zq-sweep-secret-7f3a" not in got.output + out.read_text()
