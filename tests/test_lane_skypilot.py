"""Provider `skypilot` (moetune.lane.providers.skypilot): the task YAML from the run, the
cost guard's layers as SkyPilot's (autostop down, `sky status`, `sky down NAME`), multi-GPU
pods from the plan – and, opt-in (-m skypilot), SkyPilot's own parser reading the YAML."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import parse_config
from moetune.lane.launch import pod_gpu_count
from moetune.lane.providers.base import LaneError, PodSpec
from moetune.lane.providers.skypilot import (
    RECORD_NODE_ENV,
    SkypilotProvider,
    parse_status,
    run_task,
    task_yaml,
)

SKY_VENV = Path(os.environ.get("MOETUNE_SKY_PYTHON", "/work/venvs/skypilot/bin/python"))
TOKEN = "hf_" + "Q" * 34  # what a leaked hub token would look like


def _cfg(tmp_path: Path, **lane) -> object:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n')
    return parse_config({
        "model": {"id": "Qwen/Qwen3-30B-A3B"},
        "data": {"train_file": str(data)},
        "output": {"dir": str(tmp_path / "run"), "ledger": str(tmp_path / "ledger.jsonl")},
        "train": {"max_steps": 100},
        "lane": {"provider": "skypilot", **lane},
    })  # fmt: skip


def _spec(**over) -> PodSpec:
    base = {"name": "moetune-r1-abc123", "card": "H100-80GB", "gpu_count": 2, "volume_gb": 200}
    return PodSpec(**{**base, **over})


def test_task_carries_the_plan_and_every_wall(tmp_path):
    env = {"HF_TOKEN": TOKEN, "WANDB_MODE": "offline", "DB_PASS": "hunter2-but-longer"}
    sky = _cfg(tmp_path).lane.skypilot
    spec = _spec(env=env, public_env=("WANDB_MODE",))  # lane.public_env: the one plain entry
    task = task_yaml(spec, 7 * 3600 + 1, ["pip install moetune"], "true", {}, sky)
    res = task["resources"]
    assert res["accelerators"] == "H100:2"
    assert res["disk_size"] == 200 + 30  # volume wall + container disk: one VM disk
    # the watchdog as a hard deadline that tears down, not an idle timer that only stops
    assert res["autostop"] == {"idle_minutes": 421, "down": True, "wait_for": "none"}
    assert task["envs"]["HF_HUB_DISABLE_XET"] == "1" and task["envs"]["WANDB_MODE"] == "offline"
    assert "HF_TOKEN" in task["envs"] and task["envs"]["HF_TOKEN"] is None
    assert task["envs"]["DB_PASS"] is None  # not public: a secret by value, named only
    assert TOKEN not in yaml.safe_dump(task) and "hunter2" not in yaml.safe_dump(task)
    assert task["setup"].splitlines() == ["set -e", "pip install moetune"]


def test_a_card_skypilot_cannot_name_is_refused():
    with pytest.raises(LaneError, match="no SkyPilot accelerator"):
        task_yaml(_spec(card="M3-Max-128GB"), 3600, [], "true", {}, types.SimpleNamespace())


def test_run_task_mounts_what_is_staged_and_trains_on_every_gpu(tmp_path):
    cfg = _cfg(tmp_path)
    pod_config = tmp_path / "pod.yaml"
    pod_config.write_text("{}")
    task = run_task(cfg, _spec(gpu_count=4), 3600, pod_config)
    root = "~/moetune-runs/moetune-r1-abc123"
    assert task["file_mounts"] == {
        f"{root}/data/train_file.jsonl": str((tmp_path / "train.jsonl").resolve()),
        f"{root}/run.yaml": str(pod_config.resolve()),
    }
    assert task["run"] == f"cd {root} && moetune train run.yaml --nproc 4"


_FAKE_MOETUNE = """#!/bin/sh
printf '%s\\n' "$@"
"""


def test_several_nodes_train_on_every_node_with_skypilots_env(tmp_path):
    """num_nodes from train.nnodes; the run line, as bash runs it on node 1 of 2 with the
    env SkyPilot sets there, gives `moetune train` its rank and the head node as node 0."""
    cfg = _cfg(tmp_path)
    cfg.train.nnodes, cfg.train.master_port = 2, 29411
    fake = tmp_path / "moetune"
    fake.write_text(_FAKE_MOETUNE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    cfg.lane.remote_moetune = str(fake)
    pod_config = tmp_path / "pod.yaml"
    pod_config.write_text("{}")
    task = run_task(cfg, _spec(gpu_count=4, nodes=2), 3600, pod_config)
    assert task["num_nodes"] == 2 and task["resources"]["accelerators"] == "H100:4"
    _, command = task["run"].split(" && ", 1)
    env = {"PATH": os.environ["PATH"], "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
           "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n"}  # fmt: skip
    done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [
        "train", "run.yaml", "--nproc", "4", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.5", "--master-port", "29411",
    ]  # fmt: skip
    one = run_task(_cfg(tmp_path), _spec(gpu_count=1), 3600, pod_config)
    assert one["num_nodes"] == 1 and one["run"].endswith("moetune train run.yaml")


def test_the_providers_own_task_has_every_node(tmp_path):
    sky = _cfg(tmp_path).lane.skypilot
    assert task_yaml(_spec(nodes=3), 3600, [], "true", {}, sky)["num_nodes"] == 3


def test_the_lanes_nodes_take_rank_and_head_from_skypilots_env(tmp_path):
    """`moetune launch --nnodes 2`: the cluster's idle run keeps SkyPilot's node env on each
    node; each node's train command (run later over SSH) reads its rank and the head node's
    address from it; a worker is SkyPilot's `<cluster>-worker1` alias, ended with the
    cluster."""
    sky = _fake_sky(tmp_path, STATUS)
    cfg = _cfg(tmp_path, skypilot={"sky": str(sky)})
    cfg.train.nnodes, cfg.train.master_port = 2, 29412
    provider = SkypilotProvider(cfg.lane, tmp_path)
    provider.create(_spec(nodes=2))
    task = yaml.safe_load((tmp_path / "moetune-r1-abc123.sky.yaml").read_text())
    assert task["num_nodes"] == 2
    home = tmp_path / "home"
    home.mkdir()
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "SKYPILOT_NODE_RANK": "1",
           "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6"}  # fmt: skip
    subprocess.run(["bash", "-c", task["run"]], env=env, check=True)
    fake = tmp_path / "moetune"
    fake.write_text(_FAKE_MOETUNE)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    command = SkypilotProvider.node_command(cfg, f"{fake} train run.yaml", 1)
    bare = {"PATH": os.environ["PATH"], "HOME": str(home)}  # an SSH session: no SkyPilot env
    done = subprocess.run(["bash", "-c", command], env=bare, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [
        "train", "run.yaml", "--nnodes", "2", "--node-rank", "1",
        "--master-addr", "10.0.0.5", "--master-port", "29412",
    ]  # fmt: skip
    (worker,) = provider.workers(cfg, tmp_path)
    pod = worker.create(_spec(name="moetune-r1-abc123-n1"))
    assert pod.id == "moetune-r1-abc123-worker1" and pod.status == "running"
    before = (tmp_path / "sky.argv").read_text()
    worker.terminate(pod.id)  # the head's `sky down` ends it: no call of its own
    assert (tmp_path / "sky.argv").read_text() == before


def test_a_provider_without_nodes_refuses_them_in_one_line(tmp_path):
    config = Path("configs/qwen3-30b-a3b/lora_h200.yaml").resolve()
    args = ["launch", str(config), "--dry-run", "--set", f"output.ledger={tmp_path}/l.jsonl"]
    got = CliRunner().invoke(app, [*args, "--provider", "runpod", "--nnodes", "2"])
    assert got.exit_code == 2 and "provider runpod runs one node, not train.nnodes=2" in got.output
    assert "Traceback" not in got.output and not (tmp_path / "l.jsonl").exists()
    zero = CliRunner().invoke(app, [*args, "--provider", "skypilot", "--nnodes", "0"])
    assert zero.exit_code == 2 and "nnodes" in zero.output and "Traceback" not in zero.output


def test_dry_run_shows_every_nodes_command_and_counts_every_node(tmp_path):
    config = Path("configs/qwen3-30b-a3b/lora_h200.yaml").resolve()
    args = ["launch", str(config), "--dry-run", "--json", "--provider", "skypilot", "--set",
            f"output.ledger={tmp_path}/l.jsonl", "--set", "train.max_steps=500"]  # fmt: skip
    one = json.loads(CliRunner().invoke(app, args).stdout)
    got = CliRunner().invoke(app, [*args, "--nnodes", "3", "--set", "lane.env.HF_TOKEN=" + TOKEN])
    assert got.exit_code == 0, got.output
    plan = json.loads(got.stdout)
    assert [n["rank"] for n in plan["nodes"]] == [0, 1, 2]
    assert [n["host"] for n in plan["nodes"]] == ["head node", "worker 1", "worker 2"]
    for node in plan["nodes"]:
        assert '--nnodes "$SKYPILOT_NUM_NODES" --node-rank "$SKYPILOT_NODE_RANK"' in node["command"]
    assert plan["pod"]["nodes"] == 3 and TOKEN not in got.stdout
    assert plan["estimated_usd"] == pytest.approx(3 * one["estimated_usd"])
    assert len(one["nodes"]) == 1 and "--node-rank" not in one["nodes"][0]["command"]


def test_gpu_count_comes_from_config_then_nproc_then_the_planner(tmp_path, monkeypatch):
    from moetune.model import load_spec
    from moetune.plan.hardware import get_card

    cfg = _cfg(tmp_path)
    spec = load_spec(cfg.model.id)
    assert pod_gpu_count(cfg, spec, None) == 1  # no card to plan for
    assert pod_gpu_count(cfg, spec, get_card("H200")) == 1  # a 30B-A3B LoRA fits one H200
    calls = []
    monkeypatch.setattr(
        "moetune.plan.devices.sharding.fewest_gpus",
        lambda spec, c, card, strategy: calls.append(strategy) or 4,
    )
    assert pod_gpu_count(cfg, None, object()) == 4 and calls == ["ddp"]
    cfg.train.nproc = 2
    assert pod_gpu_count(cfg, None, object()) == 2
    cfg.lane.runpod.gpu_count = 8
    assert pod_gpu_count(cfg, None, object()) == 8


STATUS = """Clusters
NAME                    LAUNCHED     RESOURCES                  STATUS   AUTOSTOP   COMMAND
moetune-r1-abc123       10 mins ago  1x AWS(p5.48xlarge, ...)   UP       421m (down) sky launch ...
someone-elses           2 hrs ago    1x GCP(a3-highgpu-8g)      STOPPED  -          sky launch ...

Managed jobs
ID  TASK  NAME      RESOURCES  SUBMITTED  TOT. DURATION  JOB DURATION  #RECOVERIES  STATUS
3   -     finetune  1x[H100:8] 1 hr ago   1h             1h            0            RUNNING
"""


def test_sky_status_lists_clusters_only():
    pods = parse_status(STATUS, "moetune-runs")
    assert [(p.id, p.status) for p in pods] == [
        ("moetune-r1-abc123", "running"),
        ("someone-elses", "exited"),
    ]


def _fake_sky(tmp_path: Path, status_text: str) -> Path:
    """A `sky` executable that records its argv and answers `status` with `status_text`."""
    log = tmp_path / "sky.argv"
    script = tmp_path / "sky"
    script.write_text(
        f"#!{sys.executable}\nimport sys, json\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"if sys.argv[1] == 'status': print({status_text!r})\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_down_goes_by_the_recorded_cluster_name(tmp_path):
    sky = _fake_sky(tmp_path, STATUS)
    provider = SkypilotProvider(_cfg(tmp_path, skypilot={"sky": str(sky)}).lane, tmp_path)
    assert provider.status("moetune-r1-abc123").status == "running"
    provider.terminate("moetune-r1-abc123")
    calls = [json.loads(line) for line in (tmp_path / "sky.argv").read_text().splitlines()]
    assert calls[-1] == ["down", "--yes", "moetune-r1-abc123"]
    with pytest.raises(LaneError):
        provider.terminate("moetune-*")  # never a pattern


def test_launch_passes_secrets_by_environment_only(tmp_path):
    sky = _fake_sky(tmp_path, STATUS)
    provider = SkypilotProvider(_cfg(tmp_path, skypilot={"sky": str(sky)}).lane, tmp_path)
    provider.create(_spec(env={"HF_TOKEN": TOKEN}))
    launch = json.loads((tmp_path / "sky.argv").read_text().splitlines()[0])
    assert launch[:5] == ["launch", "-c", "moetune-r1-abc123", "--yes", "--detach-run"]
    assert launch[5:7] == ["--env", "HF_TOKEN"] and TOKEN not in json.dumps(launch)
    written = (tmp_path / "moetune-r1-abc123.sky.yaml").read_text()
    assert TOKEN not in written and "H100:2" in written


def test_a_missing_sky_cli_says_how_to_install_it(tmp_path):
    lane = _cfg(tmp_path, skypilot={"sky": str(tmp_path / "no-such-sky")}).lane
    with pytest.raises(LaneError, match="not on PATH") as err:
        SkypilotProvider(lane, tmp_path).list()
    assert "pip install skypilot" in err.value.fix


def test_cli_writes_the_task_and_never_overwrites(tmp_path):
    from moetune.config import dump_config
    from test_train_helpers import save_tiny_model

    model = save_tiny_model(tmp_path / "model")
    cfg = _cfg(tmp_path, skypilot={"cloud": "aws"})
    cfg.model.id, cfg.hardware.card = str(model), "H200"
    config, out = tmp_path / "run.yaml", tmp_path / "task"
    config.write_text(dump_config(cfg))
    args = ["sky-task", str(config), "--out", str(out), "--json"]
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 0, got.output
    doc = json.loads(got.output)
    on_disk = yaml.safe_load((out / "task.yaml").read_text())
    assert on_disk == doc["task"] and on_disk["resources"]["accelerators"] == "H200:1"
    assert on_disk["resources"]["cloud"] == "aws"
    root = f"~/moetune-runs/{on_disk['name']}"
    assert on_disk["file_mounts"][f"{root}/model"] == str(model.resolve())  # a local base
    pod = yaml.safe_load((out / "run.yaml").read_text())
    assert pod["model"]["id"] == "model" and pod["lane"]["provider"] == "local"
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 2 and "never overwritten" in again.output
    nodes = CliRunner().invoke(app, [*args[:2], "--out", str(tmp_path / "t2"), "--nnodes", "2"])
    assert nodes.exit_code == 0 and "H200:1 × 2 nodes" in nodes.output
    assert yaml.safe_load((tmp_path / "t2" / "task.yaml").read_text())["num_nodes"] == 2


_PARSE = """
import json, sys
import sky
task = sky.Task.from_yaml(sys.argv[1])
(res,) = list(task.resources)
print(json.dumps({"accelerators": res.accelerators, "disk_size": res.disk_size,
    "autostop": res.autostop_config.to_yaml_config() if res.autostop_config else None,
    "envs": task.envs, "mounts": task.file_mounts, "run": task.run,
    "num_nodes": task.num_nodes}))
"""


@pytest.mark.skypilot
def test_skypilots_own_parser_reads_the_task(tmp_path):
    if not SKY_VENV.exists():
        pytest.skip(f"SkyPilot lives in its own venv ({SKY_VENV}); make setup-skypilot")
    cfg = _cfg(tmp_path)
    pod_config = tmp_path / "pod.yaml"
    pod_config.write_text("{}")
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(run_task(cfg, _spec(), 7200, pod_config)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(SKY_VENV), "-c", _PARSE, str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed["accelerators"] == {"H100": 2}
    assert parsed["disk_size"] == 230
    assert parsed["autostop"]["down"] is True and parsed["autostop"]["idle_minutes"] == 120
    assert parsed["envs"]["HF_HUB_DISABLE_XET"] == "1"
    assert parsed["run"].endswith("moetune train run.yaml --nproc 2")
    assert parsed["num_nodes"] == 1
    broken = yaml.safe_load(path.read_text())
    broken["resources"]["autostop"]["wait_for"] = "never"  # the parser really validates
    path.write_text(yaml.safe_dump(broken))
    refused = subprocess.run(
        [str(SKY_VENV), "-c", _PARSE, str(path)], capture_output=True, text=True, env=env
    )
    assert refused.returncode != 0 and "wait_for" in refused.stderr


@pytest.mark.skypilot
def test_skypilots_own_parser_reads_a_multi_node_task(tmp_path):
    if not SKY_VENV.exists():
        pytest.skip(f"SkyPilot lives in its own venv ({SKY_VENV}); make setup-skypilot")
    cfg = _cfg(tmp_path)
    cfg.train.nnodes = 2
    pod_config = tmp_path / "pod.yaml"
    pod_config.write_text("{}")
    path = tmp_path / "task.yaml"
    path.write_text(yaml.safe_dump(run_task(cfg, _spec(nodes=2), 7200, pod_config)))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(SKY_VENV), "-c", _PARSE, str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed["num_nodes"] == 2 and '--node-rank "$SKYPILOT_NODE_RANK"' in parsed["run"]
    lanes = task_yaml(_spec(nodes=2), 7200, [], RECORD_NODE_ENV, {}, cfg.lane.skypilot)
    path.write_text(yaml.safe_dump(lanes))  # `moetune launch --nnodes 2`'s own cluster
    done = subprocess.run(
        [str(SKY_VENV), "-c", _PARSE, str(path)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert parsed["num_nodes"] == 2 and parsed["run"] == RECORD_NODE_ENV


def test_sky_task_out_an_existing_file_is_one_line_and_the_file_is_kept(tmp_path):
    """Issue 36 item 8: --out naming a file was exit 3 (FileExistsError from mkdir)."""
    from moetune.config import dump_config

    cfg = _cfg(tmp_path, skypilot={"cloud": "aws"})
    config, taken = tmp_path / "run.yaml", tmp_path / "taken.yaml"
    config.write_text(dump_config(cfg))
    taken.write_text("mine\n")
    for out, why in ((taken, "is a file, not a folder"), (taken / "sub", "is not a directory")):
        got = CliRunner().invoke(app, ["sky-task", str(config), "--out", str(out), "--json"])
        assert got.exit_code == 2 and "Traceback" not in got.output
        assert got.stderr.startswith("error: sky-task --out ") and why in got.stderr
        assert "fix: pass --out a folder" in got.stderr
    assert taken.read_text() == "mine\n"
