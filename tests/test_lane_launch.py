"""`moetune launch` with the local provider: the phases end to end on real subprocesses,
the adapter banked before eval, teardown on every exit path, the fault matrix – eval
failing or the pod dying after banking, the watchdog firing, the controller killed and
resumed, the budget reached, the disk full while copying – and secrets that reach the pod
through its environment and nowhere else."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import load_config
from moetune.demo.base import SHIPPED_DIR
from moetune.demo.skills import base_skills, make_items, stream, to_prompt_completion, write_jsonl
from moetune.lane.providers.base import LaneError
from moetune.lane.state import LaneState
from moetune.ledger import Ledger

MOETUNE = f"{sys.executable} -m moetune"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from itertools import islice

    root = tmp_path_factory.mktemp("lane-data")
    rows = to_prompt_completion(list(islice(stream(base_skills(), 0, "train"), 64)))
    items = make_items(["copy"], 24, 0, "eval")
    ladder = [{"prompt": i.prompt, "answer": i.answer} for i in items]
    return {
        "train": write_jsonl(root / "train.jsonl", rows),
        "copy": write_jsonl(root / "copy.jsonl", ladder),
    }


def write_config(tmp: Path, data: dict[str, Path], **lane: Any) -> Path:
    cfg = {
        "model": {"id": str(SHIPPED_DIR), "dtype": "float32"},
        "lora": {"rank": 4, "targets": ["attention", "experts"]},
        "data": {"train_file": str(data["train"])},
        "output": {"dir": str(tmp / "runs/lane"), "ledger": str(tmp / ".moetune/ledger.jsonl")},
        "train": {"seq_len": 32, "batch_size": 8, "max_steps": 4, "save_steps": 2,
                  "learning_rate": 1e-4, "device": "cpu", "gradient_checkpointing": False},
        "eval": {"rungs": [{"name": "copy", "kind": "exact_match", "role": "protected",
                            "data": str(data["copy"]), "margin": 0.5}]},
        "lane": {"provider": "local", "remote_moetune": MOETUNE, "poll_s": 0.2, **lane},
    }  # fmt: skip
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def kinds(tmp: Path) -> list[tuple[str, str]]:
    return [(r.kind, r.status) for r in Ledger(tmp / ".moetune" / "ledger.jsonl").read().rows]


def only_state(tmp: Path) -> LaneState:
    (path,) = (tmp / ".moetune" / "lane").glob("*/state.json")
    return LaneState(**json.loads(path.read_text()))


def when_state(tmp: Path, ready: str, then: Any) -> Any:
    """A thread that, once the launch's state.json has a truthy `ready`, calls then(state)."""
    import threading

    def watch() -> None:
        for _ in range(2400):
            states = list((tmp / ".moetune" / "lane").glob("*/state.json"))
            state = json.loads(states[0].read_text()) if states else {}
            if state.get(ready):
                then(state)
                return
            time.sleep(0.05)

    thread = threading.Thread(target=watch)
    thread.start()
    return thread


def terminate_pod(tmp: Path) -> Any:
    from moetune.lane.providers.local import LocalProvider

    return lambda state: LocalProvider(tmp / ".moetune" / "pods").terminate(state["pod_id"])


def pod_dir(tmp: Path, state: LaneState) -> Path:
    return tmp / ".moetune" / "pods" / state.pod_name


def test_dry_run_sizes_every_wall_and_runs_nothing(tmp_path: Path) -> None:
    config = Path("configs/qwen3-30b-a3b/lora_h200.yaml").resolve()
    out = CliRunner().invoke(
        app, ["launch", str(config), "--provider", "runpod", "--dry-run", "--json",
              "--set", f"output.ledger={tmp_path}/l.jsonl", "--set", "train.max_steps=500"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    plan = json.loads(out.stdout)
    assert plan["card"] == "H200" and plan["pod"]["gpu_type_id"] == "NVIDIA H200"
    walls = plan["walls"]
    assert walls["volume_gb"] >= 200  # a 30B model: never below the floor
    assert walls["env"]["HF_HUB_DISABLE_XET"] == "1"
    train_s, eval_s = walls["estimated_train_s"], walls["estimated_eval_s"]
    assert train_s > 0 and walls["watchdog_s"] >= (train_s + eval_s) * 1.5
    assert walls["watchdog_s"] != 6 * 3600  # sized, not the default
    phases = plan["phases"]
    assert phases.index("bank") < phases.index("eval") and phases[-1] == "teardown"
    assert plan["estimated_usd"] > 0
    assert not (tmp_path / "l.jsonl").exists()  # nothing ran, nothing recorded


def test_launch_banks_before_eval_gates_promotes_and_tears_down(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, data)
    out = CliRunner().invoke(app, ["launch", str(config), "--json"])
    assert out.exit_code == 0, out.output
    state = json.loads(out.stdout)
    assert state["finished"] and state["verdict"] == "GO"
    adapter = tmp_path / "runs" / "lane" / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()
    marker = json.loads((adapter / "PROMOTED").read_text())
    verdict = json.loads((tmp_path / "runs" / "lane" / "eval" / "verdict.json").read_text())
    assert marker["verdict_hash"] == verdict["hash"]
    ladder = json.loads((tmp_path / "runs" / "lane" / "eval" / "ladder.json").read_text())
    assert ladder["adapter_sha256"] == state["banked"]["sha256"]  # one digest: banked = evaluated
    order = [k for k, _ in kinds(tmp_path)]
    assert order.index("provision") < order.index("bank") < order.index("eval")
    assert order[-1] == "teardown" and {"train", "gate", "promote"} <= set(order)
    assert (pod_dir(tmp_path, only_state(tmp_path)) / "TERMINATED").exists()
    assert (tmp_path / "runs" / "lane" / "summary.json").is_file()  # the run's record came back
    (trained,) = [r for r in Ledger(tmp_path / ".moetune/ledger.jsonl").read().rows
                  if r.kind == "train"]  # fmt: skip
    assert trained.metrics["tokens_per_s"] > 0 and trained.metrics["device"] == "cpu"
    assert trained.metrics["signature"]["model"] == str(SHIPPED_DIR)  # not the pod's copy


def test_eval_failure_after_bank_leaves_the_adapter_and_the_next_step(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, data)
    cfg = yaml.safe_load(config.read_text())
    rung = cfg["eval"]["rungs"][0]
    rung["kind"] = "no_such_kind"  # a mistyped kind: refused here, before any pod
    config.write_text(yaml.safe_dump(cfg))
    out = CliRunner().invoke(app, ["launch", str(config)])
    assert out.exit_code == 2 and "unknown kind 'no_such_kind'" in " ".join(out.output.split())
    assert not (tmp_path / ".moetune" / "lane").exists()  # no pod, no lane state
    # a pod without the lm-eval extra: only its eval can find out, after training
    harness = tmp_path / "pod-site" / "lm_eval"
    harness.mkdir(parents=True)
    (harness / "__init__.py").write_text("raise ImportError('lm_eval is not on this pod')\n")
    monkeypatch.setenv(
        "PYTHONPATH", f"{harness.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )
    rung.update(kind="lm_eval", task="copy", data=None)
    config.write_text(yaml.safe_dump(cfg))
    out = CliRunner().invoke(app, ["launch", str(config)])
    assert out.exit_code == 2
    banked = tmp_path / "runs" / "lane" / "adapter"
    assert (banked / "adapter_model.safetensors").is_file()
    assert f"--adapter {banked} --provider local" in out.output
    assert ("bank", "ok") in kinds(tmp_path) and kinds(tmp_path)[-1] == ("teardown", "ok")
    assert (pod_dir(tmp_path, only_state(tmp_path)) / "TERMINATED").exists()


def test_watchdog_fires_and_the_run_fails_cleanly(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, data, watchdog_s=2)
    out = CliRunner().invoke(app, ["launch", str(config)])
    assert out.exit_code == 2
    state = only_state(tmp_path)
    assert "bank" not in state.done and (pod_dir(tmp_path, state) / "TERMINATED").exists()
    assert ("launch", "infra-failed") in kinds(tmp_path)


def test_budget_reached_stops_salvages_and_terminates(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from moetune.lane.providers import local

    original = local.LocalProvider.status

    def costly(self: Any, pod_id: str) -> Any:  # $36/h: a cent a second
        from dataclasses import replace

        return replace(original(self, pod_id), cost_per_hr=36.0)

    monkeypatch.setattr(local.LocalProvider, "status", costly)
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, data, max_usd=0.03)
    out = CliRunner().invoke(app, ["launch", str(config)])
    assert out.exit_code == 2 and "max_usd" in out.output
    rows = Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows
    assert any(r.kind == "launch" and r.status == "cancelled" for r in rows)
    teardown = [r for r in rows if r.kind == "teardown"]
    assert teardown and teardown[-1].cost_usd >= 0.03


def test_disk_full_while_copying_leaves_no_partial_adapter(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from moetune.lane.providers import local

    real = local._copy

    def full(src: Path, dst: Path) -> None:
        if dst.name.startswith(".adapter"):
            real(src, dst)
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(local, "_copy", full)
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["launch", str(write_config(tmp_path, data))])
    assert out.exit_code == 2 and "No space left on device" in out.output
    run = tmp_path / "runs" / "lane"
    assert not (run / "adapter").exists() and not (run / ".adapter.partial").exists()
    assert ("launch", "infra-failed") in kinds(tmp_path)
    rows = Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows
    assert any(r.metrics.get("signature") == "No space left on device" for r in rows)


@pytest.mark.slow  # a whole launch (train, kill, resume): ~50 s quiet
def test_controller_killed_then_resumed_finishes_the_run(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    config = write_config(tmp_path, data)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.Popen([*MOETUNE.split(), "launch", str(config)], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:  # kill -9 once training is under way on the pod
        states = list((tmp_path / ".moetune" / "lane").glob("*/state.json"))
        if states and "stage" in json.loads(states[0].read_text())["done"]:
            break
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    state = only_state(tmp_path)
    assert not state.finished and (pod_dir(tmp_path, state)).is_dir()
    done = subprocess.run(
        [*MOETUNE.split(), "launch", str(config), "--resume", state.run_id, "--json"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    final = json.loads(done.stdout)
    assert final["finished"] and final["verdict"] == "GO"
    # the pod's training was re-attached, not started twice
    trains = [
        r for r in Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows if r.kind == "train"
    ]
    assert len(trains) == 1


def test_resume_of_an_unknown_run_names_the_known_ones(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(write_config(tmp_path, data))
    from moetune.lane.launch import launch

    with pytest.raises(LaneError, match="no launch state"):
        launch(cfg, tmp_path / "run.yaml", resume="nope", show=False)


# a whole launch over the real sshd, ~50 s quiet (the default tier drives that sshd through
# test_lane_ssh and test_lane_nodes)
@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="OpenSSH server not installed")
def test_launch_over_ssh_to_a_real_sshd(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sshd import start_sshd

    server = start_sshd(tmp_path / "sshd")
    try:
        monkeypatch.chdir(tmp_path)
        ssh = {"host": server.target.host, "port": server.target.port,
               "user": server.target.user, "identity": str(server.identity)}  # fmt: skip
        config = write_config(tmp_path, data, ssh=ssh, workdir=str(tmp_path / "remote"),
                              env={"HF_HUB_OFFLINE": "1"})  # fmt: skip
        out = CliRunner().invoke(app, ["launch", str(config), "--provider", "ssh", "--json"])
        assert out.exit_code == 0, out.output
        state = json.loads(out.stdout)
        assert state["finished"] and state["verdict"] == "GO"
        banked = tmp_path / "runs" / "lane" / "adapter"
        remote = next((tmp_path / "remote").glob("moetune-*"))
        assert (banked / "adapter_model.safetensors").read_bytes() == (
            remote / "run" / "adapter" / "adapter_model.safetensors"
        ).read_bytes()
        assert (banked / "PROMOTED").is_file()
        assert (tmp_path / ".moetune" / "lane" / state["run_id"] / "known_hosts").is_file()
    finally:
        server.stop()


# a whole launch through the fake RunPod API and the real sshd, ~50 s quiet (the API's
# calls, costs and teardown have default-tier tests in test_lane_runpod)
@pytest.mark.slow
@pytest.mark.skipif(not Path("/usr/sbin/sshd").exists(), reason="OpenSSH server not installed")
def test_launch_on_runpod_api_then_ssh_and_ledger_costs(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The RunPod provider end to end: create through the (fake) GraphQL API, reach the pod's
    public 22/tcp (a real sshd here), run the phases, terminate, cost in the ledger."""
    from fake_runpod import FakeRunpod
    from sshd import start_sshd

    server = start_sshd(tmp_path / "sshd")
    monkeypatch.setenv("RUNPOD_API_KEY", "test-key")
    monkeypatch.chdir(tmp_path)
    with FakeRunpod(ssh_host="127.0.0.1", ssh_port=server.target.port) as fake:
        try:
            lane = {
                "runpod": {"api_url": fake.url},
                "ssh": {"identity": str(server.identity)},
                "env": {"HF_HUB_OFFLINE": "1"},
                "workdir": str(tmp_path / "volume"),
            }
            config = write_config(tmp_path, data, **lane)
            cfg = yaml.safe_load(config.read_text())
            cfg["hardware"] = {"card": "H200"}
            config.write_text(yaml.safe_dump(cfg))
            out = CliRunner().invoke(app, ["launch", str(config), "--provider", "runpod", "--json"])
            assert out.exit_code == 0, out.output
        finally:
            server.stop()
        assert json.loads(out.stdout)["verdict"] == "GO"
        (create,) = [r.variables["input"] for r in fake.ops("podFindAndDeployOnDemand")]
        assert create["gpuTypeId"] == "NVIDIA H200" and create["ports"] == "22/tcp"
        assert {"key": "HF_HUB_DISABLE_XET", "value": "1"} in create["env"]
        assert fake.pods == {}  # terminated
    rows = Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows
    provision = next(r for r in rows if r.kind == "provision")
    assert provision.metrics["cost_per_hr"] == 3.59
    teardown = next(r for r in rows if r.kind == "teardown")
    assert teardown.metrics["pod_id"] == provision.metrics["pod_id"] and teardown.cost_usd > 0


def test_pod_dies_during_eval_after_the_adapter_was_banked(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, data)
    killer = when_state(tmp_path, "banked", terminate_pod(tmp_path))
    out = CliRunner().invoke(app, ["launch", str(config)])
    killer.join()
    assert out.exit_code == 2
    banked = tmp_path / "runs" / "lane" / "adapter"
    assert (banked / "adapter_model.safetensors").is_file()
    assert "--provider local" in out.output  # the next step: evaluate the banked adapter here
    assert ("launch", "infra-failed") in kinds(tmp_path)
    # or resume: a new pod scores the banked adapter; training is not repeated
    state = only_state(tmp_path)
    again = CliRunner().invoke(app, ["launch", str(config), "--resume", state.run_id, "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["promoted"]
    assert [k for k, _ in kinds(tmp_path)].count("train") == 1


@pytest.mark.slow  # a whole launch (train, kill, resume): ~50 s quiet
def test_pod_dies_during_train_and_resume_continues_on_a_new_pod(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = write_config(tmp_path, data)
    cfg = yaml.safe_load(config.read_text())
    cfg["train"].update(max_steps=40, save_steps=4)
    config.write_text(yaml.safe_dump(cfg))
    killer = when_state(tmp_path, "synced", terminate_pod(tmp_path))
    first = CliRunner().invoke(app, ["launch", str(config)])
    killer.join()
    assert first.exit_code == 2, first.output
    state = only_state(tmp_path)
    assert state.synced and not state.banked
    again = CliRunner().invoke(app, ["launch", str(config), "--resume", state.run_id, "--json"])
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["verdict"] == "GO"
    summary = json.loads((tmp_path / "runs" / "lane" / "summary.json").read_text())
    assert summary["result"]["resumed_from_step"] >= 4 and summary["result"]["steps"] == 40
    pods = sorted(p.name for p in (tmp_path / ".moetune" / "pods").iterdir())
    assert len(pods) == 2  # the lost pod and its replacement


def test_sigterm_mid_training_still_tears_the_pod_down(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    config = write_config(tmp_path, data)
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    command = [*MOETUNE.split(), "launch", str(config)]
    proc = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True)
    when_state(tmp_path, "pod_id", lambda state: None).join()
    deadline = time.time() + 120
    while "stage" not in only_state(tmp_path).done and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0
    state = only_state(tmp_path)
    assert (pod_dir(tmp_path, state) / "TERMINATED").exists() and state.pod_id is None
    assert kinds(tmp_path)[-2:] == [("launch", "cancelled"), ("teardown", "ok")]
    assert f"--resume {state.run_id}" in " ".join(err.split())  # the next step is said


# -------------------------------------------------------------------------------- secrets

SECRETS = {  # lane.env, the process environment, and the RunPod config file
    "HF_TOKEN": "hf_" + "Q7xk" * 9,
    "WANDB_API_KEY": "wandb-" + "9f3e" * 10,
    "RUNPOD_API_KEY": "rpa_" + "ENVKEY" * 5,
    "MY_SERVICE_TOKEN": "proc-secret-" + "z8" * 10,
    "config.toml": "rpa_" + "FILEKEY" * 4,
    # innocuous names, plain values: secrets by value, as every lane.env value not public
    "DB_PASS": "correct-horse-battery",
    "MY_PRIVATE_CREDS": "alice:wonderland42",
    "FOO": "quiet value 77",
}


def _secret_world(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp / "home"
    (home / ".runpod").mkdir(parents=True)
    (home / ".runpod" / "config.toml").write_text(f'apikey = "{SECRETS["config.toml"]}"\n')
    monkeypatch.setenv("HOME", str(home))
    for name in ("RUNPOD_API_KEY", "MY_SERVICE_TOKEN"):
        monkeypatch.setenv(name, SECRETS[name])
    monkeypatch.chdir(tmp)


LANE_SECRETS = ("HF_TOKEN", "WANDB_API_KEY", "DB_PASS", "MY_PRIVATE_CREDS", "FOO")


def _lane_env() -> dict[str, str]:
    return {**{k: SECRETS[k] for k in LANE_SECRETS}, "HF_HUB_OFFLINE": "1"}


def _leaks(text: str) -> list[str]:
    return [name for name, value in SECRETS.items() if value in text]


def _files_leaking(root: Path, *inputs: Path) -> dict[str, list[str]]:
    """Every file under `root` (but the user's own inputs) that holds a secret's value."""
    found = {}
    for path in root.rglob("*"):
        if path.is_file() and path not in inputs:
            hits = _leaks(path.read_bytes().decode(errors="replace"))
            if hits:
                found[str(path.relative_to(root))] = hits
    return found


def test_secrets_reach_the_pod_by_its_environment_and_appear_nowhere_else(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _secret_world(tmp_path, monkeypatch)
    digest = {
        k: hashlib.sha256(SECRETS[k].encode()).hexdigest() for k in _lane_env() if k in SECRETS
    }
    seen_on_pod = [f'test "$(printf %s "${k}" | sha256sum | cut -c1-64)" = {d}'
                   for k, d in digest.items()]  # fmt: skip
    careless = 'echo "$HF_TOKEN $WANDB_API_KEY $RUNPOD_API_KEY"; env >&2'  # output never shown
    config = write_config(tmp_path, data, env=_lane_env(), public_env=["HF_HUB_OFFLINE"],
                          setup=[*seen_on_pod, careless])  # fmt: skip
    run = CliRunner()
    outputs = [run.invoke(app, ["launch", str(config), "--dry-run"]),
               run.invoke(app, ["launch", str(config), "--dry-run", "--json"]),
               run.invoke(app, ["launch", str(config), "--provider", "skypilot", "--dry-run",
                                "--json"]),
               run.invoke(app, ["sky-task", str(config), "--out", str(tmp_path / "sky"),
                                "--set", "hardware.card=L40S"])]  # fmt: skip
    assert [o.exit_code for o in outputs] == [0] * 4, [o.output for o in outputs]
    plan = json.loads(outputs[1].stdout)
    assert plan["walls"]["env"] == {**{k: "***" for k in LANE_SECRETS},
                                    "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_XET": "1"}  # fmt: skip
    assert plan["pod"]["env"] == plan["walls"]["env"] and "FOO=***" in outputs[0].output
    task = yaml.safe_load((tmp_path / "sky" / "task.yaml").read_text())
    assert task["envs"]["DB_PASS"] is None and task["envs"]["HF_HUB_OFFLINE"] == "1"
    outputs.append(run.invoke(app, ["launch", str(config), "--json"]))
    assert outputs[-1].exit_code == 0, outputs[-1].output  # the pod saw both (setup checked)
    assert json.loads(outputs[-1].stdout)["verdict"] == "GO"
    for args in (["ledger", "show"], ["ledger", "show", "--json"], ["report", "runs/lane"],
                 ["pods", "list", "--provider", "local", "--json"]):  # fmt: skip
        outputs.append(run.invoke(app, args))
        assert outputs[-1].exit_code == 0, outputs[-1].output
    assert (tmp_path / "runs" / "lane" / "report.html").is_file()
    assert [_leaks(o.output) for o in outputs] == [[]] * len(outputs)  # stdout and stderr
    inputs = (config, tmp_path / "home" / ".runpod" / "config.toml")
    # every byte written: run dir, ledger, lane state, run-sync, the pod folder, report, sky task
    assert _files_leaking(tmp_path, *inputs) == {}
    (pod,) = (tmp_path / ".moetune" / "pods").glob("*/pod.json")
    assert json.loads(pod.read_text())["spec"]["env"]["DB_PASS"] == "***"
    saved = yaml.safe_load((tmp_path / "runs" / "lane" / "config.yaml").read_text())
    assert saved["lane"]["env"] == {"HF_HUB_OFFLINE": "1"}  # the pod's copy never held them


YAML_TYPED = {"DB_PASS": 424242424242, "PI_KEY": 3.14159265, "PAIR": ["abcdefgh1", "zyxw98765"],
              "NESTED": {"inner": "nestedsecret9"}, "ON": True}  # fmt: skip
TYPED_SHOWN = ("424242424242", "3.14159265", "abcdefgh1", "zyxw98765", "nestedsecret9")


@pytest.mark.parametrize("entry", sorted(YAML_TYPED))
def test_lane_env_values_yaml_reads_as_numbers_bools_or_lists_are_never_shown(
    tmp_path: Path, data: dict[str, Path], entry: str
) -> None:
    env = {"HF_HUB_OFFLINE": "1", **{k: v for k, v in YAML_TYPED.items() if k != entry}}
    config = write_config(tmp_path, data, env={entry: YAML_TYPED[entry], **env})
    run = CliRunner()
    outputs = [run.invoke(app, args) for args in (
        ["lint", str(config)], ["lint", str(config), "--json"], ["train", str(config)],
        ["launch", str(config), "--dry-run"], ["launch", str(config), "--dry-run", "--json"],
        ["launch", str(config), "--set", "lane.env.X=123456789", "--dry-run"],
    )]  # fmt: skip
    for out in outputs:  # refused in one line that names an entry, and shows no value
        assert out.exit_code == 2 and "Traceback" not in out.output, out.output
        assert "lane.env" in out.output and "quote every value" in out.output, out.output
        assert [v for v in (*TYPED_SHOWN, "123456789") if v in out.output] == [], out.output
    assert not (tmp_path / "runs").exists()  # nothing written


def test_public_env_keeps_other_providers_token_shaped_values_masked(
    tmp_path: Path, data: dict[str, Path]
) -> None:
    tokens = {"GH_PAT": "ghp_" + "a1B2" * 9, "AWS_KEY_ID": "AKIA" + "ABCDEFGH23456789",
              "GITLAB": "glpat-" + "x" * 20, "SLACK": "xoxb-1234567890-abcdef"}  # fmt: skip
    config = write_config(tmp_path, data, env={**tokens, "REGION": "eu-west-1"},
                          public_env=[*tokens, "REGION"])  # fmt: skip
    out = CliRunner().invoke(app, ["launch", str(config), "--dry-run", "--json"])
    assert out.exit_code == 0, out.output
    env = json.loads(out.stdout)["walls"]["env"]
    assert {k: env[k] for k in tokens} == dict.fromkeys(tokens, "***")
    assert env["REGION"] == "eu-west-1"  # a public value that is no credential stays shown
    assert [v for v in tokens.values() if v in out.output] == []


def test_a_failing_command_that_prints_a_secret_is_reported_masked(
    tmp_path: Path, data: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    _secret_world(tmp_path, monkeypatch)
    setup = ['echo "login failed for token $HF_TOKEN (key $RUNPOD_API_KEY)" >&2; exit 3']
    config = write_config(tmp_path, data, env=_lane_env(), setup=setup)
    out = CliRunner().invoke(app, ["launch", str(config)])
    assert out.exit_code == 2 and "login failed for token *** (key ***)" in out.output
    assert _leaks(out.output) == []
    (failed,) = [r for r in Ledger(tmp_path / ".moetune/ledger.jsonl").read().rows
                 if r.kind == "launch"]  # fmt: skip
    assert "login failed for token ***" in failed.reason
    assert _files_leaking(tmp_path, config, tmp_path / "home" / ".runpod" / "config.toml") == {}
