"""The plan a run reports is the plan of the configuration that ran (plan/run_plan.py):
with train.nproc one rank's share, with train.offload the offload plan (its experts counted
as the run stores them), else the preflight's one-device memory plan – built by `prepare`
from the exact RunConfig, and written to preflight.json before anything trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from moetune.config import RunConfig
from test_train_helpers import reverse_rows, run_config, write_jsonl
from test_train_offload import save_model

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("planned")
    return save_model(root / "model"), write_jsonl(root / "d.jsonl", reverse_rows(16))


def _config(tiny: tuple[Path, Path], out: Path, experts_dtype: str = "bf16", **over: Any) -> Any:
    cfg = run_config(*tiny, out, lora__engine="moetune", lora__targets=["attention", "experts"],
                     **over)  # fmt: skip
    cfg.model.experts_dtype = experts_dtype
    return cfg


def _prepared(cfg: RunConfig) -> Any:
    """The Setup of `cfg`, as `train` settles it before loading the model."""
    from moetune.train.rundir.checkpoint import inspect_run
    from moetune.train.setup import prepare

    return prepare(cfg, inspect_run(cfg, False), False, True)


def _as_run(cfg: RunConfig) -> RunConfig:
    """`cfg` as a CPU run holds it: the base in float32 (setup.Placement)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "float32"})})


def test_nproc_plans_one_ranks_share(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from moetune.plan.devices.sharding import per_rank_bytes
    from moetune.plan.overhead import CPU_PROCESS_BASELINE

    cfg = _config(tiny, tmp_path / "run", nproc=2, strategy="fsdp")
    setup = _prepared(cfg)
    share = per_rank_bytes(setup.spec, _as_run(cfg), 2, "fsdp")
    assert setup.run_plan.kind == "per_rank"
    assert setup.run_plan.components == {**share, "process_baseline": CPU_PROCESS_BASELINE}
    assert sum(share.values()) < setup.plan.peak_bytes  # not one device holding it all
    preflight = json.loads((tmp_path / "run" / "preflight.json").read_text())
    assert preflight["run_plan"]["peak_bytes"] == sum(share.values()) + CPU_PROCESS_BASELINE


def test_offload_with_int8_experts_plans_their_quantised_bytes(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:  # fmt: skip
    from moetune.plan.offload.memory import plan_offload

    cfg = _config(tiny, tmp_path / "int8", "int8", offload="cpu")
    setup = _prepared(cfg)
    plan = plan_offload(setup.spec, _as_run(cfg), None)
    assert setup.run_plan.kind == "offload" and setup.planned_peak_bytes == plan.host_ram_bytes
    drop = lambda d: {k: v for k, v in d.items() if k != "usable_bytes"}  # noqa: E731  RAM free now
    assert drop(setup.run_plan.detail) == drop(plan.to_json())
    bf16 = _prepared(_config(tiny, tmp_path / "bf16", offload="cpu"))
    held = "resident_weights"  # host RAM is the device: the offloaded stacks are held there
    assert setup.run_plan.components[held] < bf16.run_plan.components[held]


def test_no_offload_one_process_is_the_memory_plan(
    tiny: tuple[Path, Path], tmp_path: Path
) -> None:  # fmt: skip
    from moetune.plan.overhead import CPU_PROCESS_BASELINE

    setup = _prepared(_config(tiny, tmp_path / "run"))
    assert setup.run_plan.kind == "memory"  # on CPU: the process, as its peak RSS counts
    assert setup.planned_peak_bytes == setup.plan.peak_bytes + CPU_PROCESS_BASELINE
    assert setup.run_plan.required_bytes == setup.plan.required_bytes


def test_offload_on_a_card_compares_its_live_tensors(tiny: tuple[Path, Path]) -> None:
    """On CUDA the measured figure is max_memory_allocated: the device's live tensors, so
    the card's overhead is left out of the compared figure and kept as the requirement."""
    from moetune.model import load_spec
    from moetune.plan.offload.memory import plan_offload
    from moetune.plan.run_plan import plan_of_run

    cfg = _config(tiny, tiny[0].parent / "unused", offload="disk")
    cfg.hardware.card, cfg.train.device = "H100-80GB", "auto"
    spec = load_spec(str(tiny[0]))
    ran = plan_of_run(spec, cfg, "cuda", None)
    plan = plan_offload(spec, cfg, "H100-80GB")
    assert ran is not None and ran.label == "offload disk, H100-80GB"
    overhead = plan.device_components["overhead"]
    assert ran.peak_bytes == plan.device_peak_bytes - overhead > 0
    assert ran.required_bytes == plan.device_peak_bytes
