"""The census figures docs/plan.md quotes are the ones measured here, tier by tier.

count, recipe and plan are measured live over every decoder MoE type of the installed
transformers (seconds each). trace and train take long, so the page quotes the record
benchmarks/census_tiers.py writes (benchmarks/census_tiers.json), and says so; the slow
test re-measures those tiers against the record. A tier the record lacks must read "not yet
recorded" on the page – never a figure nobody measured.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers

from moetune.bench.census import CHEAP, OK, census_tiers, tier_counts
from moetune.errors import UnknownFamilyError
from moetune.model.census import moe_model_types, multimodal_model_types, tiny_multimodal_config
from moetune.model.derive import checkpoint_class

pytestmark = pytest.mark.filterwarnings("ignore")
ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "benchmarks" / "census_tiers.json"
PAGE = ROOT / "docs" / "plan.md"
SENTENCE = re.compile(
    r"On transformers (?P<version>[\d.]+), of \*\*(?P<types>\d+)\*\* decoder MoE types "
    r"\*\*(?P<count>\d+)\*\* count exactly, \*\*(?P<recipe>\d+)\*\* get a 100 % recipe and "
    r"\*\*(?P<plan>\d+)\*\* plan analytically;(?P<rest>.*?)`tests/test_census_tiers\.py`"
)
RECORDED = re.compile(r"\*\*(\d+)\*\* (trace|train)")
MULTIMODAL = re.compile(
    r"Of the \*\*(?P<types>\d+)\*\* multimodal types, \*\*(?P<train>\d+)\*\* train five "
    r"steps(?P<rest>.*?)`tests/test_census_tiers\.py`"
)
# the types that once ended in a traceback as new users built them (issue 37, item 6)
LIVE_TRAIN = ["mistral4", "bailing_hybrid", "step3p5"]


def _page() -> re.Match[str]:
    found = SENTENCE.search(" ".join(PAGE.read_text(encoding="utf-8").split()))
    assert found, "docs/plan.md lost its census sentence"
    return found


def _record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8")) if RECORD.exists() else {}


def test_the_page_names_the_installed_library() -> None:
    found = _page()
    assert transformers.__version__.startswith(found["version"])
    assert int(found["types"]) == len(moe_model_types())


def test_count_recipe_and_plan_figures_are_measured(tmp_path: Path) -> None:
    measured = tier_counts(census_tiers(CHEAP, tmp_path))
    found = _page()
    assert {t: int(found[t]) for t in CHEAP} == measured
    assert measured["count"] >= measured["recipe"] >= 1  # a recipe needs the build it counts


def test_trace_and_train_figures_are_the_records_or_say_none() -> None:
    rest, record = _page()["rest"], _record()
    quoted = {tier: int(n) for n, tier in RECORDED.findall(rest)}
    passed = (
        record.get("passed", {}) if record.get("transformers") == transformers.__version__ else {}
    )
    for tier in ("trace", "train"):
        if tier in passed:
            assert quoted.get(tier) == passed[tier], f"{tier}: the page must quote the record"
        else:
            assert tier not in quoted and tier in rest.lower() and "not yet recorded" in rest


def test_the_train_record_reproduces_live_for_a_sample(tmp_path: Path) -> None:
    record = _record()
    if "train" not in record.get("passed", {}):
        pytest.skip("no train record: python benchmarks/census_tiers.py --tiers train")
    now = census_tiers(("train",), tmp_path, LIVE_TRAIN)
    assert {t: s["train"] for t, s in now.items()} == {
        t: record["statuses"][t]["train"] for t in LIVE_TRAIN
    }


def _refusal(model_type: str) -> str | None:
    """Why transformers' class for the type's tiny checkpoint cannot train, or None."""
    from transformers import CONFIG_MAPPING

    values = tiny_multimodal_config(model_type)
    values.pop("model_type")
    try:
        checkpoint_class(CONFIG_MAPPING[model_type](**values))
    except UnknownFamilyError as exc:
        return exc.cause
    return None


def test_the_multimodal_figures_are_the_live_censuss() -> None:
    """Every multimodal type trains in its own layout (tests/test_census_multimodal.py) but
    those whose class moetune refuses; the page counts both and names the refused."""
    found = MULTIMODAL.search(" ".join(PAGE.read_text(encoding="utf-8").split()))
    assert found, "docs/plan.md lost its multimodal census sentence"
    types = multimodal_model_types()
    refused = [t for t in types if _refusal(t)]
    assert (int(found["types"]), int(found["train"])) == (len(types), len(types) - len(refused))
    assert all(f"{t} (" in found["rest"] for t in refused), refused


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["trace", "train"])
def test_the_record_reproduces(tier: str, tmp_path: Path) -> None:
    record = _record()
    if tier not in record.get("passed", {}):
        pytest.skip(f"no {tier} record: python benchmarks/census_tiers.py --tiers {tier}")
    statuses = census_tiers((tier,), tmp_path)
    now = {t: s[tier] == OK for t, s in statuses.items()}
    then = {t: s.get(tier) == OK for t, s in record["statuses"].items()}
    assert now == then
