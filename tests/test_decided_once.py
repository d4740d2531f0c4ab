"""Each fact of a run is decided once: one `moetune train` loads the spec once, computes the
dtype the base loads in once, picks the engine once, reads the published format once (from
the spec – config.json is never read a second way), and plans once (the preflight's plan and
the plan of the configuration that runs, each once).

The calls are counted by code object with a profiler, so they count whatever name a module
imported the function under."""

from __future__ import annotations

import collections
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from moetune.cli import app
from moetune.config import dump_config
from moetune.engine import resolve
from moetune.engine.resolve import decide_engine
from moetune.engine.stored import formats
from moetune.engine.stored.write import write_stored
from moetune.model import load_spec
from moetune.plan.planner import make_plan
from moetune.plan.run_plan import plan_of_run
from moetune.train.setup import as_run
from test_train_helpers import reverse_rows, run_config, save_tiny_model, write_jsonl

DECISIONS: dict[str, Callable[..., Any]] = {
    "spec": load_spec,
    "load dtype": as_run,
    "engine": decide_engine,
    "stored format": formats.decide_format,
    "config.json read for its format": formats.base_format,
    "memory plan": make_plan,
    "plan of the run": plan_of_run,
}


@contextmanager
def counted() -> Iterator[collections.Counter[str]]:
    """How often each of DECISIONS ran inside the block (every thread)."""
    codes = {getattr(f, "__wrapped__", f).__code__: name for name, f in DECISIONS.items()}
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call" and frame.f_code in codes:
            counts[codes[frame.f_code]] += 1

    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        yield counts
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _train_counts(model: Path, tmp_path: Path) -> collections.Counter[str]:
    data = write_jsonl(tmp_path / "rows.jsonl", reverse_rows())
    cfg = run_config(model, data, tmp_path / "out", max_steps=2)
    run = tmp_path / "run.yaml"
    run.write_text(dump_config(cfg), encoding="utf-8")
    resolve._ENGINES.clear()  # an earlier test's run of the same kind decided it already
    with counted() as counts:
        result = CliRunner().invoke(app, ["train", str(run)])
    assert result.exit_code == 0, result.output
    return counts


@pytest.fixture(scope="module")
def float_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("float") / "base")


def test_one_train_decides_each_fact_once(float_base: Path, tmp_path: Path) -> None:
    counts = _train_counts(float_base, tmp_path)
    assert counts["spec"] == 1
    assert counts["load dtype"] == 1
    assert counts["engine"] == 1
    assert counts["memory plan"] == 1 and counts["plan of the run"] == 1
    assert counts["config.json read for its format"] == 0  # a float base: nothing to read


def test_a_stored_base_reads_its_format_once(float_base: Path, tmp_path: Path) -> None:
    """An FP8 release: the plan, the rules, the engine, the check and the loader all ask
    for its format; it is decided once, from the spec."""
    fp8 = write_stored(float_base, tmp_path / "fp8", "fp8", block=(8, 8))
    formats._FORMATS.clear()  # another test may have decided this config already
    counts = _train_counts(fp8, tmp_path)
    assert counts["stored format"] == 1
    assert counts["config.json read for its format"] == 0
    assert counts["spec"] == 1 and counts["engine"] == 1 and counts["load dtype"] == 1


def test_an_engine_is_decided_afresh_for_another_configuration(float_base: Path) -> None:
    """The engine is kept per configuration it reads, never handed to another one: a run
    that drops the experts from its targets gets peft's engine."""
    from moetune.config import LoraArgs
    from moetune.engine.resolve import resolve_engine

    spec = load_spec(str(float_base))
    experts = resolve_engine(spec, LoraArgs())
    attention_only = resolve_engine(spec, LoraArgs(targets=["attention"]))
    assert (experts, attention_only) == ("moetune", "peft")
    assert resolve_engine(spec, LoraArgs(targets=["attention"]), "nf4") == "moetune"
