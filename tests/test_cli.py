"""The CLI end to end: JSON shapes users script against, and bad input as one line + exit != 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.model.tiny import TINY_CONFIGS

runner = CliRunner()


def _run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def _model_dir(tmp_path: Path, variant: str) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIGS[variant]))
    return str(tmp_path)


def test_inspect_json_has_the_documented_keys() -> None:
    code, out, _ = _run("inspect", "Qwen/Qwen3-30B-A3B", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["total_params"] == 30_532_122_624
    assert data["active_params"] == 3_353_032_704
    assert data["num_experts"] == 128 and data["top_k"] == 8 and data["num_layers"] == 48
    assert data["moe_layers"] == list(range(48))
    assert sum(data["components"].values()) == data["total_params"]


def test_inspect_dense_model_says_not_moe(tmp_path: Path) -> None:
    code, out, _ = _run("inspect", _model_dir(tmp_path, "qwen2"))
    assert code == 0 and "not an MoE" in out


def _assert_one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) <= 2, err  # one message (rich may wrap a long line once)
    assert "Traceback" not in err
    text = " ".join(lines)
    for needle in needles:
        assert needle in text, text


def test_missing_config_json(tmp_path: Path) -> None:
    code, _, err = _run("inspect", str(tmp_path))
    _assert_one_line_error(code, err, "config.json")


def test_invalid_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    code, _, err = _run("inspect", str(tmp_path))
    _assert_one_line_error(code, err, "config.json")


def test_unknown_family(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "frobnicator"}))
    code, _, err = _run("inspect", str(tmp_path))
    _assert_one_line_error(code, err, "frobnicator", "upgrade transformers")


def test_hub_id_while_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = _run("inspect", "some-org/not-in-the-catalog-MoE")
    _assert_one_line_error(code, err, "some-org/not-in-the-catalog-MoE")


def test_dense_model_with_expert_targets(tmp_path: Path) -> None:
    code, _, err = _run("recipe", _model_dir(tmp_path, "qwen2"), "--targets", "attention,experts")
    _assert_one_line_error(code, err, "experts")


@pytest.mark.parametrize("flag", [["--rank", "0"], ["--rank", "-8"], ["--seq", "0"]])
def test_non_positive_rank_or_seq(flag: list[str]) -> None:
    code, _, err = _run("plan", "Qwen/Qwen3-30B-A3B", *flag)
    _assert_one_line_error(code, err, "positive")


def test_unknown_key_in_run_yaml(tmp_path: Path) -> None:
    run = tmp_path / "run.yaml"
    run.write_text("model:\n  id: Qwen/Qwen3-30B-A3B\ntrain:\n  seqlen: 4096\n")
    code, _, err = _run("lint", str(run))
    _assert_one_line_error(code, err, "train.seqlen")


def test_unknown_card_id_lists_the_known_ones() -> None:
    code, _, err = _run("plan", "Qwen/Qwen3-30B-A3B", "--card", "TPU-v9")
    _assert_one_line_error(code, err, "TPU-v9", "H100-80GB")


def test_plan_json_acceptance_case() -> None:
    code, out, _ = _run(
        "plan", "Qwen/Qwen3-30B-A3B", "--mapping", "automap", "--targets", "attention,experts",
        "--engine", "peft", "--seq", "2048", "--batch", "1", "--card", "H100-80GB",
        "--card", "H200", "--card", "H100-NVL", "--json",
    )  # fmt: skip
    assert code == 0
    plan = json.loads(out)
    assert plan["fits"] == {"H100-80GB": False, "H200": True, "H100-NVL": True}
    assert plan["trainable_params"] == 994_836_480
    assert plan["estimator"] == "analytic" and plan["overhead_bytes"] > 0
    assert sum(plan["components"].values()) == plan["peak_bytes"]
    assert any(r["card"] == "H100-80GB" for r in plan["recommendations"])


def test_plan_json_best_per_card_reproduces_its_peak(tmp_path: Path) -> None:
    from moetune.config import load_config
    from moetune.model import load_spec
    from moetune.plan import card_ids
    from moetune.plan.fit import analytic

    run = tmp_path / "run.yaml"
    run.write_text(
        "model:\n  id: Qwen/Qwen3-30B-A3B\nlora:\n  rank: 16\n  targets: [attention, experts]\n"
        "  engine: peft\n  expert_mapping: automap\ntrain:\n  seq_len: 2048\n  batch_size: 1\n"
    )
    code, out, _ = _run("plan", str(run), "--json")
    assert code == 0
    best = json.loads(out)["best"]
    assert list(best) == card_ids()
    spec = load_spec("Qwen/Qwen3-30B-A3B")
    for card, rec in best.items():
        assert rec["card"] == card and rec["fits"], rec["text"]
        # the overrides, given to the same run.yaml as --set, give the predicted peak
        assert analytic(spec, load_config(run, rec["overrides"])).peak_bytes == rec["peak_bytes"]
        assert rec["headroom_bytes"] >= 0
    four = best["RTX-4090"]
    assert "model.experts_dtype=nf4" in four["overrides"] and four["peak_bytes"] <= 22 * 1024**3
    assert best["H100-80GB"]["overrides"] == ["lora.engine=moetune"]  # the switch alone fits
    assert best["H200"]["overrides"] == [] and best["H200"]["cost"] == 0.0


def test_plan_prints_the_best_config_per_card() -> None:
    code, out, _ = _run(
        "plan", "Qwen/Qwen3-30B-A3B", "--targets", "attention,experts", "--card", "RTX-4090",
        "--card", "H200",
    )  # fmt: skip
    assert code == 0
    assert "best config per card" in out
    assert "RTX-4090: --set lora.engine=moetune --set model.experts_dtype=nf4" in out


def test_plan_of_an_uncalibrated_mixer_kind_says_it_traced(tmp_path: Path) -> None:
    from moetune.model.census import shrunk_config

    (tmp_path / "config.json").write_text(json.dumps(shrunk_config("nemotron_h")))
    args = ("plan", str(tmp_path), "--seq", "64", "--card", "H200")
    code, out, _ = _run(*args)
    assert code == 0
    assert "peak memory by component (trace)" in out
    assert "note: analytic has no calibrated activation term for nemotron_h's mamba" in out
    code, out, _ = _run(*args, "--json")
    plan = json.loads(out)
    assert plan["estimator"] == "trace" and plan["estimator_requested"] == "analytic"
    assert "mamba" in plan["notes"][0]
