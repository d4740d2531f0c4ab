"""GM-1 bench: parameter matching, every arm learns, routing health, CI math, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from moetune.bench.arms import ARMS, MATCH_TOLERANCE, SIZES, size_arms
from moetune.bench.corpus import heldout_rows, token_rows
from moetune.bench.gm1 import BenchConfig, run_bench
from moetune.bench.stats import gap_pct, routing_health, t975, t_interval
from moetune.cli import app
from moetune.model import build_model

runner = CliRunner()


@pytest.mark.parametrize("size", ["tiny", "small", "medium"])
def test_arms_match_the_dense_models_active_or_total_count(size: str) -> None:
    built = size_arms(SIZES[size], list(ARMS.values()))
    dense = built["dense"].spec
    assert dense.active_params == dense.total_params  # nothing idle in a dense model
    for name in ("moe-top1", "moe-top2", "moe-top1-aux"):
        active = built[name].spec.active_params
        assert abs(active - dense.active_params) <= MATCH_TOLERANCE * dense.active_params, name
    matched_total = built["moe-matched-total"].spec
    assert abs(matched_total.total_params - dense.total_params) <= 0.02 * dense.total_params
    assert matched_total.active_params < 0.75 * dense.active_params  # top-1 of 8 (or 4)
    assert built["moe-top2"].width * 2 == pytest.approx(built["moe-top1"].width, abs=2)


def test_default_size_is_about_six_million_parameters_in_the_top1_moe() -> None:
    built = size_arms(SIZES["small"], [ARMS["moe-top1"]])
    assert 5_000_000 < built["moe-top1"].spec.total_params < 7_000_000


def test_spec_counts_equal_the_built_models_parameters() -> None:
    size = SIZES["tiny"]
    built = size_arms(size, [ARMS["moe-top1"], ARMS["moe-top2"]])
    for b in built.values():
        model = build_model(b.spec, device="cpu", dtype=torch.float32)
        assert sum(p.numel() for p in model.parameters()) == b.spec.total_params
    moe = build_model(built["moe-top2"].spec, device="cpu", dtype=torch.float32)
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    idle = experts * (size.experts - 2) // size.experts  # top-2 of 4: half the experts idle
    assert built["moe-top2"].spec.active_params == built["moe-top2"].spec.total_params - idle


def test_corpus_is_deterministic_and_heldout_is_disjoint() -> None:
    assert torch.equal(token_rows(3, "train", 4, 32), token_rows(3, "train", 4, 32))
    assert not torch.equal(token_rows(3, "train", 4, 32), token_rows(4, "train", 4, 32))
    assert torch.equal(heldout_rows(4, 32), heldout_rows(4, 32))


@pytest.fixture(scope="module")
def tiny_raw() -> dict[str, Any]:
    return run_bench(BenchConfig(size="tiny", seeds=1, steps=40, arms=tuple(ARMS)))


def test_every_arm_learns_on_the_heldout_set(tiny_raw: dict[str, Any]) -> None:
    runs = {r["arm"]: r for r in tiny_raw["runs"]}
    assert set(runs) == set(ARMS)
    for name, run in runs.items():
        assert run["init_ce"] == pytest.approx(math.log(48), abs=0.15), name  # uniform at init
        assert run["final_ce"] < run["init_ce"] - 0.3, name
        assert run["tokens"] == 40 * SIZES["tiny"].batch * SIZES["tiny"].seq
    # the governor arm differs only by its aux loss: same shape, seed, init
    assert runs["moe-top1-aux"]["init_ce"] == runs["moe-top1"]["init_ce"]
    assert runs["moe-top1-aux"]["train_loss"][0] == runs["moe-top1"]["train_loss"][0]
    assert len(runs["moe-top2"]["routing"]) == SIZES["tiny"].layers
    assert runs["dense"]["routing"] == []


def _onehot(choices: list[int], experts: int = 4) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(choices), experts).float() * 5.0


def test_routing_health_of_hand_built_router_logits() -> None:
    even, collapsed, one_dead = routing_health(
        [_onehot([0, 1, 2, 3] * 4), _onehot([0] * 15 + [1]), _onehot([0, 1, 2] * 5)], top_k=1
    )
    assert even.entropy == pytest.approx(1.0) and not even.collapsed and even.dead == ()
    assert max(even.fractions) == pytest.approx(0.25)
    assert collapsed.collapsed and collapsed.top1_share == pytest.approx(15 / 16)
    assert collapsed.dead == (2, 3)
    assert one_dead.dead == (3,) and not one_dead.collapsed
    assert one_dead.entropy == pytest.approx(math.log(3) / math.log(4))
    (top2,) = routing_health([torch.tensor([[3.0, 2.0, 0.0, -1.0]] * 4)], top_k=2)
    assert top2.counts == (4, 4, 0, 0) and top2.dead == (2, 3) and top2.collapsed


def test_t_interval_matches_a_hand_computation() -> None:
    ci = t_interval([1.0, 2.0, 4.0])
    # mean 7/3; s^2 = (16/9 + 1/9 + 25/9) / 2 = 7/3; half = t(0.975, 2) * s / sqrt(3)
    assert ci.mean == pytest.approx(7 / 3)
    assert ci.sd == pytest.approx(1.527525, abs=1e-6)
    assert ci.half == pytest.approx(4.302653 * 1.527525 / 1.732051, abs=1e-5)
    assert ci.low == pytest.approx(7 / 3 - 3.794583, abs=1e-5)
    assert t_interval([2.5]).half is None and t_interval([2.5]).low is None
    assert t975(1000) == pytest.approx(1.962339, abs=1e-4)
    assert t975(40) == pytest.approx(2.021075, abs=1e-4)
    assert gap_pct(1.06, 1.0) == pytest.approx(6.0)


def test_cli_json_fields_and_files(tmp_path: Path) -> None:
    out = tmp_path / "gm1"
    args = ["bench", "gm1", "--size", "tiny", "--seeds", "2", "--steps", "6",
            "--arms", "moe-top1", "--out", str(out), "--json"]  # fmt: skip
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)
    assert doc == json.loads((out / "results.json").read_text())
    assert (out / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    dense, moe = doc["arms"]["dense"], doc["arms"]["moe-top1"]
    ce = moe["heldout_ce"]
    assert ce["n"] == 2 and ce["low"] < ce["mean"] < ce["high"]
    finals = {r["seed"]: r["final_ce"] for r in doc["runs"] if r["arm"] == "moe-top1"}
    assert ce["mean"] == pytest.approx(sum(finals.values()) / 2, abs=1e-4)
    want = gap_pct(ce["mean"], dense["heldout_ce"]["mean"])
    assert moe["gap_vs_dense"]["of_means_pct"] == pytest.approx(want, abs=0.01)
    assert moe["gap_vs_dense"]["paired_pct"]["n"] == 2
    assert moe["tokens_per_s"] > 0 and abs(moe["params"]["active_vs_dense_pct"]) <= 2
    layer = moe["routing"][0]
    assert {"entropy_mean", "max_fraction_max", "dead_experts_per_seed", "collapsed_seeds"} <= set(
        layer
    )
    assert doc["config"]["steps"] == 6 and doc["machine"]["cpu_count"]
    assert sorted(doc["arms"]) == ["dense", "moe-top1"]  # dense always: the reference
    assert len(doc["curves"]["dense"]["steps"]) == len(doc["curves"]["dense"]["heldout_ce"])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--size", "huge"], "unknown bench size 'huge'"),
        (["--arms", "dense,moe-top9"], "unknown arm 'moe-top9'"),
        (["--seeds", "0"], "at least one seed"),
        (["--steps", "5", "--tokens", "100"], "--steps and --tokens both given"),
        (["--steps", "0"], "trains nothing"),
        (["--steps", "9" * 30], "more than a CPU bench can finish"),
        (["--tokens", "9" * 30], "more than a CPU bench can finish"),
        (["--seeds", "9" * 30], "more seeds than an interval needs"),
    ],
)
def test_bad_arguments_are_one_line_errors(args: list[str], says: str) -> None:
    size = [] if "--size" in args else ["--size", "tiny"]
    result = runner.invoke(app, ["bench", "gm1", *size, *args])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.output


def test_an_existing_result_is_never_overwritten(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text("{}")
    result = runner.invoke(app, ["bench", "gm1", "--size", "tiny", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "already holds a GM-1 result" in result.stderr
    assert (tmp_path / "results.json").read_text() == "{}"


def test_a_token_budget_becomes_whole_steps() -> None:
    tiny = SIZES["tiny"]
    config = BenchConfig(size="tiny", tokens=1000)
    assert config.resolved_steps() == math.ceil(1000 / (tiny.batch * tiny.seq))
    assert BenchConfig(size="tiny").resolved_steps() == tiny.steps


def _router_grad(normalise: bool) -> float:
    from moetune.bench.arms import config_dict
    from moetune.model import spec_from_config

    cfg = {**config_dict(SIZES["tiny"], 1, 16), "norm_topk_prob": normalise}
    torch.manual_seed(0)
    model = build_model(spec_from_config(cfg, "probe"), device="cpu", dtype=torch.float32)
    x = token_rows(0, "train", 2, 16)
    model(input_ids=x, labels=x).loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(grads) == SIZES["tiny"].layers and all(g is not None for g in grads)
    return max(float(g.abs().max()) for g in grads if g is not None)


def test_top1_router_learns_only_without_renormalising() -> None:
    """Why top-1 arms set norm_topk_prob off: a renormalised single weight is exactly 1,
    so the language-model loss sends the router no gradient (probes transformers)."""
    raw, renormalised = _router_grad(False), _router_grad(True)
    assert raw > 1e-6 and renormalised < 1e-6 * raw  # rounding noise only
