"""A launch sizes its training time from a rate the ledger measured on the same card for the
same step, else from FLOPs at an MFU calibrated from a published step rate – and says which
(`basis`); without a step count it counts tokens from the data's bytes, and with nothing to
count from the watchdog falls back to 6 h."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import RunConfig, load_config
from moetune.lane.phases import as_launched
from moetune.ledger import Ledger, LedgerRow
from moetune.model import load_spec
from moetune.plan.cost import walls as W
from moetune.plan.cost.estimate import BYTES_PER_TOKEN, MFU, REFERENCE, estimate, launch_signature
from moetune.plan.hardware import get_card

CONFIG = Path("configs/qwen3-30b-a3b/lora_h200.yaml").resolve()
RATE = 2500.0


@pytest.fixture(scope="module")
def run() -> tuple[RunConfig, Any]:
    cfg = load_config(CONFIG, ["lane.provider=runpod", "train.max_steps=500"])
    return cfg, load_spec(cfg.model.id)


def train_row(
    cfg: RunConfig, spec: Any, *, status: str = "ok", card: str = "H200", rate: float = RATE,
    at: float = 1000.0, **changed: Any,
) -> LedgerRow:  # fmt: skip
    """A train row as the trainer writes it; `changed` alters its step signature."""
    signature = {**launch_signature(spec, cfg), **changed}
    metrics = {"steps": 500, "tokens": 10**6, "tokens_per_s": rate, "device": "NVIDIA H200",
               "card": card, "signature": signature}  # fmt: skip
    return LedgerRow(kind="train", status=status, time=at, metrics=metrics)  # type: ignore[arg-type]


def ledger_with(path: Path, *rows: LedgerRow) -> Path:
    for row in rows:
        Ledger(path).append(row)
    return path


def dry_run(ledger: Path) -> dict[str, Any]:
    out = CliRunner().invoke(
        app, ["launch", str(CONFIG), "--provider", "runpod", "--dry-run", "--json",
              "--set", f"output.ledger={ledger}", "--set", "train.max_steps=500"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout)


def test_a_measured_rate_sizes_the_dry_run_and_the_watchdog_keeps_its_margin(
    run: tuple[RunConfig, Any], tmp_path: Path
) -> None:
    cfg, spec = run
    older = train_row(cfg, spec, rate=100.0, at=500.0)
    newer = train_row(cfg, spec)
    ledger = ledger_with(tmp_path / "l.jsonl", newer, older)  # newest by time, not file order
    plan = dry_run(ledger)
    est, walls = plan["estimate"], plan["walls"]
    tokens = 500 * 1 * 1 * 2048  # max_steps × batch_size × grad_accum × seq_len
    assert est["training_tokens"] == tokens
    assert est["estimated_train_s"] == pytest.approx(tokens / RATE)
    assert est["basis"] == (
        f"measured: ledger row {newer.id}, 2,500.0 tok/s on H200; tokens: 500 steps × 2048 tokens"
    )
    # the MFU the rate implies: 6 × active params per token (checkpointing) over the peak
    implied = RATE * 6 * spec.active_params / (get_card("H200").bf16_tflops * 1e12)
    assert est["mfu"] == pytest.approx(implied, abs=1e-4)
    total = est["setup_s"] + tokens / RATE + est["estimated_eval_s"]
    assert walls["watchdog_s"] == math.ceil(total * W.WATCHDOG_MARGIN)
    assert "measured: ledger row" in walls["why"]["watchdog_s"]
    assert plan["estimated_usd"] == pytest.approx(total / 3600 * est["usd_per_hour"], abs=0.01)


def test_without_a_ledger_row_the_basis_is_the_stated_mfu(tmp_path: Path) -> None:
    est = dry_run(tmp_path / "none.jsonl")["estimate"]
    assert est["basis"].startswith(f"MFU {MFU} of H200 bf16 peak (from {REFERENCE.what}")
    assert est["mfu"] == MFU
    assert not (tmp_path / "none.jsonl").exists()  # looking never creates a ledger


@pytest.mark.parametrize(
    "mismatch",
    [
        {"status": "failed"},
        {"card": "H100-80GB"},
        {"seq_len": 4096},
        {"engine": "peft"},
        {"devices": 2},
        {"gradient_checkpointing": False},
        {"rate": 0.0},
    ],
    ids=lambda m: next(iter(m)),
)
def test_a_row_for_another_step_card_or_outcome_is_ignored(
    run: tuple[RunConfig, Any], tmp_path: Path, mismatch: dict[str, Any]
) -> None:
    cfg, spec = run
    card = get_card("H200")
    ledger = ledger_with(tmp_path / "l.jsonl", train_row(cfg, spec, **mismatch))
    assert estimate(spec, cfg, card, ledger) == estimate(spec, cfg, card)
    assert estimate(spec, cfg, card, ledger).basis.startswith(f"MFU {MFU} ")


def test_the_pod_train_row_keeps_its_rate_under_the_launched_model_id(
    run: tuple[RunConfig, Any],
) -> None:
    cfg, spec = run
    staged = train_row(cfg, spec, model="model")  # a local base is "model" on the pod
    update = as_launched(staged, cfg, "lane-1")
    merged = staged.model_copy(update=update)
    assert merged.run_id == "lane-1" and merged.metrics["tokens_per_s"] == RATE
    assert merged.metrics["signature"] == launch_signature(spec, cfg)
    assert merged.metrics["card"] == "H200" and staged.metrics["signature"]["model"] == "model"
    eval_row = LedgerRow(kind="eval", status="ok", metrics={"model": "x"})
    assert as_launched(eval_row, cfg, "lane-1") == {"run_id": "lane-1"}


def test_lint_sizes_the_watchdog_rule_with_the_measured_rate(
    run: tuple[RunConfig, Any], tmp_path: Path
) -> None:
    from moetune.lint.preflight import lint_context

    cfg, spec = run
    ledger = ledger_with(tmp_path / "l.jsonl", train_row(cfg, spec))
    on_h200 = cfg.model_copy(
        update={
            "hardware": cfg.hardware.model_copy(update={"card": "H200"}),
            "output": cfg.output.model_copy(update={"ledger": str(ledger)}),
        }
    )
    measured = lint_context(on_h200, spec).estimated_train_s
    assert measured == pytest.approx(500 * 2048 / RATE)
    fresh = on_h200.model_copy(
        update={"output": cfg.output.model_copy(update={"ledger": str(tmp_path / "none")})}
    )
    assert lint_context(fresh, spec).estimated_train_s != pytest.approx(measured)
    assert not (tmp_path / "none").exists()  # reading a missing ledger creates nothing


def _cfg(*overrides: str) -> RunConfig:
    return load_config(CONFIG, ["lane.provider=runpod", *overrides])


def test_the_default_mfu_reproduces_the_published_rate_and_scales_with_each_peak(
    run: tuple[RunConfig, Any],
) -> None:
    """Without a ledger row: the vendor's Qwen3-30B-A3B step (745 ms at seq 2048 on one H100,
    ≈ 2.7k tok/s) comes back out of the estimate, and another card scales by its bf16 peak."""
    _, spec = run
    cfg = _cfg("train.max_steps=100", "train.gradient_checkpointing=false")
    rate = {c: 100 * 2048 / estimate(spec, cfg, get_card(c)).estimated_train_s
            for c in ("H100-80GB", "A100-80GB")}  # fmt: skip
    # the published rate, per active parameter (the catalog's count, not the model card's 3.3B)
    published = 2048 / 0.745 * REFERENCE.active_params / spec.active_params
    assert rate["H100-80GB"] == pytest.approx(published, rel=0.01)
    assert 2400 < rate["H100-80GB"] < 3000  # the ≈ 2.7k tok/s of the table, not MFU 0.02's 1.5k
    assert rate["A100-80GB"] / rate["H100-80GB"] == pytest.approx(312 / 989)
    checkpointed = estimate(spec, _cfg("train.max_steps=100"), get_card("H100-80GB"))
    assert checkpointed.estimated_train_s == pytest.approx(100 * 2048 / rate["H100-80GB"] * 1.5)


def test_without_steps_tokens_come_from_the_data_bytes(
    run: tuple[RunConfig, Any], tmp_path: Path
) -> None:
    _, spec = run
    data = tmp_path / "train.json"
    data.write_text(json.dumps([{"text": "hello moe " * 50}] * 200))
    cfg = _cfg(f"data.train_file={data}", "train.epochs=2")
    est = estimate(spec, cfg, get_card("H200"))
    size = data.stat().st_size
    assert est.training_tokens == math.ceil(size / BYTES_PER_TOKEN * 2)
    assert f"{size:,} bytes / 3.6 bytes per token (BPE; no tokenizer) × 2 epochs" in est.basis
    assert est.estimated_train_s is not None and est.estimated_train_s > 0


def test_with_nothing_to_count_the_watchdog_falls_back_to_six_hours(tmp_path: Path) -> None:
    out = CliRunner().invoke(
        app, ["launch", str(CONFIG), "--provider", "runpod", "--dry-run", "--json",
              "--set", f"output.ledger={tmp_path}/l.jsonl",
              "--set", f"data.train_file={tmp_path}/train.parquet"],
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    walls = json.loads(out.stdout)["walls"]
    assert walls["watchdog_s"] == W.DEFAULT_WATCHDOG_S == 21_600
    assert walls["estimated_train_s"] is None and "6 h floor" in walls["why"]["watchdog_s"]


def test_without_steps_rows_of_every_source_count_by_weight(
    run: tuple[RunConfig, Any], tmp_path: Path
) -> None:
    _, spec = run
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(40)))
    b.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(30)))
    sources = json.dumps([{"path": str(a), "weight": 2}, {"path": str(b), "max_rows": 10}])
    cfg = _cfg(f"data.sources={sources}", "data.eval_fraction=0.1")
    est = estimate(spec, cfg, get_card("H200"))
    rows = round((40 * 2 + 10) * 0.9)  # 81 rows the mix trains on
    t = cfg.train
    steps = math.ceil(rows / (t.batch_size * t.grad_accum)) * t.epochs
    assert f"{rows} rows → {steps} steps" in est.basis
    assert est.training_tokens == steps * t.batch_size * t.grad_accum * t.seq_len
