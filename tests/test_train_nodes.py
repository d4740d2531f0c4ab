"""Several nodes (moetune.train.distributed.nodes): accelerate's multi-node launch from `--nnodes
--node-rank --master-addr --master-port`, refusals before anything is written, and two
launchers on 127.0.0.1 ("2 nodes × 1 CPU rank", gloo) that train the adapter of one
process – and, when node 1's launcher is killed, end node 0 with a ledgered failure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import dump_config
from moetune.ledger import Ledger
from moetune.train import TrainError
from moetune.train import launch as D
from moetune.train.distributed import nodes as N
from moetune.train.rundir.checkpoint import config_diff
from test_train_helpers import (
    tiny_cfg,
    tiny_run,
)

SRC = Path(D.__file__).parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("nodes"))


_cfg = tiny_cfg


def _two_nodes(**over):
    return {"nnodes": 2, "master_addr": "10.0.0.1", "master_port": 29400, **over}


# ---------------------------------------------------------------- the launch config


@pytest.mark.parametrize("rank", [0, 1])
def test_accelerate_launches_the_node_it_is_told(tiny, tmp_path, rank):
    """The config accelerate's own parser reads, turned into torchrun's arguments by
    accelerate's own multi-GPU launcher: 2 ranks in all, 1 here, node 0's address."""
    from accelerate.commands.launch import launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    cfg = _cfg(tiny, tmp_path / "run", **_two_nodes(node_rank=rank, strategy="fsdp"))
    path = D.write_config(cfg, tmp_path)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    from accelerate.commands.launch import _validate_launch_command

    args, *_ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    assert (args.nnodes, args.node_rank, args.nproc_per_node) == ("2", rank, "1")
    assert args.rdzv_endpoint == "10.0.0.1:29400" and args.rdzv_backend == "static"
    assert env["ACCELERATE_USE_FSDP"] == "true"


def test_one_node_keeps_its_own_free_port(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path / "run", nproc=2)
    fields = N.machine_fields(cfg.train, 41234)
    assert fields == {"num_machines": 1, "machine_rank": 0, "num_processes": 2,
                      "main_process_port": 41234}  # fmt: skip


def test_zero3_on_several_nodes_goes_through_torchrun(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path / "run", nproc=2, strategy="zero3", **_two_nodes())
    content = D.accelerate_config(cfg, 0, ["Qwen3MoeDecoderLayer"])
    assert content["num_processes"] == 4 and content["main_process_ip"] == "10.0.0.1"
    assert content["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"


def test_a_node_other_than_0_writes_nothing_in_the_output_dir(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path / "run", **_two_nodes(node_rank=1))
    with N.config_home(cfg) as home:
        D.write_config(cfg, home)
        assert (home / D.CONFIG_NAME).is_file() and tmp_path not in home.parents
    assert not home.exists() and not (tmp_path / "run").exists()


def test_a_nodes_own_settings_never_block_its_resume(tiny, tmp_path):
    node0 = _cfg(tiny, tmp_path / "run", **_two_nodes())
    node1 = _cfg(tiny, tmp_path / "run", **_two_nodes(node_rank=1, master_addr="node0.lan"))
    assert config_diff(dump_config(node0), node1) == []
    more = _cfg(tiny, tmp_path / "run", **_two_nodes(nnodes=3, node_rank=1))
    assert config_diff(dump_config(node0), more) == ["train.nnodes (2 -> 3)"]


# ---------------------------------------------------------------- refused before writing


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nnodes", "2", "--node-rank", "1"], "no train.master_addr"),
        (["--nnodes", "2", "--node-rank", "2", "--master-addr", "10.0.0.1"], "ranks are 0 to 1"),
    ],
)
def test_cli_refuses_a_launch_that_cannot_rendezvous(tiny, tmp_path, flags, says):
    out = tmp_path / "never"
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, out)))
    got = CliRunner().invoke(app, ["train", str(config), *flags])
    assert got.exit_code != 0 and says in got.output, got.output
    assert "Traceback" not in got.output and not out.exists()


def test_node_0_refuses_a_master_port_in_use(tiny, tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        node0 = _cfg(tiny, tmp_path / "run", **_two_nodes(master_port=port))
        with pytest.raises(TrainError, match=f"master_port {port} is in use"):
            N.check_port(node0.train)
        N.check_port(
            _cfg(tiny, tmp_path / "run", **_two_nodes(node_rank=1, master_port=port)).train
        )
    N.check_port(node0.train)  # free again


def test_more_ranks_than_gpus_are_refused(tiny, tmp_path, monkeypatch):
    import torch

    cfg = _cfg(tiny, tmp_path / "run", nproc=4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(TrainError, match="has 2 GPU"):
        N.check_devices(cfg.train, "cuda")
    monkeypatch.setattr(N.os, "sched_getaffinity", lambda pid: set(range(8)))
    N.check_devices(cfg.train, "cpu")  # CPU ranks: one core each, 8 here
    monkeypatch.setattr(N.os, "sched_getaffinity", lambda pid: {0, 1})
    with pytest.raises(TrainError, match="use 2 core"):
        N.check_devices(cfg.train, "cpu")
    N.check_devices(_cfg(tiny, tmp_path / "run", nproc=2).train, "cuda")


def test_a_vanished_peer_is_one_line_that_says_a_node_died(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path / "run", **_two_nodes())
    gloo = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:58048: Connection reset by peer. This is typically caused by a remote "
            "peer closing the connection\nmore")  # fmt: skip
    with pytest.raises(TrainError, match="a node died") as got, N.node_loss_stops(cfg):
        raise RuntimeError(gloo)
    assert got.value.cause.endswith("(Read error [127.0.0.1]:58048: Connection reset by peer)")
    assert "--resume" in got.value.fix
    with pytest.raises(RuntimeError, match="shape mismatch"), N.node_loss_stops(cfg):
        raise RuntimeError("shape mismatch")  # other errors pass through


# ---------------------------------------------------------------- 2 launchers on loopback


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _launch(config: Path, rank: int, port: int, log: Path) -> subprocess.Popen:
    """Node `rank`'s launcher: `moetune train --json` with the multi-node flags."""
    flags = ["--nnodes", "2", "--node-rank", str(rank), "--master-addr", "127.0.0.1"]
    cmd = [sys.executable, "-m", "moetune", "train", str(config), "--json", *flags,
           "--master-port", str(port)]  # fmt: skip
    with log.open("wb") as out, log.with_suffix(".err").open("wb") as err:
        return subprocess.Popen(cmd, env=_env(), stdout=out, stderr=err)


def _write(tiny, name: str, **over) -> Path:
    config = tiny.root / f"{name}.yaml"
    config.write_text(dump_config(_cfg(tiny, tiny.root / name, **{"max_steps": 8, **over})))
    return config


def _rel_diff(run: Path, reference: Path) -> float:
    from safetensors.torch import load_file

    got = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    want = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and any("experts" in k for k in got)
    return max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)


def _rows(tiny, run: Path) -> list:
    rows = Ledger(tiny.root / "ledger.jsonl").read().rows
    return [r for r in rows if r.kind == "train" and r.run_id == run.name]


_RENDEZVOUS = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
print(os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"], int(total.item()))
dist.destroy_process_group()  # gloo's threads joined before exit (else a rare std::terminate)
"""


def test_two_launchers_on_loopback_meet_as_one_world(tiny, tmp_path):
    """The fast variant of the runs below: moetune's accelerate config for node 0 and node
    1, accelerate's launcher on each, one gloo world of 2 whose all-reduce sums both."""
    script = tmp_path / "meet.py"
    script.write_text(_RENDEZVOUS)
    port, procs = D.free_port(), []
    for k in (1, 0):
        over = _two_nodes(node_rank=k, master_addr="127.0.0.1", master_port=port)
        config = D.write_config(_cfg(tiny, tmp_path / "run", **over), tmp_path / f"n{k}")
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
        procs.append(subprocess.Popen([*cmd, str(script)], env=_env(), text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))  # fmt: skip
    (out1, err1), (out0, err0) = (p.communicate(timeout=300) for p in procs)
    assert [p.returncode for p in procs] == [0, 0], (err0 + err1)[-3000:]
    assert out0.split()[-4:] == ["0", "2", "0", "3"] and out1.split()[-4:] == ["1", "2", "0", "3"]


@pytest.mark.slow
def test_two_nodes_train_the_adapter_of_one_process(tiny):
    """2 launchers × 1 gloo rank (FSDP2 over the 2 "nodes"), batch 2 each: the adapter of
    1 process at batch 4; node 0 alone reports the run and ledgers it."""
    one = tiny.root / "one.log"
    ref = subprocess.run(
        [sys.executable, "-m", "moetune", "train", str(_write(tiny, "one", batch_size=4)),
         "--json"], env=_env(), stdout=one.open("wb"), stderr=subprocess.PIPE, timeout=600,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    config = _write(tiny, "nodes", batch_size=2, strategy="fsdp")
    port = D.free_port()
    procs = [_launch(config, k, port, tiny.root / f"node{k}.log") for k in (1, 0)]
    for k, proc in zip((1, 0), procs, strict=True):
        err = (tiny.root / f"node{k}.err").read_text if proc.wait(timeout=600) else None
        assert proc.returncode == 0, err and err()[-3000:]
    result = json.loads((tiny.root / "node0.log").read_text())
    node1 = json.loads((tiny.root / "node1.log").read_text())
    assert node1 == {"node_rank": 1, "nnodes": 2, "nproc": 1, "status": "ok",
                     "results_on": "node 0"}  # fmt: skip
    assert result["steps"] == 8 and result["signature"]["devices"] == 2
    assert _rel_diff(tiny.root / "nodes", tiny.root / "one") < 1e-4
    ran = json.loads((tiny.root / "nodes" / "summary.json").read_text())["distributed"]
    assert ran["world_size"] == 2 and ran["local_share"] == 0.5  # FSDP2 over both nodes
    mine = _rows(tiny, tiny.root / "nodes")
    assert [r.status for r in mine] == ["ok"]  # global rank 0 alone ledgers


@pytest.mark.slow
def test_a_dead_node_ends_the_other_and_is_ledgered(tiny):
    """kill -9 of node 1's launcher mid-run: node 1's ranks die with it, node 0's ranks
    stop at their next collective, and the attempt is ledgered failed: a node died."""
    name = "dead"
    config = _write(tiny, name, batch_size=2, max_steps=400, strategy="ddp")
    port = D.free_port()
    node1 = _launch(config, 1, port, tiny.root / f"{name}1.log")
    node0 = _launch(config, 0, port, tiny.root / f"{name}0.log")
    deadline = time.monotonic() + 600
    while not (tiny.root / name / "checkpoints" / "step-2").exists():
        assert node0.poll() is None and node1.poll() is None, "a node ended before the kill"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    ranks1 = psutil.Process(node1.pid).children(recursive=True)
    os.kill(node1.pid, signal.SIGKILL)
    killed = time.monotonic()
    assert node0.wait(timeout=180) != 0
    ended = time.monotonic() - killed
    _, alive = psutil.wait_procs(ranks1, timeout=60)
    assert not alive, f"node 1's children outlived it: {alive}"
    err = (tiny.root / f"{name}0.err").read_text().splitlines()
    assert any(line.startswith("error: a node died: ") for line in err)  # rank 0: one line
    assert err[-1].startswith("error: the 1 training processes of node 0 (of 2) failed")
    assert not (tiny.root / name / "summary.json").exists()
    rows = _rows(tiny, tiny.root / name)
    assert [r.status for r in rows] == ["failed"] and "a node died" in rows[0].reason
    assert ended < 120, f"node 0 took {ended:.0f} s to end"
