"""`moetune quickstart --method dpo|grpo`: the demo's rows per method, and (slow) the whole
pipeline – what each method really reaches on the tiny base is in
benchmarks/results/grpo-and-methods.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import load_config
from moetune.demo.quickstart import DEMOS, demo_args, training_rows, wrong_answer
from moetune.demo.skills import SKILLS, make_items
from moetune.errors import ConfigError


def test_every_skill_gets_a_plausible_wrong_answer_that_differs():
    for name in SKILLS:
        for item in make_items([name], 50, 0, "train"):
            assert wrong_answer(item) != item.answer, item
    dup = make_items(["dup"], 1, 0, "train")[0]
    assert wrong_answer(dup) == dup.prompt.removeprefix("dup:").rstrip(">")  # the copy


def test_demo_rows_per_method():
    dpo = training_rows(demo_args("dpo", rows=20))
    assert set(dpo[0]) == {"prompt", "chosen", "rejected"}
    assert all(r["chosen"].endswith("<eos>") and r["chosen"] != r["rejected"] for r in dpo)
    grpo = demo_args("grpo", rows=20)
    rows = training_rows(grpo)
    assert set(rows[0]) == {"prompt", "answer", "completion"} and len(rows) == 20
    new = [r for r in rows if r["prompt"].startswith(f"{grpo.new_skill}:")]
    assert len(new) == 10 and all(r["completion"] == "" for r in new)  # half new, RL only
    old = [r for r in rows if r not in new]  # replayed: the answer to imitate (sft_weight)
    assert all(r["completion"] == r["answer"] + "<eos>" for r in old)
    assert list(DEMOS) == ["sft", "dpo", "grpo"]


def test_replay_draws_only_the_listed_base_skills():
    rows = training_rows(demo_args("grpo", rows=40, replay=("sum", "sum", "kv")))
    old = [r["prompt"].split(":", 1)[0] for r in rows if not r["prompt"].startswith("last:")]
    assert len(old) == 20 and set(old) == {"sum", "kv"} and old.count("sum") > old.count("kv")


def test_unknown_method_is_one_line():
    with pytest.raises(ConfigError, match="unknown method 'ppo'"):
        demo_args("ppo")
    result = CliRunner().invoke(app, ["quickstart", "--method", "ppo", "--json"])
    assert result.exit_code == 2 and "Traceback" not in result.output


def test_an_out_that_is_a_file_or_under_a_device_is_one_line_before_training(tmp_path):
    """--out a file (or /dev/full/x) was exit 3 (NotADirectoryError) once data was written."""
    mine = tmp_path / "notes.txt"
    mine.write_text("mine")
    for out, why in ((mine, "is a file, not a folder"), (Path("/dev/full/qs"), "cannot be")):
        result = CliRunner().invoke(app, ["quickstart", "--out", str(out), "--json"])
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        assert why in result.output and "pass --out a folder" in result.output
    assert mine.read_text() == "mine" and sorted(tmp_path.iterdir()) == [mine]


def _run(tmp_path: Path, method: str, seed: int = 0) -> dict:
    out = tmp_path / f"{method}-{seed}"
    args = ["quickstart", "--method", method, "--seed", str(seed), "--out", str(out), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["method"] == method and summary["verdict"] in ("GO", "NO-GO", "INCONCLUSIVE")
    assert summary["coverage"] == 1.0 and summary["router_changed"] is False
    target = summary["target"]
    assert target["name"] == summary["new_skill"]
    assert target == {"name": target["name"], **summary["scores"][target["name"]]}
    return summary


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_quickstart_learns_the_new_skill_from_an_exact_match_reward(tmp_path, seed):
    """GO at seeds 0, 1 and 2 (benchmarks/results/grpo-and-methods.md, GRPO with
    edit_similarity)."""
    summary = _run(tmp_path, "grpo", seed)
    target = summary["target"]
    assert target["base"] < 0.2 and target["candidate"] > 0.8  # measured: 0.08 -> 1.00
    shift = summary["mean_routing_shift"]
    assert shift is not None and 0.0 <= shift < 0.05  # fp32 CPU: rollout and update agree
    # the sft term on the replayed rows keeps the base skills (measured: sum −0.04 … +0.10)
    assert summary["verdict"] == "GO" and summary["promoted"] is not None
    for name in ("copy", "rev", "first", "sum"):
        assert summary["scores"][name]["candidate"] >= summary["scores"][name]["base"] - 0.1


@pytest.mark.slow
def test_dpo_quickstart_learns_dup_and_passes_the_gate(tmp_path):
    summary = _run(tmp_path, "dpo")
    target = summary["target"]
    assert target["base"] < 0.2 and target["candidate"] > 0.8  # measured: 0.00 -> 0.97
    assert summary["mean_routing_shift"] is None  # no rollout in DPO
    assert summary["verdict"] == "GO" and summary["promoted"] is not None
    for name in ("copy", "rev", "first"):
        assert summary["scores"][name]["candidate"] >= summary["scores"][name]["base"] - 0.1


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sft_quickstart_says_go_at_every_seed(tmp_path, seed):
    """Robust, not lucky: other train rows, eval items and LoRA init, the same verdicts
    (measured in benchmarks/results/grpo-and-methods.md: GO at seeds 0, 1, 2; the over-trained
    pack NO-GO)."""
    summary = _run(tmp_path, "sft", seed)
    cfg = load_config(Path(summary["adapter_dir"]).parent / "config.yaml")
    assert cfg.train.seed == seed  # --seed reached the run
    target = summary["target"]
    assert target["base"] < 0.2 and target["candidate"] > 0.8
    assert summary["verdict"] == "GO" and summary["promoted"] is not None
    assert summary["overfit"]["verdict"] == "NO-GO"
