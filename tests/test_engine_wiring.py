"""lora.engine: moetune end to end – training uses the split-LoRA experts (dropout allowed,
coverage audited, router frozen, adapter loads with plain peft), the planner traces the
engine's real step, and the dropout lint rule knows the engine lifts peft's limit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import parse_config
from moetune.lint.registry import lint
from moetune.train import train
from test_train_helpers import (
    one_thread,
    reverse_rows,
    run_config,
    save_tiny_model,
    write_jsonl,
    write_small_moe_config,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("engine")
    return save_tiny_model(root / "model"), write_jsonl(root / "d.jsonl", reverse_rows(16))


def test_train_with_split_lora_and_expert_dropout(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, data = tiny
    cfg = run_config(model_dir, data, tmp_path / "run", lora__engine="moetune",
                     lora__dropout=0.1, lora__targets=["attention", "experts"])  # fmt: skip
    with one_thread():
        result = train(cfg, progress=False)
    assert result.coverage == 1.0 and not result.router_changed and result.steps == 6
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, result.adapter_dir)  # a stock peft stack
    experts_b = [p for n, p in loaded.named_parameters() if "experts" in n and "lora_B" in n]
    assert experts_b and all(p.abs().sum() > 0 for p in experts_b)  # the experts trained
    saved = json.loads(Path(result.adapter_dir, "adapter_config.json").read_text())
    assert saved["lora_dropout"] == 0.0 and saved["target_parameters"]  # standard peft config


def test_dropout_rule_and_recipe_know_the_engine() -> None:
    from moetune.lint.preflight import lint_context
    from moetune.model import load_spec

    spec = load_spec("Qwen/Qwen3-30B-A3B")
    for engine, fires in (("peft", True), ("moetune", False)):
        cfg = parse_config({"lora": {"dropout": 0.1, "engine": engine}})
        ids = {f.rule_id for f in lint(lint_context(cfg, spec))}
        assert ("MOE-LORA-DROPOUT" in ids) is fires


def test_plan_traces_the_engine_and_it_holds_less(tmp_path: Path) -> None:
    write_small_moe_config(tmp_path / "m")
    peaks = {}
    for engine in ("peft", "moetune"):
        for estimator in ("trace", "analytic"):
            out = CliRunner().invoke(app, [
                "plan", str(tmp_path / "m"), "--engine", engine, "--estimator", estimator,
                "--no-gc", "--seq", "64", "--targets", "attention,experts", "--card",
                "H100-80GB", "--json",
            ])  # fmt: skip
            assert out.exit_code == 0, out.output
            doc = json.loads(out.stdout)
            assert doc["estimator"] == estimator
            peaks[engine, estimator] = doc["peak_bytes"]
    assert peaks["moetune", "trace"] < peaks["peft", "trace"]
    assert peaks["moetune", "analytic"] < peaks["peft", "analytic"]  # the analytic knows the engine
    assert abs(peaks["moetune", "analytic"] / peaks["moetune", "trace"] - 1) < 0.1


@pytest.mark.parametrize(("dtype", "ratio"), [("int8", (0.45, 0.6)), ("nf4", (0.25, 0.32))])
def test_analytic_frozen_bytes_of_quantised_experts_match_the_trace(
    dtype: str, ratio: tuple[float, float]
) -> None:
    from moetune.model import load_spec
    from moetune.plan.analytic import estimate
    from moetune.plan.trace.cache import run_trace

    spec = load_spec("allenai/OLMoE-1B-7B-0924")
    cfg = parse_config({
        "model": {"experts_dtype": dtype}, "lora": {"engine": "moetune", "rank": 8},
        "train": {"seq_len": 64},
    })  # fmt: skip
    bf16 = estimate(spec, parse_config({"lora": {"engine": "moetune", "rank": 8}}))
    analytic = estimate(spec, cfg).components["frozen_weights"]
    traced = run_trace(spec, cfg).at_peak["frozen_weights"]
    assert abs(analytic / traced - 1) < 0.02
    routed = spec.components.routed_experts * 2
    shrink = (bf16.components["frozen_weights"] - analytic) / routed
    assert ratio[0] < 1 - shrink < ratio[1]  # expert bytes vs bf16
