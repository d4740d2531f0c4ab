"""Any card: the cards people rent or own, fp16 where a card has no bf16, a card given by
its memory, near matches for a mistyped id, this machine's GPU, and `plan run.yaml` on the
configured card with one line of what it assumed."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import load_config
from moetune.errors import ConfigError, UnknownCardError
from moetune.model.tiny import TINY_CONFIGS
from moetune.plan.fit import card_fit
from moetune.plan.hardware import GiB, get_card, local_card_ids

runner = CliRunner()

# (id, memory GiB, bandwidth GB/s, bf16) as the vendor's datasheet / whitepaper gives them
PEOPLE_HAVE = [
    ("RTX-3090", 24, 936, True), ("RTX-4080", 16, 716.8, True), ("RTX-4070-Ti", 12, 504, True),
    ("RTX-A6000", 48, 768, True), ("RTX-6000-Ada", 48, 960, True), ("L4", 24, 300, True),
    ("L40S", 48, 864, True), ("A10G", 24, 600, True), ("T4", 16, 320, False),
    ("V100-16GB", 16, 900, False), ("V100-32GB", 32, 900, False), ("A100-40GB", 40, 1555, True),
    ("RTX-5090", 32, 1792, True), ("H200", 141, 4800, True), ("B200", 180, 8000, True),
]  # fmt: skip


@pytest.mark.parametrize(("card_id", "gib", "gb_per_s", "bf16"), PEOPLE_HAVE)
def test_the_cards_people_have_are_in_the_catalog(
    card_id: str, gib: int, gb_per_s: float, bf16: bool
) -> None:
    card = get_card(card_id)
    assert card.memory_bytes == gib * GiB and card.mem_gb_per_s == gb_per_s
    assert card.bf16 is bf16 and card.compute_dtype == ("bf16" if bf16 else "fp16")
    assert card.tensor_tflops > 0 and card.usable_bytes < card.memory_bytes


def test_a_card_given_by_its_memory_fits_like_a_catalog_card_of_that_memory() -> None:
    by_memory, rtx = get_card("24GB"), get_card("RTX-4090")
    assert get_card("24 GiB").id == "24GB" and by_memory.memory_bytes == 24 * GiB
    assert by_memory.usable_bytes == pytest.approx(rtx.usable_bytes, abs=1)
    for peak in (20 * GiB, 22 * GiB):  # one fits, one does not, on both alike
        assert card_fit(by_memory, peak).fits == card_fit(rtx, peak).fits
        assert card_fit(by_memory, peak).headroom_bytes == pytest.approx(
            card_fit(rtx, peak).headroom_bytes, abs=1
        )
    assert by_memory.tensor_tflops == 0 and "no TFLOPS" in str(by_memory.assumed)


def test_hardware_card_memory_gb_names_the_card_and_a_second_name_is_refused(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  id: my/model\nhardware:\n  card_memory_gb: 24\n")
    assert load_config(path).hardware.card == "24GB"
    path.write_text("model:\n  id: my/model\nhardware:\n  card: T4\n  card_memory_gb: 24\n")
    with pytest.raises(ConfigError, match="both name the card"):
        load_config(path)


def test_an_unknown_card_names_the_near_ones_and_spaces_are_forgiven() -> None:
    with pytest.raises(UnknownCardError) as exc:
        get_card("RTX-3080")
    assert "did you mean" in exc.value.cause and "RTX-3090" in exc.value.cause
    assert "--card 24GB" in exc.value.fix
    assert get_card("rtx 3090").id == "RTX-3090"


def test_this_machines_gpus_are_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    devices = [
        SimpleNamespace(name="NVIDIA GeForce RTX 3090", total_memory=int(23.69 * GiB)),
        SimpleNamespace(name="Tesla T4", total_memory=int(14.75 * GiB)),
        SimpleNamespace(name="NVIDIA RTX A4000", total_memory=int(15.7 * GiB)),  # unlisted
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(devices))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: devices[i])
    assert local_card_ids() == ["RTX-3090", "T4", "16GB"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert local_card_ids() == []


def _run_yaml(tmp_path: Path, hardware: str) -> str:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIGS["qwen3_moe-dense0"]))
    run = tmp_path / "run.yaml"
    run.write_text(
        f"model:\n  id: {model}\nlora:\n  rank: 4\ntrain:\n  seq_len: 128\n  batch_size: 2\n"
        f"hardware:\n{hardware}"
    )
    return str(run)


def test_plan_of_a_run_yaml_plans_its_card_first_and_says_what_it_assumed(
    tmp_path: Path,
) -> None:
    run = _run_yaml(tmp_path, "  card: t4\n")
    got = runner.invoke(app, ["plan", run, "--json"])
    assert got.exit_code == 0, got.stderr
    plan = json.loads(got.stdout)
    assert plan["card"] == "T4" and next(iter(plan["cards"])) == "T4"
    assert plan["cards"]["T4"]["compute_dtype"] == "fp16"
    assert plan["cards"]["H200"]["compute_dtype"] == "bf16"
    assert any(n.startswith("T4, V100") and "fp16" in n for n in plan["notes"])
    assumed = plan["assumed"]
    assert assumed.startswith("rank 4 · seq 128 · batch 2 · gradient checkpointing on · targets")
    text = runner.invoke(app, ["plan", run]).stdout.splitlines()
    assert text[0].startswith("card: T4 (hardware.card") and text[1] == f"assumed: {assumed}"


def test_plan_of_a_card_given_by_memory_states_its_assumptions(tmp_path: Path) -> None:
    run = _run_yaml(tmp_path, "  card_memory_gb: 24\n")
    got = runner.invoke(app, ["plan", run, "--card", "24GB", "--card", "RTX-4090", "--json"])
    assert got.exit_code == 0, got.stderr
    cards = json.loads(got.stdout)["cards"]
    assert cards["24GB"]["fits"] == cards["RTX-4090"]["fits"]
    assert cards["24GB"]["headroom_bytes"] == pytest.approx(
        cards["RTX-4090"]["headroom_bytes"], abs=1
    )
    assert any("no TFLOPS or bandwidth" in n for n in json.loads(got.stdout)["notes"])


def test_time_is_estimated_at_the_cards_own_dtype_and_never_for_a_card_by_memory() -> None:
    from moetune.config import parse_config
    from moetune.model import load_spec
    from moetune.plan.cost.estimate import estimate

    spec = load_spec("Qwen/Qwen3-30B-A3B")
    cfg = parse_config({"model": {"id": "Qwen/Qwen3-30B-A3B"}, "train": {"max_steps": 10}})
    t4, v100 = estimate(spec, cfg, get_card("T4")), estimate(spec, cfg, get_card("V100-16GB"))
    assert "T4 fp16 peak" in t4.rate_basis
    assert t4.estimated_train_s is not None and v100.estimated_train_s is not None
    assert t4.estimated_train_s / v100.estimated_train_s == pytest.approx(125 / 65)
    by_memory = estimate(spec, cfg, get_card("24GB"))
    assert by_memory.estimated_train_s is None and "no known TFLOPS" in by_memory.rate_basis


def test_every_skypilot_accelerator_is_a_catalog_card() -> None:
    """A key that is no card id would never be looked up: its card could not launch."""
    from moetune.lane.providers.skypilot import ACCELERATORS
    from moetune.plan.hardware import card_ids

    assert set(ACCELERATORS) <= set(card_ids())
    assert {ACCELERATORS[c] for c in ("T4", "A10G", "L4", "V100-32GB")} == {
        "T4", "A10G", "L4", "V100-32GB"
    }  # fmt: skip
