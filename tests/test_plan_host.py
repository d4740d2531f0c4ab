"""This host as a card ("cpu"): `moetune doctor --calibrate` measures and stores its rates,
a hand-written host.json is read (a bad one refused in one line), a CPU-only host's
`plan --offload disk` plans it, and the offload step time follows its rates."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import moetune.lint.calibrate as calibrate
import moetune.plan.host as host
import moetune.plan.offload.memory as offload
from moetune.cli import app
from moetune.config import RunConfig, parse_config
from moetune.errors import ConfigError
from moetune.model import spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.spec import ModelSpec
from moetune.plan.fit import analytic
from moetune.plan.host import HostProfile, cpu_card, load_host
from moetune.plan.offload.cpu_step import STREAM_EFFICIENCY
from moetune.plan.offload.memory import plan_offload
from moetune.plan.overhead import CPU_PROCESS_BASELINE
from test_train_helpers import write_small_moe_config

GB = 10**9
HAND = {
    "cpu": "Hand CPU", "cores": 8, "threads": 8, "ram_bytes": 64 * GB,
    "measured_at": "2026-12-05T00:00:00Z", "fp32_gflops": 200.0, "bf16_gflops": 400.0,
    "memcpy_gb_per_s": 10.0, "disk_read_gb_per_s": 2.0,
}  # fmt: skip


@pytest.fixture
def host_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """host.json in a temp config dir; this machine's RAM fixed at 64 GB total, 40 free."""
    path = tmp_path / "config" / "host.json"
    monkeypatch.setenv("MOETUNE_HOST_FILE", str(path))
    monkeypatch.setattr(host, "ram", lambda: (64 * GB, 40 * GB))
    return path


def write(path: Path, **over: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**HAND, **over}))
    return path


@pytest.fixture(scope="module")
def tiny() -> ModelSpec:
    return spec_from_config(shrunk_config("qwen3_moe"), "qwen3_moe")


def cfg(offload: str = "disk", **train: Any) -> RunConfig:
    raw = {"lora": {"rank": 4, "targets": ["attention", "experts"]},
           "train": {"seq_len": 64, "offload": offload, **train}}  # fmt: skip
    return parse_config(raw)


def test_calibrate_writes_host_json_and_leaves_no_probe_behind(
    host_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate, "SECONDS", 0.05)
    monkeypatch.setattr(calibrate, "ram", host.ram)  # the fixture's 64 GB
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["doctor", "--calibrate", "--path", str(disk), "--probe-mib", "4", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    shown = json.loads(result.stdout)
    assert shown["stored_at"] == str(host_file) and shown["source"] == "calibrated"
    assert list(disk.iterdir()) == []  # the 4 MiB probe file is gone
    stored = load_host()
    assert stored is not None and stored.model_dump() == json.loads(host_file.read_text())
    assert stored.fp32_gflops > 0 and stored.memcpy_gb_per_s > 0 and stored.disk_read_gb_per_s > 0
    assert stored.ram_bytes == 64 * GB and stored.disk_path == str(disk.resolve())


def test_a_hand_written_file_is_the_cpu_card(host_file: Path) -> None:
    write(host_file)
    card = cpu_card()
    assert card.id == "cpu" and card.is_host and card.name == "this host (Hand CPU)"
    assert card.memory_bytes == 64 * GB and card.usable_bytes == 40 * GB  # available now
    assert card.rates is not None and card.rates.calibrated
    assert (card.rates.gflops(4), card.rates.gflops(2)) == (200.0, 400.0)
    assert card.host_link is not None and card.host_link.bytes_per_s == 10 * GB


def test_no_file_is_defaults_that_say_so(host_file: Path, tiny: ModelSpec) -> None:
    card = cpu_card()
    assert card.rates is not None and not card.rates.calibrated
    assert card.memory_bytes == 64 * GB  # this machine's RAM
    notes = " ".join(plan_offload(tiny, cfg(), None).notes)
    assert "uncalibrated: run `moetune doctor --calibrate`" in notes


@pytest.mark.parametrize(
    ("over", "cause"),
    [({"fp32_gflops": -1}, "fp32_gflops: Input should be greater than or equal to 0.000001"),
     ({"disk_gbps": 1.0}, "disk_gbps: Extra inputs are not permitted")],
)  # fmt: skip
def test_a_bad_file_is_refused_in_one_line(host_file: Path, tmp_path: Path,
                                           over: dict[str, Any], cause: str) -> None:  # fmt: skip
    write(host_file, **over)
    with pytest.raises(ConfigError, match=cause):
        load_host()
    model = write_small_moe_config(tmp_path / "model")
    result = CliRunner().invoke(app, ["plan", str(model), "--card", "cpu"])
    assert result.exit_code == 2
    assert cause in result.output and "Traceback" not in result.output
    assert "doctor --calibrate" in result.output  # the fix


def test_a_file_that_is_not_json_is_refused(host_file: Path) -> None:
    host_file.parent.mkdir(parents=True)
    host_file.write_text("{fp32: fast}")
    with pytest.raises(ConfigError, match="not JSON"):
        load_host()


def test_a_cpu_only_host_plans_itself(
    host_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(host_file)
    monkeypatch.setattr(offload, "has_cuda", lambda: False)
    model = write_small_moe_config(tmp_path / "model")
    args = ["plan", str(model), "--offload", "disk", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    plans = json.loads(result.stdout)["offload"]
    assert list(plans) == ["cpu"]
    cpu = plans["cpu"]
    assert cpu["usable_bytes"] == 40 * GB and cpu["host_ram_available_bytes"] == 64 * GB
    assert cpu["transfer_bytes_per_s"] == pytest.approx(2 * GB * STREAM_EFFICIENCY)
    # with CUDA here the catalog's cards are planned, and --card cpu still plans this host
    monkeypatch.setattr(offload, "has_cuda", lambda: True)
    gpu = json.loads(CliRunner().invoke(app, args).stdout)["offload"]
    assert "cpu" not in gpu and "H100-80GB" in gpu
    named = json.loads(CliRunner().invoke(app, [*args, "--card", "cpu"]).stdout)["offload"]
    assert list(named) == ["cpu"]


def test_the_peak_is_the_process_rss_at_the_compute_dtype(host_file: Path, tiny: ModelSpec) -> None:
    write(host_file)
    plan = plan_offload(tiny, cfg("cpu"), None)
    fp32 = parse_config({**cfg("cpu").model_dump(), "model": {"dtype": "float32"}})
    frozen = analytic(tiny, fp32).components["frozen_weights"]  # train loads fp32 on a CPU
    parts = plan.device_components
    assert parts["resident_weights"] == frozen and parts["process_baseline"] == CPU_PROCESS_BASELINE
    assert plan.device_peak_bytes == sum(parts.values()) == plan.host_ram_bytes
    assert plan.fits is (plan.device_peak_bytes <= 40 * GB)
    bf16 = plan_offload(tiny, cfg("cpu", precision="bf16"), None)
    assert bf16.device_components["resident_weights"] == frozen // 2


def _rates(host_file: Path, **over: Any) -> Any:
    write(host_file, **over)
    return cpu_card()


def test_step_time_follows_the_rates(host_file: Path, tiny: ModelSpec) -> None:
    run = cfg("disk", gradient_checkpointing=True, grad_accum=2)
    slow = plan_offload(tiny, run, _rates(host_file, disk_read_gb_per_s=1e-3))
    # read-bound: 4 MoE layers × 3 phases × 2 micro-batches, each layer's file bytes at
    # the disk rate × the reader's efficiency, plus the non-expert compute
    file_layer = slow.bytes_moved_per_step["forward"] / (4 * 2)
    read = 24 * file_layer / (1e-3 * GB * STREAM_EFFICIENCY)
    assert slow.bound == "transfer" and slow.transfer_s == pytest.approx(read)
    rest = slow.step_time_s - read
    assert 0 < rest < slow.compute_s
    half = plan_offload(tiny, run, _rates(host_file, disk_read_gb_per_s=5e-4))
    assert half.step_time_s - rest == pytest.approx(2 * read)  # half the disk: twice the reads
    # compute-bound: a fast disk leaves the cores, whose time is the step
    fast = plan_offload(tiny, run, _rates(host_file, disk_read_gb_per_s=1e3))
    assert fast.bound == "compute" and fast.step_time_s == pytest.approx(fast.compute_s)
    quicker = plan_offload(tiny, run, _rates(host_file, disk_read_gb_per_s=1e3, fp32_gflops=400.0,
                                             memcpy_gb_per_s=20.0))  # fmt: skip
    assert quicker.step_time_s == pytest.approx(fast.step_time_s / 2)


def test_offload_cpu_on_a_cpu_reads_nothing(host_file: Path, tiny: ModelSpec) -> None:
    plan = plan_offload(tiny, cfg("cpu"), _rates(host_file, disk_read_gb_per_s=1e-6))
    assert plan.transfer_s == 0 and plan.step_time_s == pytest.approx(plan.compute_s)


def test_the_profile_documents_every_field() -> None:
    assert all(f.description for f in HostProfile.model_fields.values())


def test_the_memory_plan_for_this_host_alone_counts_fp32(host_file: Path, tiny: ModelSpec) -> None:
    from moetune.plan import make_plan

    run = cfg("none")
    fp32 = parse_config({**run.model_dump(), "model": {"dtype": "float32"}})
    on_cpu = make_plan(tiny, run, cards=["cpu"])
    assert on_cpu.peak_bytes == analytic(tiny, fp32).peak_bytes > analytic(tiny, run).peak_bytes
    assert on_cpu.overhead.terms == {"process_baseline": CPU_PROCESS_BASELINE}
    mixed = make_plan(tiny, run, cards=["cpu", "H100-80GB"])  # the configured dtype
    assert mixed.peak_bytes == analytic(tiny, run).peak_bytes


@pytest.mark.parametrize(
    "theirs",
    [b"my notes about this box\n", b'{"theme": "dark"}', b"", b"[1, 2]"],
    ids=["notes", "other-json", "empty", "a-list"],
)
def test_calibrate_never_overwrites_a_file_it_did_not_make(
    host_file: Path, tmp_path: Path, theirs: bytes
) -> None:
    """MOETUNE_HOST_FILE naming a user's own file used to be overwritten without a word."""
    host_file.parent.mkdir(parents=True)
    host_file.write_bytes(theirs)
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["doctor", "--calibrate", "--path", str(disk), "--probe-mib", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert "is not a host file moetune wrote" in result.output and str(host_file) in result.output
    assert "Traceback" not in result.output
    assert host_file.read_bytes() == theirs and list(disk.iterdir()) == []


def test_calibrate_refuses_a_directory_and_rewrites_its_own_file(
    host_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(calibrate, "SECONDS", 0.01)
    host_file.mkdir(parents=True)
    result = CliRunner().invoke(app, ["doctor", "--calibrate", "--probe-mib", "1"])
    assert result.exit_code == 2 and "is not a regular file" in result.output, result.output
    host_file.rmdir()
    write(host_file, fp32_gflops=-1)  # a host file with a bad value: recalibrating is the fix
    disk = tmp_path / "disk"
    disk.mkdir()
    args = ["doctor", "--calibrate", "--path", str(disk), "--probe-mib", "1"]
    assert CliRunner().invoke(app, args).exit_code == 0
    stored = load_host()
    assert stored is not None and stored.source == "calibrated" and stored.fp32_gflops > 0


CHILD = """
import sys, time
import moetune.engine.direct_io as direct_io
from moetune.cli import app

def stuck(paths, budget):  # the disk probe's read, held so SIGTERM lands while the file exists
    print("probing", flush=True)
    time.sleep(120)

direct_io.read_rate = stuck
app(["doctor", "--calibrate", "--path", sys.argv[1], "--probe-mib", "1"])
"""


def test_sigterm_during_calibration_removes_the_probe_file(host_file: Path, tmp_path: Path) -> None:
    """SIGTERM used to kill the calibration with its probe file (up to 1 GiB) left behind."""
    disk = tmp_path / "disk"
    disk.mkdir()
    env = {**os.environ, "MOETUNE_HOST_FILE": str(host_file)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(disk)], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert child.stdout is not None and child.stdout.readline() == "probing\n"
        assert len(list(disk.iterdir())) == 1  # the probe is there while it is read
        child.send_signal(signal.SIGTERM)
        _, err = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode not in (0, -signal.SIGTERM), err
    assert list(disk.iterdir()) == [] and not host_file.exists()
    assert "terminated (SIGTERM)" in err and "moetune doctor --calibrate" in err
    assert "Traceback" not in err
