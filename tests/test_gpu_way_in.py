"""A GPU user's way in: the torch build `make setup` picks per platform, what `moetune
doctor` reports of torch, its devices and the config's card, and CARD-NOT-HERE – a CUDA
hardware.card on a host that cannot run it is refused by lint and by train's preflight."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RunConfig
from moetune.lint.registry import RULES, LintContext
from moetune.lint.torch_index import INDEX, Machine, choose
from moetune.model.tiny import TINY_CONFIGS
from moetune.plan.cost.walls import Site
from moetune.train.errors import TrainError
from moetune.train.setup import Placement, auto_precision, preflight

runner = CliRunner()
GiB = 1024**3


@pytest.mark.parametrize(
    ("machine", "build", "index"),
    [
        (Machine("Linux", "x86_64", (12, 8)), "cu128", f"{INDEX}/cu128"),
        (Machine("Linux", "x86_64", (13, 1)), "cu130", f"{INDEX}/cu130"),
        (Machine("Linux", "x86_64", (12, 7)), "cu126", f"{INDEX}/cu126"),
        # GH200 / GB200 / DGX Spark: PyPI's aarch64 wheel is CPU-only, the index has CUDA
        (Machine("Linux", "aarch64", (12, 9)), "cu128", f"{INDEX}/cu128"),
        (Machine("Linux", "aarch64", (13, 0)), "cu130", f"{INDEX}/cu130"),
        (Machine("Linux", "x86_64", None, rocm=(6, 4)), "rocm6.4", f"{INDEX}/rocm6.4"),
        (Machine("Linux", "x86_64", None), "cpu", f"{INDEX}/cpu"),
        (Machine("Linux", "aarch64", None), "cpu", f"{INDEX}/cpu"),
        (Machine("Darwin", "arm64", None), "mps", None),  # PyPI's macOS wheel has MPS
    ],
)
def test_setup_picks_the_torch_build_of_each_platform(
    machine: Machine, build: str, index: str | None
) -> None:
    choice = choose(machine)
    assert choice.build == build
    assert choice.pip_args == (("--index-url", index) if index else ())


def test_setup_refuses_what_no_torch_build_runs_and_takes_an_override() -> None:
    with pytest.raises(SystemExit, match="update the driver"):
        choose(Machine("Linux", "x86_64", (11, 8)))
    with pytest.raises(SystemExit, match="Intel-Mac"):
        choose(Machine("Darwin", "x86_64", None))
    assert choose(Machine("Linux", "x86_64", (12, 8)), "cpu").build == "cpu"
    with pytest.raises(SystemExit, match="use cpu, pypi"):
        choose(Machine("Linux", "x86_64", None), "cu999")


def test_the_chooser_runs_alone_as_make_setup_calls_it() -> None:
    """Before moetune is installed: the file alone, standard library only."""
    path = Path(__file__).parents[1] / "src/moetune/lint/torch_index.py"
    got = subprocess.run(
        [sys.executable, "-I", str(path)], capture_output=True, text=True, check=True,
        env={"MOETUNE_TORCH": "cu128", "PATH": ""},
    )  # fmt: skip
    assert got.stdout.strip() == f"--index-url {INDEX}/cu128"
    assert "torch build: cu128" in got.stderr


def _cuda(monkeypatch: pytest.MonkeyPatch, built: str | None, available: bool) -> None:
    """This host as torch sees it: the CUDA it was built for, and a device or none."""
    monkeypatch.setattr(torch.version, "cuda", built)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


def _ctx(**raw: object) -> LintContext:
    cfg = RunConfig.model_validate({"model": {"id": "x/y"}, **raw})
    return LintContext(config=cfg, site=Site(remote=cfg.lane.provider not in ("local",)))


def test_a_cuda_card_on_a_cpu_only_torch_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, None, False)
    hit = RULES.get("CARD-NOT-HERE").check(_ctx(hardware={"card": "RTX-4090"}))
    assert hit is not None and hit.severity == "error"
    assert "RTX-4090 is a CUDA card" in hit.message and "CPU-only build" in hit.message
    assert "train.device: cpu" in hit.fix and "docs/install.md" in hit.fix


def test_a_cuda_torch_without_a_device_is_refused_too(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, "12.8", False)
    hit = RULES.get("CARD-NOT-HERE").check(_ctx(hardware={"card": "DGX-Spark"}))
    assert hit is not None and "sees no CUDA device" in hit.message


@pytest.mark.parametrize(
    "raw",
    [
        {"hardware": {"card": "RTX-4090"}, "train": {"device": "cpu"}},  # on purpose
        {"hardware": {"card": "H200"}, "lane": {"provider": "runpod"}},  # the pod's card
        {"hardware": {"card": "24GB"}, "train": {"device": "cpu"}},
        {"hardware": {"card": "cpu"}},
        {},
    ],
)
def test_no_refusal_where_the_card_is_not_this_hosts_cuda(
    monkeypatch: pytest.MonkeyPatch, raw: dict[str, object]
) -> None:
    _cuda(monkeypatch, None, False)
    assert RULES.get("CARD-NOT-HERE").check(_ctx(**raw)) is None


def test_an_apple_card_without_mps_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    mps = SimpleNamespace(is_available=lambda: False)
    monkeypatch.setattr(torch.backends, "mps", mps)
    hit = RULES.get("CARD-NOT-HERE").check(_ctx(hardware={"card": "M4-Max-64GB"}))
    assert hit is not None and "M4-Max-64GB is an Apple GPU" in hit.message
    assert "has no MPS device" in hit.message
    monkeypatch.setattr(mps, "is_available", lambda: True)
    assert RULES.get("CARD-NOT-HERE").check(_ctx(hardware={"card": "M4-Max-64GB"})) is None


def test_a_cuda_host_runs_its_card(monkeypatch: pytest.MonkeyPatch) -> None:
    _cuda(monkeypatch, "12.8", True)
    assert RULES.get("CARD-NOT-HERE").check(_ctx(hardware={"card": "T4"})) is None


@pytest.fixture
def tiny_model(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS["qwen3_moe-dense0"]))
    return tmp_path


def test_train_preflight_refuses_the_card_in_one_line(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path
) -> None:
    _cuda(monkeypatch, None, False)
    cfg = RunConfig.model_validate(
        {"model": {"id": str(tiny_model)}, "hardware": {"card": "L4"}, "train": {"seq_len": 64}}
    )
    with pytest.raises(TrainError) as exc:
        preflight(cfg, allow_errors=False)
    assert exc.value.cause.startswith("[CARD-NOT-HERE] hardware.card L4 is a CUDA card")
    cpu = cfg.model_copy(update={"train": cfg.train.model_copy(update={"device": "cpu"})})
    findings, _, errors = preflight(cpu, allow_errors=False)  # train.device cpu: on purpose
    assert errors == [] and "CARD-NOT-HERE" not in [f.rule_id for f in findings]


def test_doctor_reports_torch_the_devices_and_the_configs_card(
    monkeypatch: pytest.MonkeyPatch, tiny_model: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run.yaml"
    run.write_text(f"model:\n  id: {tiny_model}\nhardware:\n  card: RTX-4090\n")
    _cuda(monkeypatch, None, False)
    got = runner.invoke(app, ["doctor", str(run), "--json"])
    assert got.exit_code == 0, got.output
    report = json.loads(got.stdout)
    assert report["torch"]["label"] == "CPU-only" and report["torch"]["cuda"] is None
    assert report["card"]["card"] == "RTX-4090"
    assert report["card"]["verdict"].startswith("not here: the installed torch")
    _cuda(monkeypatch, "12.8", True)
    device = SimpleNamespace(name="NVIDIA GeForce RTX 4090", total_memory=int(23.65 * GiB))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: device)
    text = runner.invoke(app, ["doctor", str(run)]).stdout
    assert "torch " in text and "CUDA 12.8 build" in text
    assert "NVIDIA GeForce RTX 4090 (RTX-4090, 23.6 GiB)" in text
    assert "hardware.card: RTX-4090 (bf16) – here" in text


def test_auto_precision_is_fp16_on_a_card_without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert auto_precision("cuda") == "fp16" and auto_precision("cpu") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert auto_precision("cuda") == "bf16"
    # a bfloat16 base loads in float16 where the card computes fp16
    assert Placement("cuda", "fp16").load_dtype("bfloat16") == "float16"
    assert Placement("cuda", "bf16").load_dtype("bfloat16") == "bfloat16"


def test_the_install_pages_card_table_is_the_catalog() -> None:
    """Every catalog card is on the Install page with its memory, compute dtype and TFLOPS."""
    from moetune.plan.hardware import all_cards

    page = (Path(__file__).parents[1] / "docs/install.md").read_text()
    rows = {r.split("|")[1].strip(): r.split("|")[2:-1] for r in page.splitlines() if "|" in r}
    for card in all_cards():
        memory, usable, _, dtype, tflops = (cell.strip() for cell in rows[card.id])
        assert float(memory) * GiB == card.memory_bytes, card.id
        assert float(usable) == pytest.approx(card.usable_bytes / GiB, abs=0.005), card.id
        assert (dtype, float(tflops)) == (card.compute_dtype, card.tensor_tflops), card.id
