"""`moetune train RUN --nproc N` (moetune.train.launch): accelerate's own launcher, a
config file accelerate's own parser reads, strategies refused where accelerate cannot run
them, and – slow – 2 gloo processes on CPU that end with the adapter of 1 process at the
same global batch, one ledger row, and a resume after kill -9 of the launcher."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from datetime import timedelta
from importlib.util import find_spec
from pathlib import Path

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import dump_config
from moetune.config.sections import TrainArgs
from moetune.ledger import Ledger
from moetune.lint.preflight import lint_run
from moetune.train import TrainError
from moetune.train import launch as D
from moetune.train.distributed import nodes as N
from moetune.train.rundir.checkpoint import inspect_run
from moetune.train.rundir.lock import hold
from moetune.train.setup import device_args
from test_train_helpers import (
    tiny_cfg,
    tiny_run,
)

SRC = Path(D.__file__).parents[2]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("dist"))


_cfg = tiny_cfg


def _load_accelerate(path: Path):
    from accelerate.commands.config.config_args import load_config_from_file

    return load_config_from_file(str(path))


# ---------------------------------------------------------------- the accelerate config


@pytest.mark.parametrize(
    ("strategy", "kind"), [("ddp", "MULTI_GPU"), ("fsdp", "FSDP"), ("zero3", "DEEPSPEED")]
)
def test_accelerate_parses_the_generated_config(tiny, tmp_path, strategy, kind):
    cfg = _cfg(tiny, tmp_path / "run", nproc=2, strategy=strategy)
    path = D.write_config(cfg, tmp_path / "run")
    parsed = _load_accelerate(path)
    assert str(parsed.distributed_type).endswith(kind)
    assert parsed.num_processes == 2 and parsed.num_machines == 1 and not parsed.use_cpu
    if strategy == "fsdp":
        assert parsed.fsdp_config["fsdp_version"] == 2
        # auto-wrap by the decoder layer class of the model's own transformers class
        assert parsed.fsdp_config["fsdp_transformer_layer_cls_to_wrap"] == "Qwen3MoeDecoderLayer"
    if strategy == "zero3":
        assert parsed.deepspeed_config["zero_stage"] == 3


def test_a_users_accelerate_yaml_is_never_overwritten(tiny, tmp_path):
    mine = tmp_path / "run" / D.CONFIG_NAME
    mine.parent.mkdir()
    mine.write_text("distributed_type: NO\n")
    with pytest.raises(TrainError, match="not written by moetune"):
        D.write_config(_cfg(tiny, mine.parent, nproc=2), mine.parent)
    assert mine.read_text() == "distributed_type: NO\n"


def test_the_launch_config_does_not_make_the_run_dir_foreign(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path / "run", nproc=2)
    D.write_config(cfg, tmp_path / "run")
    assert inspect_run(cfg, resume=False).root == tmp_path / "run"  # fresh, not "not empty"


def test_rank_argv_carries_the_settings_and_flags(tmp_path):
    argv = D.rank_argv(tmp_path / "r.yaml", ["train.nproc=2"], {"resume": True, "json": False})
    assert argv == ["train", str(tmp_path / "r.yaml"), "--set", "train.nproc=2", "--resume"]


# ---------------------------------------------------------------- refused in preflight


def _dist_errors(cfg) -> set[str]:
    findings, _ = lint_run(cfg)
    return {f.rule_id for f in findings if f.rule_id.startswith("DIST-") and f.severity == "error"}


def test_zero3_on_cpu_is_refused_only_beside_a_gpu(tiny, tmp_path, monkeypatch):
    """No CUDA: zero3 ranks run accelerate's DeepSpeed path on the CPU (device_args). With a
    GPU there, device cpu would need use_cpu, which skips DeepSpeed: refused."""
    import torch

    zero3 = _cfg(tiny, tmp_path / "r", nproc=2, strategy="zero3", lora__engine="moetune")
    zero3.model.experts_dtype = "int8"  # split LoRA and quantised stacks shard as well
    assert "DIST-SHARDED-CPU" not in _dist_errors(zero3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "DIST-SHARDED-CPU" in _dist_errors(zero3)
    for strategy in ("ddp", "fsdp"):  # fsdp: accelerate's FSDP2 over gloo (fsdp_on_cpu)
        assert _dist_errors(_cfg(tiny, tmp_path / "r", nproc=2, strategy=strategy)) == set()
    assert _dist_errors(_cfg(tiny, tmp_path / "r", strategy="zero3")) == set()  # one process


def test_a_zero3_rank_on_a_cuda_less_host_asks_accelerate_for_gloo(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_args("cpu") == {"use_cpu": True}  # not a DeepSpeed launch
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert device_args("cpu") == {"use_cpu": False, "ddp_backend": "gloo"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert device_args("cpu") == {"use_cpu": True}  # refused in preflight (above)
    assert device_args("cuda") == {"use_cpu": False}


_SWITCH = """
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from moetune.train.launch import fsdp_on_cpu
fsdp_on_cpu()
acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
print(acc.state.distributed_type.value, acc.is_fsdp2, acc.state.backend)
"""


def test_a_cpu_rank_of_an_fsdp_launch_runs_accelerates_fsdp2(tmp_path):
    """Stock accelerate leaves a CPU rank MULTI_CPU (the DIST-SHARDED-CPU probe); after
    fsdp_on_cpu() the same Accelerator is FSDP2 over gloo. One rank of a world of one."""
    rank = {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    env = _env() | rank | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(D.free_port())}
    env["ACCELERATE_USE_FSDP"] = "true"  # what `accelerate launch` sets for an FSDP config
    done = subprocess.run([sys.executable, "-c", _SWITCH], capture_output=True, text=True,
                          env=env, timeout=300, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["FSDP", "True", "gloo"]


@pytest.mark.skipif(bool(find_spec("deepspeed")), reason="deepspeed is installed here")
def test_zero3_without_deepspeed_is_refused(tiny, tmp_path):
    cfg = _cfg(tiny, tmp_path / "r", nproc=2, strategy="zero3", lora__engine="peft")
    assert "DIST-DEEPSPEED-MISSING" in _dist_errors(cfg)


def test_cli_refuses_before_any_process_starts(tiny, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device cpu beside a GPU
    out = tmp_path / "never"
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, out)))
    got = CliRunner().invoke(app, ["train", str(config), "--nproc", "2", "--strategy", "zero3"])
    assert got.exit_code == 2, got.output
    assert "DIST-SHARDED-CPU" in got.output and "Traceback" not in got.output
    assert not out.exists()  # nothing written: no accelerate.yaml, no run dir


def test_more_cpu_ranks_than_cores_are_refused_before_any_process_starts(tiny, tmp_path):
    out, config = tmp_path / "never", tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, out)))
    cores = len(os.sched_getaffinity(0))
    got = CliRunner().invoke(app, ["train", str(config), "--nproc", str(cores + 1)])
    assert got.exit_code == 2, got.output
    line = " ".join(got.output.split())
    assert f"train.nproc={cores + 1} CPU ranks" in line and f"--nproc {cores} or fewer" in line
    assert not out.exists() and "Traceback" not in got.output


def test_ranks_needing_more_host_ram_than_is_free_are_refused(tiny, tmp_path, monkeypatch):
    from moetune.train.distributed import nodes

    cfg = _cfg(tiny, tmp_path / "never", nproc=2)
    need = nodes.node_ram_bytes(cfg)  # the plan's: 2 × (runtime + the tiny base)
    assert 2 * 0.5e9 < need < 2 * 0.7e9
    out, config = tmp_path / "never", tmp_path / "run.yaml"
    config.write_text(dump_config(cfg))
    monkeypatch.setattr(nodes, "available_ram_bytes", lambda: need - 1)
    got = CliRunner().invoke(app, ["train", str(config), "--nproc", "2"])
    assert got.exit_code == 2, got.output
    assert "ranks need about" in got.output and "pass a smaller --nproc" in got.output
    assert not out.exists()


def test_offload_on_several_ranks_is_refused_by_the_launcher(tiny, tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(D, "_run_ranks", lambda *a: started.append(a) or 1)
    out, config = tmp_path / "never", tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, out, offload="cpu", lora__engine="moetune")))
    for flags in (["--nproc", "2"], ["--nnodes", "2", "--master-addr", "127.0.0.1"]):
        got = CliRunner().invoke(app, ["train", str(config), *flags])
        line = " ".join(got.output.split())
        assert got.exit_code == 2 and "Traceback" not in got.output, got.output
        assert "train.offload=cpu streams one process's expert stacks under" in line, line
        assert "set train.strategy: ep" in line  # where each rank streams its own experts
        assert "--nproc 1 --nnodes 1, or set train.offload: none" in line
    assert started == [] and not out.exists()  # no rank ever started, nothing written


def test_resuming_with_the_same_relative_command_passes_the_launchers_check(
    tiny, tmp_path, monkeypatch
):
    """The killed run saved its paths absolute and resolved; the same command, relative and
    through a symlinked folder, names the same run and starts its ranks with --resume."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    shutil.copy(tiny.data, tmp_path / "real" / "train.jsonl")
    saved = _cfg(tiny, tmp_path / "real" / "runs" / "r", nproc=2)
    saved.data.train_file = str(tmp_path / "real" / "train.jsonl")
    (tmp_path / "real" / "runs" / "r").mkdir(parents=True)
    (tmp_path / "real" / "runs" / "r" / "config.yaml").write_text(dump_config(saved))
    mine = saved.model_copy(deep=True)
    mine.output.dir, mine.data.train_file = "runs/r", "train.jsonl"  # as the user wrote them
    mine.output.ledger = "ledger.jsonl"
    (tmp_path / "real" / "run.yaml").write_text(dump_config(mine))
    monkeypatch.chdir(tmp_path / "link")
    started = []
    monkeypatch.setattr(D, "_run_ranks", lambda config, argv: started.append(argv) or 1)
    got = CliRunner().invoke(app, ["train", "run.yaml", "--nproc", "2", "--resume"])
    assert "different config" not in got.output, got.output
    assert started and "--resume" in started[0]  # the ranks were started
    assert "training processes failed (exit 1)" in " ".join(got.output.split())


def test_resuming_a_finished_launch_starts_no_rank_and_adds_no_row(tiny, tmp_path, monkeypatch):
    """--resume of a run that finished: "already complete", exit 0 – no rank is started
    and the ledger keeps its one row of that run."""
    out = tmp_path / "runs" / "r"
    cfg = _cfg(tiny, out, nproc=2)
    cfg.output.ledger = str(tmp_path / "ledger.jsonl")
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(dump_config(cfg))
    result = {"run_dir": str(out), "adapter_dir": str(out / "adapter"), "steps": 7,
              "final_loss": 0.5, "coverage": 1.0, "router_changed": False, "seconds": 1.0,
              "peak_memory_bytes": 1, "planned_peak_bytes": 1}  # fmt: skip
    (out / "summary.json").write_text(json.dumps({"result": result}))
    started = []
    monkeypatch.setattr(D, "_run_ranks", lambda config, argv: started.append(argv) or 0)
    got = CliRunner().invoke(app, ["train", str(out / "config.yaml"), "--resume", "--json"])
    assert got.exit_code == 0, got.output
    shown = json.loads(got.stdout)
    assert shown["already_complete"] is True and shown["steps"] == 7
    assert not started and not Path(cfg.output.ledger).exists()


@pytest.mark.parametrize(
    ("addr", "said"),
    [("999.1.1.1", "is not an IP address"), ("no-such-node.invalid", "does not resolve")],
)
def test_a_master_address_that_does_not_parse_or_resolve_is_refused(
    tiny, tmp_path, monkeypatch, addr, said
):
    started = []
    monkeypatch.setattr(D, "_run_ranks", lambda *a: started.append(a) or 1)
    out, config = tmp_path / "never", tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, out)))
    got = CliRunner().invoke(app, ["train", str(config), "--nnodes", "2", "--master-addr", addr])
    line = " ".join(got.output.split())
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert f"train.master_addr {addr!r} {said}" in line and "--master-addr" in line
    assert started == [] and not out.exists()


def test_a_node_waiting_for_node_0_says_whom_and_gives_up_at_the_timeout(
    tiny, tmp_path, monkeypatch
):
    started = []
    monkeypatch.setattr(D, "_run_ranks", lambda *a: started.append(a) or 1)
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, tmp_path / "run")))
    port = D.free_port()  # nothing listens there: node 0 never came up
    got = CliRunner().invoke(app, [
        "train", str(config), "--nnodes", "2", "--node-rank", "1", "--master-addr",
        "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "1",
    ])  # fmt: skip
    line = " ".join(got.output.split())
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert f"node 1 of 2: waiting up to 1 s for node 0 at 127.0.0.1:{port}" in line
    assert f"node 0 did not answer at 127.0.0.1:{port} within 1 s" in line
    assert started == []  # no rank was started to retry for ten minutes


@contextlib.contextmanager
def _silent_server():
    """Another service on node 0's port: it accepts every connection and never speaks."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def serve() -> None:
        with contextlib.suppress(OSError):
            while True:
                held.append(server.accept()[0])

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for conn in held:
            conn.close()


def test_a_node_never_waits_past_its_timeout_on_a_service_that_is_not_node_0(
    tiny, tmp_path, monkeypatch
):
    """Something else answering on the master port used to hold node 1 in torchrun's store
    client for good, long past --rdzv-timeout."""
    started = []
    monkeypatch.setattr(D, "_run_ranks", lambda *a: started.append(a) or 1)
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, tmp_path / "run")))
    with _silent_server() as port:
        begun = time.monotonic()
        got = CliRunner().invoke(app, [
            "train", str(config), "--nnodes", "2", "--node-rank", "1", "--master-addr",
            "127.0.0.1", "--master-port", str(port), "--rdzv-timeout", "3",
        ])  # fmt: skip
        took = time.monotonic() - begun
    line = " ".join(got.output.split())
    assert got.exit_code == 2 and "Traceback" not in got.output, got.output
    assert f"something answers at 127.0.0.1:{port} but is not node 0's rendezvous" in line
    assert started == [] and took < 3 + 15  # the timeout, plus the CLI's own start


def test_node_0s_own_store_ends_the_wait(monkeypatch):
    """The other side of the check: torch's TCPStore (what torchrun's node 0 hosts) is
    node 0, and the wait ends as soon as it answers."""
    from torch.distributed import TCPStore  # lazy: heavy to import (torch)

    port = D.free_port()
    store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60))  # fmt: skip
    said = []
    t = TrainArgs(nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=port,
                  rdzv_timeout_s=60)  # fmt: skip
    N.await_master(t, said.append)
    assert said and "waiting up to 60 s for node 0" in said[0]
    del store


@pytest.mark.slow
def test_node_0_waits_the_stated_timeout_for_the_others_then_says_so(tiny, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(dump_config(_cfg(tiny, tmp_path / "run")))
    port = D.free_port()
    flags = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    proc = _moetune("train", str(config), *flags, "--rdzv-timeout", "2", log=tmp_path / "n0.log")
    assert proc.wait(timeout=300) == 2
    err = " ".join((tmp_path / "n0.err").read_text().split())
    assert f"waiting up to 2 s for the other 1 node(s) to join at 127.0.0.1:{port}" in err
    assert f"did not join node 0 at 127.0.0.1:{port} within 2 s" in err
    assert "Traceback" not in err and "DistStoreError" not in err  # torchrun's trace held


def test_the_rendezvous_timeout_reaches_torchrun(tiny, tmp_path):
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.elastic.rendezvous import RendezvousParameters, static_tcp_rendezvous
    from torch.distributed.run import _parse_rendezvous_config

    cfg = _cfg(tiny, tmp_path / "r", nnodes=2, master_addr="10.0.0.1", rdzv_timeout_s=42)
    args = launch_command_parser().parse_args([*D.rdzv_args(cfg), "x.py"])
    # accelerate hands args.rdzv_conf to torchrun's config_from_args; its static
    # rendezvous reads "timeout" from the parsed conf (probes_dist checks the handler)
    conf = _parse_rendezvous_config(args.rdzv_conf)
    params = RendezvousParameters("static", "10.0.0.1:29500", "none", 2, 2, rank=1, **conf)
    assert static_tcp_rendezvous.create_rdzv_handler(params).timeout == timedelta(seconds=42)
    assert D.rdzv_args(_cfg(tiny, tmp_path / "one")) == []  # one node: torchrun's own


# ---------------------------------------------------------------- 2 gloo processes (slow)


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _moetune(*args: str, log: Path) -> subprocess.Popen:
    """`moetune ARGS` in a subprocess; stdout to `log`, stderr beside it (files, not pipes:
    a full pipe would block the ranks)."""
    with log.open("wb") as out, log.with_suffix(".err").open("wb") as err:
        cmd = [sys.executable, "-m", "moetune", *args]
        return subprocess.Popen(cmd, env=_env(), stdout=out, stderr=err)


def _train(config: Path, *flags: str, log: Path) -> dict:
    proc = _moetune("train", str(config), "--json", *flags, log=log)
    assert proc.wait(timeout=600) == 0, log.with_suffix(".err").read_text()[-3000:]
    return json.loads(log.read_text())  # one JSON document: the ranks print nothing


def _write(tiny, name: str, experts_dtype: str = "bf16", **over) -> Path:
    config = tiny.root / f"{name}.yaml"
    cfg = _cfg(tiny, tiny.root / name, **{"max_steps": 8, **over})
    cfg.model.experts_dtype = experts_dtype  # type: ignore[assignment]
    config.write_text(dump_config(cfg))
    return config


def _rel_diff(run: Path, reference: Path) -> float:
    got = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    want = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    assert got.keys() == want.keys() and any("experts" in k for k in got)
    return max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)


# what accelerate runs per strategy on CPU, and each rank's share of the model
RAN = {"ddp": ("MULTI_CPU", 1.0), "fsdp": ("FSDP", 0.5), "zero3": ("DEEPSPEED", 0.5)}
# ZeRO-3: DeepSpeed from its own venv (`make setup-deepspeed`, `make test-deepspeed`); its
# CPU accelerator JIT-builds a C++ op (shm_comm) on a machine's first run
DEEPSPEED = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(not find_spec("deepspeed"), reason="deepspeed is not installed here"),
]


@pytest.fixture(scope="module")
def one(tiny):
    """The reference: 1 process, batch 4."""
    return _train(_write(tiny, "one", batch_size=4), log=tiny.root / "one.log")


@pytest.fixture(
    scope="module",
    params=[
        "fsdp",
        pytest.param("ddp", marks=pytest.mark.slow),
        pytest.param("zero3", marks=DEEPSPEED),
    ],
)
def two(tiny, request):
    """An uninterrupted 2-process run, batch 2 per process (global batch 4)."""
    name = f"two-{request.param}"
    config = _write(tiny, name, batch_size=2, nproc=2, strategy=request.param)
    result = _train(config, log=tiny.root / f"{name}.log")
    return types.SimpleNamespace(result=result, run=tiny.root / name, strategy=request.param)


def test_two_processes_train_the_adapter_of_one(tiny, one, two):
    """FSDP2 (accelerate's, over gloo), DeepSpeed ZeRO-3 (its CPU accelerator over gloo) and
    DDP: the adapter of one process, from rank 0."""
    assert two.result["steps"] == one["steps"] == 8
    assert two.result["signature"]["devices"] == 2
    assert _rel_diff(two.run, tiny.root / "one") < 1e-4
    rows = [r for r in Ledger(tiny.root / "ledger.jsonl").read().rows if r.kind == "train"]
    mine = [r for r in rows if r.metrics.get("run_dir") == str(two.run)]
    assert len(mine) == 1 and mine[0].status == "ok"  # rank 0 alone ledgers
    assert json.loads((two.run / "coverage.json").read_text())["coverage"] == 1.0
    summary = json.loads((two.run / "summary.json").read_text())
    assert summary["router"]["changed"] is False
    ran = summary["distributed"]
    assert (ran["accelerate"], ran["local_share"]) == RAN[two.strategy]  # really sharded
    assert ran["sharded_parameters"] == (ran["parameters"] if two.strategy != "ddp" else 0)
    if two.strategy == "fsdp":  # a sharded load: rank 0 alone read the weights
        _assert_loaded_once(ran["load"]["ranks"], tiny.model)
    if two.strategy == "zero3":  # built under zero.Init: no rank ever held the whole base
        _assert_partitioned_at_load(ran["load"]["ranks"], tiny.model)
    audits = [
        json.loads((run / "coverage.json").read_text()) for run in (two.run, tiny.root / "one")
    ]
    assert audits[0]["total_params"] == audits[1]["total_params"]  # ZeRO-3: counted whole
    # one rank's share is planned, everywhere the run reports it (launcher's result included)
    planned = json.loads((two.run / "preflight.json").read_text())["run_plan"]
    assert planned["kind"] == summary["memory"]["planned_by"] == "per_rank"
    assert planned["detail"] == {"ranks": 2, "strategy": two.strategy}
    figure = planned["peak_bytes"]
    assert summary["memory"]["planned_peak_bytes"] == two.result["planned_peak_bytes"] == figure
    assert mine[0].metrics["planned_peak_bytes"] == figure


def _weights(model_dir: Path) -> tuple[int, int]:
    """(bytes of the checkpoint, bytes of its largest decoder layer)."""
    tensors = load_file(str(next(model_dir.glob("*.safetensors"))))
    layers: dict[str, int] = {}
    for name, t in tensors.items():
        if ".layers." in name:
            index = name.split(".layers.")[1].split(".")[0]
            layers[index] = layers.get(index, 0) + t.numel() * t.element_size()
    return sum(t.numel() * t.element_size() for t in tensors.values()), max(layers.values())


def _assert_loaded_once(ranks: list[dict], model_dir: Path) -> None:
    """Measured on each rank: the host bytes its base held after loading, and the peak of
    live tensor bytes while accelerate broadcast rank 0's weights into the shards."""
    whole, layer = _weights(model_dir)
    main, other = ranks
    assert main["loaded_bytes"] >= whole  # rank 0 read the checkpoint (the count counts)
    assert other["loaded_bytes"] < layer  # rank 1: meta parameters, real buffers only
    held = other["loaded_bytes"] + other["broadcast_peak_bytes"]
    assert held <= other["sharded_bytes"] + layer  # never more than its shard + one layer
    assert other["sharded_bytes"] < whole  # ... and it ends with half


def _assert_partitioned_at_load(ranks: list[dict], model_dir: Path) -> None:
    """ZeRO-3 under zero.Init, measured on each rank: the host bytes its base held right
    after from_pretrained, and the peak of live tensor bytes while it loaded."""
    whole, layer = _weights(model_dir)
    for rank in ranks:  # its half of every parameter (+ the rotary table), rank 0's too
        assert whole // 2 <= rank["loaded_bytes"] < whole // 2 + 1024
    other = ranks[1]  # read no weights: meta state dict, its partitions scattered to it
    assert other["load_peak_bytes"] <= other["loaded_bytes"] + layer < whole


def _kill_9_after_step_2(proc: subprocess.Popen, out: Path, log: Path) -> None:
    """kill -9 the launcher once its run committed step 2 (and before it finished)."""
    deadline = time.monotonic() + 600
    while not (out / "checkpoints" / "step-2").exists():
        assert proc.poll() is None, log.with_suffix(".err").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (out / "summary.json").exists(), "the run ended before the kill"


@pytest.mark.slow
def test_kill_9_of_the_launcher_then_resume(tiny, two):
    name = f"killed-{two.strategy}"
    config = _write(tiny, name, batch_size=2, nproc=2, strategy=two.strategy)
    out, log = tiny.root / name, tiny.root / f"{name}.log"
    proc = _moetune("train", str(config), log=log)
    _kill_9_after_step_2(proc, out, log)
    _wait_released(out)  # the ranks die with the launcher (PDEATHSIG) and free the lock
    result = _train(config, "--resume", log=tiny.root / f"resumed-{two.strategy}.log")
    assert result["resumed_from_step"] is not None and result["steps"] == 8
    assert _rel_diff(out, two.run) < 1e-4


@pytest.mark.slow
def test_kill_9_then_the_same_relative_command_resumes(tiny, tmp_path, monkeypatch):
    """`moetune train run.yaml --nproc 2` with relative paths, killed, then the very same
    command with --resume: the launcher compares the saved (absolute) paths resolved."""
    shutil.copy(tiny.data, tmp_path / "rows.jsonl")
    cfg = _cfg(tiny, tmp_path / "unused", nproc=2, max_steps=8, batch_size=2)
    cfg.output.dir, cfg.data.train_file, cfg.output.ledger = "rel", "rows.jsonl", "l.jsonl"
    (tmp_path / "run.yaml").write_text(dump_config(cfg))
    monkeypatch.chdir(tmp_path)  # the subprocesses start here
    out, log = tmp_path / "rel", tmp_path / "killed.log"
    proc = _moetune("train", "run.yaml", log=log)
    _kill_9_after_step_2(proc, out, log)
    _wait_released(out)
    result = _train(Path("run.yaml"), "--resume", log=tmp_path / "resumed.log")
    assert result["resumed_from_step"] is not None and result["steps"] == 8


def _ranks(launcher: int) -> list:
    """The launcher's descendants that are ranks (`-m moetune train`, not accelerate's)."""
    import psutil

    found = []
    for proc in psutil.Process(launcher).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            line = " ".join(proc.cmdline())
            if "moetune train" in line and "accelerate" not in line:
                found.append(proc)
    return found


def _gone(proc) -> bool:
    import psutil

    try:
        return proc.status() == psutil.STATUS_ZOMBIE  # dead, waiting to be reaped
    except psutil.NoSuchProcess:
        return True


def test_every_rank_dies_with_its_launcher_after_kill_9(tiny, tmp_path):
    """SIGKILL leaves the launcher no chance to clean up: PDEATHSIG in the accelerate
    launcher and in each rank takes every process of the launch down with it."""
    config = _write(tiny, "orphans", batch_size=2, nproc=2, max_steps=100000, save_steps=100000)
    proc = _moetune("train", str(config), log=tmp_path / "orphans.log")
    deadline = time.monotonic() + 600
    while len(_ranks(proc.pid)) < 2:
        assert proc.poll() is None, (tmp_path / "orphans.err").read_text()[-3000:]
        assert time.monotonic() < deadline, "the ranks never started"
        time.sleep(0.2)
    import psutil

    family = psutil.Process(proc.pid).children(recursive=True)  # ranks and their launcher
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(5)
    alive = [p.pid for p in family if not _gone(p)]
    for pid in alive:  # never leave them to the next test
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert alive == [], f"{len(alive)} of {len(family)} processes outlived the launcher"


def _wait_released(root: Path, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with hold(root):
                return
        except TrainError:
            assert time.monotonic() < deadline, "the ranks still hold the run dir"
            time.sleep(0.2)


def test_train_refuses_nproc_outside_a_launch(tiny, tmp_path, monkeypatch):
    from moetune.train import train

    for name in ("LOCAL_RANK", "WORLD_SIZE", "RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(TrainError, match="not a launched rank"):
        train(_cfg(tiny, tmp_path / "r", nproc=2), progress=False)
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "experts_dtype", "engine"),
    [("ddp", "int8", "auto"), ("fsdp", "int8", "auto"), ("fsdp", "nf4", "auto"),
     ("fsdp", "bf16", "peft"), pytest.param("zero3", "int8", "auto", marks=DEEPSPEED),
     pytest.param("zero3", "nf4", "auto", marks=DEEPSPEED),
     pytest.param("zero3", "bf16", "peft", marks=DEEPSPEED)],
)  # fmt: skip
def test_engine_variants_train_sharded_like_one_process(tiny, strategy, experts_dtype, engine):
    """Quantised expert stacks (moetune's engine) and peft's ParamWrapper on 2 ranks: the
    1-process adapter (split LoRA in bf16 is the default run above)."""
    name = f"{strategy}-{experts_dtype}-{engine}"
    over = {"max_steps": 2, "lora__engine": engine}
    two = _write(tiny, f"{name}-2", experts_dtype, batch_size=2, nproc=2, strategy=strategy, **over)
    got = _train(two, log=tiny.root / f"{name}-2.log")
    one = _train(_write(tiny, f"{name}-1", experts_dtype, batch_size=4, **over),
                 log=tiny.root / f"{name}-1.log")  # fmt: skip
    assert got["coverage"] == one["coverage"] == 1.0
    if experts_dtype != "bf16":
        assert json.loads((tiny.root / f"{name}-2" / "quant.json").read_text())  # quantised
    assert _rel_diff(tiny.root / f"{name}-2", tiny.root / f"{name}-1") < 1e-4
    if (strategy, experts_dtype) == ("zero3", "bf16"):  # peft's wrappers on zero.Init's base
        summary = json.loads((tiny.root / f"{name}-2" / "summary.json").read_text())
        _assert_partitioned_at_load(summary["distributed"]["load"]["ranks"], tiny.model)
    if strategy == "fsdp":  # loaded once, every experts dtype: rank 1 read no weights
        summary = json.loads((tiny.root / f"{name}-2" / "summary.json").read_text())
        main, other = summary["distributed"]["load"]["ranks"]
        assert other["loaded_bytes"] < 100 < main["loaded_bytes"]  # its rotary table only
        assert other["sharded_bytes"] < main["loaded_bytes"]  # ... and it ends with a share


@pytest.mark.parametrize(
    "strategy", [pytest.param("zero3", marks=DEEPSPEED), pytest.param("ep", marks=pytest.mark.slow)]
)
def test_expert_selection_scores_the_partitioned_base_like_one_process(tiny, strategy):
    """ZeRO-3 under zero.Init: the experts are scored on the partitioned base, gathered one
    decoder layer at a time on every rank; ep: every rank scores the same rows, its tokens
    exchanged with the experts' ranks, and trains the selected experts it holds – the same
    choice and adapter as one process."""
    over = {"max_steps": 2, "lora__expert_selection": "gate", "lora__expert_selection_share": 0.5}
    name = f"select-{strategy}"
    _train(_write(tiny, f"{name}-2", batch_size=2, nproc=2, strategy=strategy, **over),
           log=tiny.root / f"{name}-2.log")  # fmt: skip
    _train(_write(tiny, f"{name}-1", batch_size=4, **over), log=tiny.root / f"{name}-1.log")
    chosen = [json.loads((tiny.root / f"{name}-{n}" / "experts_selected.json").read_text())
              for n in (2, 1)]  # fmt: skip
    assert chosen[0]["selected"] == chosen[1]["selected"] and chosen[0]["trained_experts"] == 4
    assert _rel_diff(tiny.root / f"{name}-2", tiny.root / f"{name}-1") < 1e-4


def test_a_run_saved_before_nproc_existed_still_resumes(tiny, tmp_path):
    """config.yaml written by a moetune without train.nproc/strategy: same run at defaults."""
    import yaml

    from moetune.train.rundir.checkpoint import config_diff

    cfg = _cfg(tiny, tmp_path / "r")
    old = yaml.safe_load(dump_config(cfg))
    del old["train"]["nproc"], old["train"]["strategy"]
    assert config_diff(yaml.safe_dump(old), cfg) == []
    cfg.train.nproc = 2
    assert config_diff(yaml.safe_dump(old), cfg) == ["train.nproc (None -> 2)"]
