"""Issue 48's fresh sweep, the Python API (docs/api.md): hostile-but-fair calls of
moetune.load / run_config / plan_run / lint_run / train_run / eval_run / gate_results /
export_run / push_run. Each must raise a MoetuneError subclass with a one-line cause that
names the right thing and a fix – a raw TypeError / AttributeError escaping the API, or a
bad value taken silently, is a failure. Cases marked "was:" failed on the previous main."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import moetune
from moetune.demo.base import SHIPPED_DIR
from moetune.errors import MoetuneError

BASE = str(SHIPPED_DIR)
TOKEN = "hf_sweepAPItokenQ7x9Z2m4K6p8R1t3"  # a token pasted into a repo id


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch dir of run.yamls, a dir that is not a run and a half-made run dir."""
    root = tmp_path_factory.mktemp("sweep-api")
    texts = {
        "run.yaml": f"model: {{id: {BASE}}}\n",
        "empty.yaml": "",
        "unknown-key.yaml": f"model: {{id: {BASE}}}\nbogus: 1\n",
        "unknown-field.yaml": f"model: {{id: {BASE}, colour: red}}\n",
        "list.yaml": "- a\n- b\n",
        "file.txt": "x",
        "fakerun/config.yaml": f"model: {{id: {BASE}}}\n",
    }
    for name, text in texts.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (root / "binary.yaml").write_bytes(b"\x00\xff\xfe")
    (root / "notrun").mkdir()
    return root


Call = Callable[[Path], Any]
RUN: Callable[[Path], Path] = lambda d: d / "run.yaml"  # noqa: E731

CASES: list[tuple[str, Call, str]] = [
    # run_config: what run.yaml holds, in any form
    ("rc/int", lambda d: moetune.run_config(3), "config=a int is not"),  # was: model id "3"
    ("rc/list", lambda d: moetune.run_config([1, 2]), "config=a list is not"),  # was: accepted
    ("rc/bytes", lambda d: moetune.run_config(b"run.yaml"), "config=a bytes"),  # was: accepted
    ("rc/empty-str", lambda d: moetune.run_config(""), "config='' is not"),  # was: accepted
    ("rc/blank-str", lambda d: moetune.run_config("  "), "is not a run.yaml path"),  # was: accepted
    ("rc/missing", lambda d: moetune.run_config(d / "none.yaml"), "none.yaml: not found"),
    ("rc/empty-yaml", lambda d: moetune.run_config(d / "empty.yaml"), "empty.yaml is empty"),
    ("rc/unknown-key", lambda d: moetune.run_config(d / "unknown-key.yaml"), "unknown key 'bogus'"),
    ("rc/unknown-field", lambda d: moetune.run_config(d / "unknown-field.yaml"), "'model.colour'"),
    ("rc/list-yaml", lambda d: moetune.run_config(d / "list.yaml"), "must hold a mapping"),
    ("rc/binary", lambda d: moetune.run_config(d / "binary.yaml"), "is not UTF-8 text"),
    ("rc/dict-unknown", lambda d: moetune.run_config({"bogus": 1}), "unknown key 'bogus'"),
    ("rc/dict-int-key", lambda d: moetune.run_config({1: 2}), "Keys should be strings"),
    ("rc/dict-section-int", lambda d: moetune.run_config({"model": 3}), "model: Input should be"),
    ("rc/section-str", lambda d: moetune.run_config(RUN(d), lora="big"), "lora='big' is not a"),
    ("rc/section-unknown", lambda d: moetune.run_config(RUN(d), bogus={"a": 1}), "'bogus'"),
    ("rc/field-unknown", lambda d: moetune.run_config(RUN(d), lora={"colour": 1}), "lora.colour"),
    ("rc/rank-str", lambda d: moetune.run_config(RUN(d), lora={"rank": "big"}), "lora.rank"),
    ("rc/rank-neg", lambda d: moetune.run_config(RUN(d), lora={"rank": -1}), "positive integer"),
    ("rc/rank-bool", lambda d: moetune.run_config(RUN(d), lora={"rank": True}), "not true / false"),
    ("rc/lr-bool", lambda d: moetune.run_config(RUN(d), train={"learning_rate": True}),
     "train.learning_rate: must be a number, not true / false"),  # was: trained at lr 1.0
    ("rc/lr-nan", lambda d: moetune.run_config(RUN(d), train={"learning_rate": float("nan")}),
     "train.learning_rate: must be a finite number"),
    ("rc/model-int", lambda d: moetune.run_config(model=3), "model=3 is not a section"),
    ("rc/model-none", lambda d: moetune.run_config(model=None), "model=None is not a section"),
    ("rc/model-empty", lambda d: moetune.run_config(model=""), "model='' is not"),  # was: taken
    ("rc/nothing", lambda d: moetune.run_config(), "no configuration"),
    ("rc/object", lambda d: moetune.run_config(RUN(d), train={"seed": object()}), "train.seed"),
    ("rc/runconfig-bad", lambda d: moetune.run_config(moetune.run_config(RUN(d)), lora={"rank": 0}),
     "lora.rank: must be a positive integer"),
    # plan_run / lint_run
    ("plan/cards-str", lambda d: moetune.plan_run(RUN(d), cards="H100-80GB"),
     "is not a list of card ids"),  # was: "unknown card 'H'" (planned letter by letter)
    ("plan/cards-int", lambda d: moetune.plan_run(RUN(d), cards=[80]),
     "is not a list of card ids"),  # was: AttributeError
    ("plan/cards-unknown", lambda d: moetune.plan_run(RUN(d), cards=["H100-81GB"]),
     "unknown card 'H100-81GB' (did you mean H100-80GB"),
    ("plan/estimator", lambda d: moetune.plan_run(RUN(d), estimator="magic"), "'magic'"),
    ("plan/model-missing", lambda d: moetune.plan_run(model=str(d / "nope")), "is not a directory"),
    ("plan/model-file", lambda d: moetune.plan_run(model=str(d / "file.txt")), "not valid JSON"),
    ("plan/model-not-a-model", lambda d: moetune.plan_run(model=str(d / "notrun")),
     "config.json does not exist"),
    ("lint/missing", lambda d: moetune.lint_run(d / "none.yaml"), "not found"),
    ("lint/unknown-key", lambda d: moetune.lint_run(d / "unknown-key.yaml"), "'bogus'"),
    ("lint/int", lambda d: moetune.lint_run(5), "config=a int is not"),  # was: model id "5"
    # train_run / load: refused before anything is built
    ("train/missing", lambda d: moetune.train_run(d / "none.yaml"), "not found"),
    ("train/unknown-key", lambda d: moetune.train_run(d / "unknown-key.yaml"), "'bogus'"),
    ("train/bytes", lambda d: moetune.train_run(b"x"), "config=a bytes"),
    ("load/missing", lambda d: moetune.load(d / "none.yaml"), "not found"),
    ("load/int", lambda d: moetune.load(3), "config=a int is not"),
    ("load/model-missing", lambda d: moetune.load(model=str(d / "nope")), "is not a directory"),
    ("load/not-a-model", lambda d: moetune.load(model=str(d / "notrun")), "does not exist"),
    ("load/unknown-kw", lambda d: moetune.load(RUN(d), colour="red"), "colour='red' is not a"),
    # eval_run
    ("eval/limit-str", lambda d: moetune.eval_run(RUN(d), limit="ten"), "limit='ten' is not"),
    ("eval/limit-bool", lambda d: moetune.eval_run(RUN(d), limit=True), "limit=True is not"),
    ("eval/limit-0", lambda d: moetune.eval_run(RUN(d), limit=0), "limit=0 is not"),
    ("eval/limit-neg", lambda d: moetune.eval_run(RUN(d), limit=-3), "limit=-3 is not"),
    ("eval/adapter-int", lambda d: moetune.eval_run(RUN(d), adapter=7), "adapter=a int"),
    ("eval/no-ladder", lambda d: moetune.eval_run(RUN(d)), "eval.rungs is empty"),
    # gate_results
    ("gate/missing", lambda d: moetune.gate_results(d / "nope"), "ladder.json: not found"),
    ("gate/not-results", lambda d: moetune.gate_results(d / "notrun"), "ladder.json: not found"),
    ("gate/file", lambda d: moetune.gate_results(d / "file.txt"), "Not a directory"),
    ("gate/empty-str", lambda d: moetune.gate_results(""), "results='' is not"),
    ("gate/int", lambda d: moetune.gate_results(3), "results=a int is not"),  # was: TypeError
    ("gate/alpha-2", lambda d: moetune.gate_results(d, alpha=2.0),
     "--alpha 2.0 is not a family-wise error rate"),  # was: decided at alpha 2
    ("gate/alpha-nan", lambda d: moetune.gate_results(d, alpha=float("nan")), "--alpha nan"),
    ("gate/alpha-0", lambda d: moetune.gate_results(d, alpha=0.0), "--alpha 0.0"),
    ("gate/alpha-str", lambda d: moetune.gate_results(d, alpha="low"), "--alpha 'low'"),
    ("gate/alpha-bool", lambda d: moetune.gate_results(d, alpha=True), "--alpha True"),
    # export_run
    ("export/missing", lambda d: moetune.export_run(d / "nope", "merged", d / "x"),
     "is neither a run dir"),
    ("export/not-a-run", lambda d: moetune.export_run(d / "notrun", "merged", d / "x"),
     "is neither a run dir"),
    ("export/format", lambda d: moetune.export_run(d / "fakerun", "onnx", d / "x"),
     "unknown export format 'onnx'"),
    ("export/format-int", lambda d: moetune.export_run(d / "fakerun", 3, d / "x"),
     "unknown export format 3"),
    ("export/items-0", lambda d: moetune.export_run(d, "merged", d / "x", items=0), "items=0"),
    ("export/items-str", lambda d: moetune.export_run(d, "merged", d / "x", items="many"),
     "items='many' is not a positive number"),  # was: TypeError
    ("export/items-bool", lambda d: moetune.export_run(d, "merged", d / "x", items=True),
     "items=True is not"),  # was: checked one item
    ("export/dtype", lambda d: moetune.export_run(d, "merged", d / "x", dtype="float99"),
     "--dtype 'float99'"),
    ("export/source-none", lambda d: moetune.export_run(None, "merged", d / "x"),
     "source=a NoneType is not"),  # was: TypeError
    ("export/source-empty", lambda d: moetune.export_run("", "merged", d / "x"),
     "source='' is not"),  # was: "." (the working dir) tried
    ("export/out-none", lambda d: moetune.export_run(d / "fakerun", "merged", None),
     "out=a NoneType is not"),  # was: TypeError
    ("export/items-file-int", lambda d: moetune.export_run(d, "merged", d / "x", items_file=3),
     "items_file=a int is not"),  # was: TypeError
    # push_run
    ("push/missing", lambda d: moetune.push_run(d / "nope", "u/n"), "not a moetune run directory"),
    ("push/not-a-run", lambda d: moetune.push_run(d / "notrun", "u/n"), "no config.yaml"),
    ("push/repo-bad", lambda d: moetune.push_run(d / "fakerun", "no-slash"), "not a Hub repo id"),
    ("push/repo-int", lambda d: moetune.push_run(d / "fakerun", 5), "repo=5 is not a Hub repo"),
    ("push/option-unknown", lambda d: moetune.push_run(d / "fakerun", "u/n", colour="red"),
     "push_run has no option colour"),  # was: TypeError
    ("push/no-adapter", lambda d: moetune.push_run(d / "fakerun", "u/n"), "holds no trained"),
    ("push/export-missing", lambda d: moetune.push_run(d / "fakerun", "u/n", export="gguf"),
     "has no gguf export on disk"),
    ("push/results-int", lambda d: moetune.push_run(d / "fakerun", "u/n", results_dir=5),
     "results_dir=a int is not"),  # was: TypeError
    ("push/results-missing", lambda d: moetune.push_run(d / "fakerun", "u/n",
                                                        results_dir=d / "nope"),
     "--results"),  # was: ignored ("never gated")
    ("push/token-in-repo", lambda d: moetune.push_run(d / "fakerun", f"{TOKEN}@u/n"),
     "is not a Hub repo id"),
    ("push/license", lambda d: moetune.push_run(d / "fakerun", "u/n", license="MIT License"),
     "--license MIT License is not a Hub license id"),  # was: sent to the Hub
]  # fmt: skip


@pytest.mark.parametrize(("name", "call", "says"), CASES, ids=[c[0] for c in CASES])
def test_a_bad_api_call_is_a_moetune_error_naming_its_cause(
    files: Path, name: str, call: Call, says: str
) -> None:
    with pytest.raises(MoetuneError) as info:
        call(files)
    err = info.value
    assert says in err.cause, err.cause
    assert err.fix and "\n" not in str(err)
    assert TOKEN not in str(err)  # a token pasted where a repo id goes is never echoed


def test_the_sweep_of_the_api_has_its_cases() -> None:
    names = [c[0] for c in CASES]
    assert len(names) == len(set(names)) >= 80
