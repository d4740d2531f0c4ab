"""The served == trained check: a consumer that drops expert LoRA fails it (exit 1, a failed
ledger row, check.json says why) and the report shows each export's verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from export_fixtures import make_run
from moetune.cli import app
from moetune.export import merged

pytestmark = pytest.mark.filterwarnings("ignore")


def _export(run: Path, out: Path) -> tuple[int, str]:
    args = ["export", str(run), "--format", "merged", "--out", str(out), "--json"]
    got = CliRunner().invoke(app, args)
    return got.exit_code, got.output


def test_a_merge_that_drops_expert_lora_fails_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_run(tmp_path, "gpt_oss")
    real = merged.add_delta

    def attention_only(param, target, a, b, counts):  # type: ignore[no-untyped-def]
        if not target.is_experts:  # what a converter that skips the expert stacks serves
            real(param, target, a, b, counts)

    monkeypatch.setattr(merged, "add_delta", attention_only)
    code, output = _export(run, tmp_path / "merged")
    assert code == 1, output
    check = json.loads((tmp_path / "merged" / "check.json").read_text())
    assert not check["passed"] and "expert LoRA is not served" in check["reason"]
    assert check["effect_share"] > 0.25 and check["logits_rel_max"] >= check["logits_rel"]
    (row,) = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert (
        row["kind"] == "export"
        and row["status"] == "failed"
        and "served != trained" in row["reason"]
    )


def test_an_adapter_without_expert_effect_cannot_pass(tmp_path: Path) -> None:
    run = make_run(tmp_path, "olmoe", experts=["mlp.experts.down_proj"], scale=1e-7)
    assert _export(run, tmp_path / "merged")[0] == 1
    check = json.loads((tmp_path / "merged" / "check.json").read_text())
    assert "cannot be told apart" in check["reason"]


def test_report_shows_the_export_check(tmp_path: Path) -> None:
    from moetune.report import build_report

    run = make_run(tmp_path, "qwen3_moe-dense0")
    assert _export(run, tmp_path / "merged")[0] == 0
    html = build_report(run).read_text()
    assert "served == trained" in html and str(tmp_path / "merged") in html


def test_format_without_a_consumer_here_is_exported_and_marked_unchecked(tmp_path: Path) -> None:
    run = make_run(tmp_path, "olmoe")
    args = ["export", str(run), "--format", "vllm", "--out", str(tmp_path / "v"), "--json"]
    got = CliRunner().invoke(app, args)
    assert got.exit_code == 0, got.output
    assert "no consumer of vllm runs here" in json.loads(got.stdout)["check"]["skipped"]
    (row,) = [json.loads(x) for x in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert row["status"] == "ok" and "skipped" in row["metrics"]
    assert not (tmp_path / "v" / "check.json").exists()


@pytest.mark.parametrize("variant", ["qwen3_moe-dense0", "olmoe"])
def test_mlx_format_serves_what_was_trained_in_mlx_lm(tmp_path: Path, variant: str) -> None:
    """`--format mlx` through the registry: mlx-lm itself runs the export on the run's eval
    items and matches the peft adapter (float32 on the CPU backend)."""
    pytest.importorskip("mlx_lm")
    run = make_run(tmp_path, variant)
    out = tmp_path / "mlx"
    got = CliRunner().invoke(
        app, ["export", str(run), "--format", "mlx", "--out", str(out), "--json"]
    )
    assert got.exit_code == 0, got.output
    check = json.loads((out / "check.json").read_text())
    assert (check["consumer"], check["passed"]) == ("mlx-lm", True)
    assert check["logits_rel"] < 1e-4 < check["expert_effect"]
    assert (out / "adapters" / "adapters.safetensors").is_file()
    assert (out / "model" / "config.json").is_file()


def test_an_adapter_without_eval_items_is_refused_before_anything_is_written(
    tmp_path: Path,
) -> None:
    import shutil

    run = make_run(tmp_path, "olmoe")
    adapter = shutil.copytree(run / "adapter", tmp_path / "lone-adapter")  # no run around it
    args = ["export", str(adapter), "--base", str(tmp_path / "base-olmoe")]
    got = CliRunner().invoke(app, [*args, "--format", "merged", "--out", str(tmp_path / "m")])
    assert got.exit_code == 2 and "no eval items" in got.output and "--items" in got.output
    assert not (tmp_path / "m").exists()  # nothing half-written
