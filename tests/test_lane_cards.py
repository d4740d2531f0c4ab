"""The card a launch rents keeps 8 % of its usable memory free until a run measured the step
on it; `--accept-thin-margin` takes the thin one anyway and every ledger row of that launch
says so. The dry run shows the card with and without the margin."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import load_config
from moetune.lane.cards import MIN_HEADROOM, choose_card
from moetune.lane.providers.base import LaneError
from moetune.ledger import Ledger
from moetune.plan.fit import CardFit
from moetune.plan.hardware import get_card

GiB = 1024**3
CONFIG = Path("configs/qwen3-30b-a3b/lora_h200.yaml").resolve()


@dataclass
class Plan:
    """The part of a MemoryPlan the choice reads: a fit per card."""

    fits: dict[str, CardFit] = field(default_factory=dict)
    trainable_params: int | None = None


def fit(card: str, headroom_gib: float) -> CardFit:
    usable = get_card(card).usable_bytes
    headroom = int(headroom_gib * GiB)
    return CardFit(card, headroom >= 0, usable, headroom, usable - headroom, 0)


THIN = Plan({"A100-80GB": fit("A100-80GB", 1.1), "H100-80GB": fit("H100-80GB", 1.1),
             "H100-NVL": fit("H100-NVL", 14.0), "H200": fit("H200", 60.0),
             "L40S": fit("L40S", -30.0)})  # fmt: skip


def cfg(*overrides: str) -> Any:
    return load_config(CONFIG, ["lane.provider=runpod", "hardware.card=null", *overrides])


def test_a_thin_fit_is_passed_over_for_the_cheapest_card_with_the_margin() -> None:
    choice = choose_card(cfg(), THIN, measured=set())
    assert (choice.card.id, choice.with_margin, choice.without_margin) == (
        "H100-NVL", "H100-NVL", "A100-80GB",
    )  # fmt: skip
    assert 1.1 * GiB < MIN_HEADROOM * get_card("A100-80GB").usable_bytes  # 1.1 GiB is thin
    accepted = choose_card(cfg(), THIN, measured=set(), accept_thin_margin=True)
    assert accepted.card.id == "A100-80GB" and accepted.accept_thin_margin
    measured = choose_card(cfg(), THIN, measured={"A100-80GB"})  # a real run backs it
    assert measured.card.id == "A100-80GB" and not measured.accept_thin_margin


def test_only_thin_fits_refuses_the_launch_unless_accepted() -> None:
    only_thin = Plan({"A100-80GB": fit("A100-80GB", 1.1), "H100-80GB": fit("H100-80GB", 2.0)})
    choice = choose_card(cfg(), only_thin, measured=set())
    assert choice.card is None and choice.without_margin == "A100-80GB"
    with pytest.raises(LaneError, match="--accept-thin-margin"):
        choice.require()
    choose_card(cfg(), only_thin, set(), accept_thin_margin=True).require()  # accepted: no error


def test_dry_run_shows_the_card_with_and_without_the_margin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moetune.plan

    monkeypatch.setattr(moetune.plan, "make_plan", lambda spec, cfg: THIN)
    base = ["launch", str(CONFIG), "--provider", "runpod", "--dry-run", "--set",
            "hardware.card=null", "--set", f"output.ledger={tmp_path}/l.jsonl"]  # fmt: skip
    plain = json.loads(CliRunner().invoke(app, [*base, "--json"]).stdout)
    assert plain["card"] == "H100-NVL" and plain["pod"]["gpu_type_id"] == "NVIDIA H100 NVL"
    choice = plain["card_choice"]
    assert (choice["with_margin"], choice["without_margin"]) == ("H100-NVL", "A100-80GB")
    assert choice["min_headroom_fraction"] == 0.08 and not choice["accept_thin_margin"]
    thin = json.loads(CliRunner().invoke(app, [*base, "--json", "--accept-thin-margin"]).stdout)
    assert thin["card"] == "A100-80GB" and thin["card_choice"]["accept_thin_margin"]
    table = CliRunner().invoke(app, base)
    assert table.exit_code == 0, table.output
    text = " ".join(table.output.split())
    assert "with the 8% margin: H100-NVL · without it: A100-80GB" in text


def test_a_refused_launch_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import moetune.plan

    only_thin = Plan({"A100-80GB": fit("A100-80GB", 1.1)})
    monkeypatch.setattr(moetune.plan, "make_plan", lambda spec, cfg: only_thin)
    monkeypatch.chdir(tmp_path)
    out = CliRunner().invoke(app, ["launch", str(CONFIG), "--provider", "runpod", "--set",
                                   "hardware.card=null", "--set", "output.dir=run"])  # fmt: skip
    assert out.exit_code == 2 and "--accept-thin-margin" in out.output
    assert len(out.output.strip().splitlines()) <= 2 and "Traceback" not in out.output
    assert list(tmp_path.iterdir()) == []  # no state, no ledger, no pod


def test_accept_thin_margin_is_recorded_in_every_row_of_the_launch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local launch that fails at setup: its provision, launch and teardown rows all carry
    the override."""
    from moetune.demo.base import SHIPPED_DIR

    monkeypatch.chdir(tmp_path)
    doc = {"model": {"id": str(SHIPPED_DIR)}, "data": {"train_file": "none.jsonl"},
           "output": {"dir": "run", "ledger": ".moetune/ledger.jsonl"},
           "lane": {"provider": "local", "setup": ["exit 3"]}}  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "none.jsonl").write_text('{"prompt": "a", "completion": "b"}\n')
    out = CliRunner().invoke(app, ["launch", "run.yaml", "--accept-thin-margin"])
    assert out.exit_code == 2, out.output
    rows = Ledger(tmp_path / ".moetune" / "ledger.jsonl").read().rows
    assert [r.kind for r in rows] == ["provision", "launch", "teardown"]
    assert all(r.metrics["accept_thin_margin"] is True for r in rows)
    (state,) = (tmp_path / ".moetune" / "lane").glob("*/state.json")
    assert json.loads(state.read_text())["accept_thin_margin"] is True  # kept for --resume
