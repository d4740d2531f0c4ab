"""The offload rules: a host short of the RAM the plan needs, disk offload without the disk
space, offload on a GGUF base – each fires on the trap and is silent on the fixed config."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from moetune.config import RunConfig
from moetune.lint import RULES, LintContext
from moetune.model import load_spec
from moetune.model.spec import ModelSpec
from moetune.plan.offload.memory import plan_offload

QWEN235 = "Qwen/Qwen3-235B-A22B"


@pytest.fixture(autouse=True)
def _empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk rule skips a checkpoint already in the hub cache; the developer's must not count."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@cache
def spec(model_id: str) -> ModelSpec:
    return load_spec(model_id)


def ctx(model: str = QWEN235, **sections: Any) -> LintContext:
    cfg = RunConfig.model_validate({"model": {"id": model}, "lora": {"rank": 16}, **sections})
    return LintContext(config=cfg, spec=spec(model), env={}, versions={})


def check(rule_id: str, context: LintContext) -> Any:
    return RULES.get(rule_id).check(context)


def test_the_rules_are_registered_with_a_probe() -> None:
    for rule_id in ("OFFLOAD-HOST-RAM", "OFFLOAD-DISK-SPACE", "OFFLOAD-GGUF"):
        assert RULES.get(rule_id).severity == "error" and RULES.get(rule_id).probe_fn


def test_host_without_the_ram_for_cpu_offload_is_an_error() -> None:
    short = ctx(train={"offload": "cpu"}, hardware={"card": "H100-80GB", "host_ram_gb": 256})
    f = check("OFFLOAD-HOST-RAM", short)
    need = plan_offload(short.spec, short.config, "H100-80GB").host_ram_bytes  # type: ignore[arg-type]
    assert f and f.severity == "error" and f.field == "train.offload"
    assert f"{need / 1024**3:,.1f} GiB" in f.message and "238.4 GiB" in f.message  # 256 GB
    assert "train.offload: disk" in f.fix


def test_enough_host_ram_or_disk_offload_is_silent() -> None:
    hardware = {"card": "H100-80GB", "host_ram_gb": 512}
    assert check("OFFLOAD-HOST-RAM", ctx(train={"offload": "cpu"}, hardware=hardware)) is None
    small = {"card": "H100-80GB", "host_ram_gb": 64}  # disk pins two layers only: 9 GiB
    assert check("OFFLOAD-HOST-RAM", ctx(train={"offload": "disk"}, hardware=small)) is None
    assert check("OFFLOAD-HOST-RAM", ctx(hardware=small)) is None  # no offload: no rule


def test_disk_offload_without_the_space_is_an_error() -> None:
    hardware = {"card": "H100-80GB", "disk_gb": 200}
    f = check("OFFLOAD-DISK-SPACE", ctx(train={"offload": "disk"}, hardware=hardware))
    assert f and f.severity == "error" and "hardware.disk_gb" in f.message
    assert "186.3 GiB" in f.message and "423.0 GiB" in f.message


def test_disk_space_measured_at_the_output_dir(tmp_path: Path, monkeypatch: Any) -> None:
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10**9))
    out = {"dir": str(tmp_path / "not" / "yet" / "there")}
    run = ctx(train={"offload": "disk"}, hardware={"card": "H100-80GB"}, output=out)
    f = check("OFFLOAD-DISK-SPACE", run)
    assert f and "free at" in f.message and "0.9 GiB" in f.message
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=10**13))
    assert check("OFFLOAD-DISK-SPACE", run) is None


def test_a_local_bf16_checkpoint_is_already_the_files_that_stream(tmp_path: Path) -> None:
    (tmp_path / "hub" / "models--Qwen--Qwen3-235B-A22B" / "snapshots").mkdir(parents=True)
    assert check("OFFLOAD-DISK-SPACE", ctx(train={"offload": "disk"})) is None


def test_offload_on_a_gguf_base_is_refused() -> None:
    gguf = RunConfig.model_validate({"model": {"id": "x/y.gguf"}, "train": {"offload": "cpu"}})
    f = check("OFFLOAD-GGUF", LintContext(config=gguf, env={}, versions={}))
    assert f and f.severity == "error" and "safetensors" in f.fix
    plain = RunConfig.model_validate({"model": {"id": "x/y.gguf"}})
    assert check("OFFLOAD-GGUF", LintContext(config=plain, env={}, versions={})) is None
