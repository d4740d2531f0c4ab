"""make_plan: the acceptance case, overhead as its own line, recommendations that fit,
and the best config per card."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from moetune.config import RunConfig, parse_config
from moetune.errors import UnknownCardError
from moetune.model import load_spec
from moetune.model.spec import ModelSpec
from moetune.plan import card_ids, get_card, make_plan
from moetune.plan.fit import analytic, card_fit
from moetune.plan.recommend import COSTS, _build, _options

GiB = 1024**3
VANILLA = {  # what a vanilla peft user runs: peft's ParamWrapper, peft's name mapping
    "lora": {"rank": 16, "targets": ["attention", "experts"], "expert_mapping": "automap",
             "engine": "peft"},
    "train": {"seq_len": 2048, "batch_size": 1, "gradient_checkpointing": True},
}  # fmt: skip
MOETUNE = {  # moetune's defaults for the same run (explicit targets, engine auto)
    "lora": {"rank": 16, "targets": ["attention", "experts"]},
    "train": {"seq_len": 2048, "batch_size": 1},
}
CARDS = ["H100-80GB", "H100-NVL", "H200"]


@pytest.fixture(scope="module")
def qwen30b() -> ModelSpec:
    return load_spec("Qwen/Qwen3-30B-A3B")


@pytest.fixture(scope="module")
def vanilla() -> RunConfig:
    return parse_config(VANILLA)


def with_overrides(raw: dict[str, Any], overrides: tuple[str, ...]) -> RunConfig:
    """parse_config on a copy: it writes overrides into the nested dicts it is given."""
    return parse_config(copy.deepcopy(raw), list(overrides))


def test_vanilla_peft_qwen3_30b_needs_more_than_an_80gb_card(
    qwen30b: ModelSpec, vanilla: RunConfig
) -> None:
    plan = make_plan(qwen30b, vanilla, cards=CARDS)
    assert plan.estimator == "analytic"
    assert plan.trainable_params == 994_836_480
    # the trace measures 73.60 GiB of live tensors in the steady state (step 2)
    assert plan.peak_bytes / GiB == pytest.approx(73.6, abs=0.3)
    assert not plan.fits["H100-80GB"].fits
    assert plan.fits["H100-NVL"].fits and plan.fits["H200"].fits
    # ≈ 85 GB reserved on a real run, plus the CUDA context
    assert plan.required_bytes / 1e9 == pytest.approx(85.6, abs=0.5)


def test_overhead_is_its_own_line(qwen30b: ModelSpec, vanilla: RunConfig) -> None:
    plan = make_plan(qwen30b, vanilla, cards=CARDS)
    assert plan.overhead_bytes > 0
    assert plan.required_bytes == plan.peak_bytes + plan.overhead_bytes
    assert sum(plan.components.values()) == plan.peak_bytes
    assert plan.overhead.terms["cuda_context"] > 0
    for fit in plan.fits.values():
        assert fit.required_bytes == plan.peak_bytes + fit.overhead_bytes
        assert fit.headroom_bytes == fit.usable_bytes - fit.required_bytes


def test_to_json_has_the_documented_keys(qwen30b: ModelSpec, vanilla: RunConfig) -> None:
    data = make_plan(qwen30b, vanilla, cards=CARDS).to_json()
    for key in ("estimator", "peak_bytes", "components", "peak_op", "fits", "trainable_params",
                "overhead_bytes", "required_bytes", "recommendations"):  # fmt: skip
        assert key in data
    assert data["fits"] == {"H100-80GB": False, "H100-NVL": True, "H200": True}
    json.dumps(data)  # serialisable as is


def test_recommendations_for_the_80gb_card_fit_when_replanned(
    qwen30b: ModelSpec, vanilla: RunConfig
) -> None:
    plan = make_plan(qwen30b, vanilla, cards=["H100-80GB"])
    recs = plan.recommendations
    assert recs and all(r.card == "H100-80GB" and r.fits for r in recs)
    assert recs == sorted(recs, key=lambda r: r.cost)
    # the cheapest change: the same adapter on moetune's engine, no W+ΔW copies (cost 0)
    assert recs[0].overrides == ("lora.engine=moetune",) and recs[0].cost == 0.0
    assert recs[0].peak_bytes / GiB == pytest.approx(72.11, abs=0.01)
    assert plan.best["H100-80GB"] == recs[0]
    for rec in recs:
        replanned = make_plan(qwen30b, with_overrides(VANILLA, rec.overrides), ["H100-80GB"])
        assert replanned.fits["H100-80GB"].fits
        assert replanned.peak_bytes == rec.peak_bytes


def test_a_small_moe_on_a_24gb_card_gets_a_config_that_fits() -> None:
    spec = load_spec("allenai/OLMoE-1B-7B-0924")
    raw = {"lora": {"rank": 64}, "train": {"seq_len": 8192, "batch_size": 4,
                                           "gradient_checkpointing": False}}  # fmt: skip
    plan = make_plan(spec, parse_config(raw), cards=["RTX-4090"])
    assert not plan.fits["RTX-4090"].fits
    assert plan.recommendations and plan.recommendations[0].fits
    for rec in plan.recommendations:
        replanned_cfg = with_overrides(raw, rec.overrides)
        assert "experts" in replanned_cfg.lora.targets
        replanned = make_plan(spec, replanned_cfg, ["RTX-4090"])
        assert replanned.fits["RTX-4090"].fits
        assert replanned.required_bytes <= 23.65 * GiB


def test_a_card_too_small_for_the_weights_says_so() -> None:
    spec = load_spec("Qwen/Qwen3-235B-A22B")
    plan = make_plan(spec, parse_config(MOETUNE), cards=["RTX-4090"])
    (rec,) = plan.recommendations
    assert not rec.fits and plan.best["RTX-4090"] == rec
    # even as NF4 the frozen experts of a 235B model are ~115 GiB
    assert "frozen weights alone" in rec.describe() and "experts as NF4" in rec.describe()
    assert "experts were not dropped" in rec.describe()
    assert "model.experts_dtype=nf4" in rec.overrides  # the leanest searched config
    assert rec.peak_bytes > 100 * GiB


def test_unknown_card_is_a_moetune_error(qwen30b: ModelSpec, vanilla: RunConfig) -> None:
    with pytest.raises(UnknownCardError, match="unknown card"):
        make_plan(qwen30b, vanilla, cards=["H100-80GB", "TPU-v5"])


def test_all_cards_by_default(qwen30b: ModelSpec, vanilla: RunConfig) -> None:
    plan = make_plan(qwen30b, vanilla)
    assert {"H200", "B200", "M3-Ultra-512GB", "DGX-Spark"} <= set(plan.fits)
    assert plan.fits["B200"].fits and not plan.fits["RTX-5090"].fits


def test_analytic_matches_the_plan(qwen30b: ModelSpec, vanilla: RunConfig) -> None:
    assert analytic(qwen30b, vanilla).peak_bytes == make_plan(qwen30b, vanilla, CARDS).peak_bytes


@pytest.mark.slow
def test_trace_agrees_on_the_acceptance_case(qwen30b: ModelSpec, vanilla: RunConfig) -> None:
    plan = make_plan(qwen30b, vanilla, cards=CARDS, estimator="trace")
    assert plan.estimator == "trace" and plan.peak_op
    assert plan.peak_bytes / GiB == pytest.approx(73.6, abs=0.1)
    assert not plan.fits["H100-80GB"].fits
    assert plan.fits["H100-NVL"].fits and plan.fits["H200"].fits
    assert plan.peak_bytes == pytest.approx(analytic(qwen30b, vanilla).peak_bytes, rel=0.02)


def test_dropout_trap_is_planned_without_dropout(qwen30b: ModelSpec) -> None:
    # peft refuses this config (the rules report it); the plan still sizes the step
    raw = copy.deepcopy(VANILLA)
    raw["lora"]["dropout"] = 0.05
    plan = make_plan(qwen30b, parse_config(raw), cards=CARDS)
    assert plan.peak_bytes == make_plan(qwen30b, parse_config(VANILLA), cards=CARDS).peak_bytes
    assert any("dropout=0" in note for note in plan.notes)


# ---------------------------------------------------------------- best config per card


def test_a_24gb_card_gets_quantised_experts_and_a_lower_expert_rank(qwen30b: ModelSpec) -> None:
    cfg = parse_config(MOETUNE)
    plan = make_plan(qwen30b, cfg, cards=["RTX-4090"])
    best = plan.best["RTX-4090"]
    assert not plan.fits["RTX-4090"].fits and best.fits
    assert best.overrides == (
        "lora.engine=moetune", "model.experts_dtype=nf4", "model.experts_double_quant=true",
        "lora.expert_rank=4",
    )  # fmt: skip
    assert best.cost == COSTS["nf4"] + 2 * COSTS["expert_rank"]
    assert best.peak_bytes <= 22 * GiB
    assert best.peak_bytes / GiB == pytest.approx(19.78, abs=0.02)
    assert best.required_bytes <= get_card("RTX-4090").usable_bytes
    replanned = with_overrides(MOETUNE, best.overrides)
    assert replanned.lora.effective_expert_rank == 4 and replanned.lora.rank == 16
    assert analytic(qwen30b, replanned).peak_bytes == best.peak_bytes


def test_the_expert_rank_shrinks_the_adapter(qwen30b: ModelSpec) -> None:
    # attention keeps r=16 (13.4 M params); the expert stacks go from 629 M to 157 M
    full = analytic(qwen30b, parse_config(MOETUNE)).trainable_params
    low = analytic(qwen30b, with_overrides(MOETUNE, ("lora.expert_rank=4",))).trainable_params
    assert full == 642_514_944
    assert full - low == 629_145_600 * 3 // 4


def test_32gb_and_80gb_cards(qwen30b: ModelSpec) -> None:
    plan = make_plan(qwen30b, parse_config(MOETUNE), cards=["RTX-5090", "H100-80GB"])
    assert plan.fits["H100-80GB"].fits  # engine auto is moetune on qwen3_moe: as is
    assert plan.best["H100-80GB"].overrides == () and plan.best["H100-80GB"].cost == 0.0
    assert plan.best["H100-80GB"].peak_bytes == plan.peak_bytes
    five = plan.best["RTX-5090"]  # NF4 alone is enough: the expert rank stays 16
    assert five.fits and five.cost == COSTS["nf4"]
    assert "model.experts_dtype=nf4" in five.overrides
    assert not any(o.startswith("lora.expert_rank") for o in five.overrides)
    assert five.peak_bytes / GiB == pytest.approx(26.80, abs=0.02)


def test_int8_is_preferred_where_it_fits(qwen30b: ModelSpec) -> None:
    plan = make_plan(qwen30b, parse_config(MOETUNE), cards=["L40S"])
    best = plan.best["L40S"]
    assert best.overrides == ("lora.engine=moetune", "model.experts_dtype=int8")
    assert best.cost == COSTS["int8"] and best.fits
    # NF4 also fits the L40S, but it includes int8's compromise: never recommended next to it
    assert all("model.experts_dtype=nf4" not in r.overrides for r in plan.recommendations)


def test_quality_costs_are_ordered_as_documented() -> None:
    order = ["engine", "gc", "int8", "nf4", "expert_rank", "rank", "dense", "shared",
             "attention", "seq"]  # fmt: skip
    costs = [COSTS[name] for name in order]
    assert costs == sorted(costs) and len(set(costs)) == len(costs)
    assert COSTS["engine"] == 0.0 == COSTS["qlora→lora"] == COSTS["dq"]


@pytest.mark.parametrize(
    ("model", "raw"),
    [
        ("Qwen/Qwen3-30B-A3B", VANILLA),
        ("allenai/OLMoE-1B-7B-0924",
         {"lora": {"rank": 64}, "train": {"seq_len": 8192, "batch_size": 4,
                                          "gradient_checkpointing": False}}),
    ],
)  # fmt: skip
def test_no_recommendation_is_dominated(model: str, raw: dict[str, Any]) -> None:
    """No cheaper subset of a recommendation's changes fits its card (every option replanned)."""
    spec, cfg = load_spec(model), parse_config(raw)
    plan = make_plan(spec, cfg)
    built = [(o, _build(cfg, spec, o)) for o in _options(cfg, spec)]
    moves = {c.overrides: o.moves for o, c in built if c is not None}
    peaks: dict[frozenset[str], int] = {}
    checked = 0
    # offloading is offered only where no searched option fits (a fallback, not a move)
    searched = (r for r in plan.recommendations if "train.offload=" not in " ".join(r.overrides))
    for rec in (r for r in searched if r.fits):
        card, mine = get_card(rec.card), moves[rec.overrides]
        assert rec.peak_bytes == analytic(spec, with_overrides(raw, rec.overrides)).peak_bytes
        for option, cand in built:
            if cand is None or not option.moves < mine:
                continue
            if option.moves not in peaks:
                peaks[option.moves] = analytic(spec, cand.cfg).peak_bytes
            assert not card_fit(card, peaks[option.moves]).fits, (rec.card, cand.overrides)
            checked += 1
    assert checked > 10


def test_every_card_has_a_best_entry(qwen30b: ModelSpec, vanilla: RunConfig) -> None:
    plan = make_plan(qwen30b, vanilla)
    assert list(plan.best) == card_ids()
    for card, best in plan.best.items():
        fits_as_is = plan.fits[card].fits
        assert best.fits  # every card in the catalog fits a 30B-A3B with some change
        assert (best.overrides == ()) == fits_as_is
        cheapest = min((r.cost for r in plan.recommendations if r.card == card), default=0.0)
        assert best.cost == (0.0 if fits_as_is else cheapest)
    assert plan.to_json()["best"]["RTX-4090"]["overrides"] == list(plan.best["RTX-4090"].overrides)
