"""Every script in benchmarks/ runs: its --smoke mode, in its own process, as a user would
start it – so a renamed config field or API breaks the suite, not the next measurement (the
heaviest in the slow tier: SLOW_SMOKE).

The scripts are found on disk (a new one is covered by itself); each must pin its threads
through bench_env before torch loads, take --smoke, and leave the results pages
(benchmarks/results/*.md, indexed by RESULTS.md) untouched there. Beyond --smoke, no script
writes a results page unless asked with --record: every write goes through bench_env
(write_results / append_results), reached only under an `if` on the record flag, which
defaults to off (read from each script's syntax tree). And benchmarks/README.md, the front
door, has a row for every script and names only pages that exist.
"""

from __future__ import annotations

import ast
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if '__name__ == "__main__"' in p.read_text())
# What each smoke run must print (its figures), and the arguments it needs besides --smoke.
EXPECT: dict[str, tuple[list[str], str]] = {
    "cli_sweep.py": ([], r"cases: 4 · OK 4"),
    "cpu_plan.py": ([], r"\| peak RSS of `moetune train` \| \d+\.\d+ GiB .*\| \d\.\d+ \|"),
    "demo_base.py": (["mixed"], r'"step": 2, "train_s"'),
    "census_tiers.py": ([], r'"passed": \{"count": 3, "recipe": 3, "plan": 3\}'),
    "experts_lora.py": ([], r"speed.*\d"),
    "gemma4_terms.py": ([], r"\| census shape .*\| 128 \| \d+\.\d / \d+\.\d \|"),
    "grpo_routing.py": ([], r"\| deepseek_v3 tiny \| bfloat16 \| \d+ \| \d+\.\d+% \|.*\| 100% \|"),
    "kt_kernel.py": ([], r"CPU .*; flags: "),  # without kt-kernel (its own venv): flags + why
    # each path's output and LoRA grads agree with peft's (≤ 1e-4) or the script exits 1
    "moe_layer.py": ([], r"\| 128 \| split \| .*\n\| 128 \| peft \| .*\n\| 128 \| peft_un"),
    "grpo_step.py": ([], r"\| 4 \| \d+\.\d+ \| \d+\.\d+ \|"),
    "offload_stream.py": ([], r"disk stream / O_DIRECT: \d+\.\d+ · cpu stream / memcpy: \d"),
    "planner_accuracy.py": ([], r"worst: [+-]\d+\.\d %"),
    "sharded_load.py": ([], r"rank 1: peak RSS \d+\.\d+ GiB.*plan \d+\.\d+ GiB"),
    "sharding_accuracy.py": ([], r"world 2 rank 1: measured \d+\.\d+ MiB, planned"),
    "stored_offload.py": ([], r"\| peak RSS of `moetune train` \| \d+\.\d+ .iB .*\| \d\.\d+ \|"),
    "trace_speed.py": ([], r"peak +\d+\.\d+ GiB"),
}


# Scripts whose --smoke a test of their own already runs (not run twice): offload_disk in a
# subprocess; gpu_validate through its main() with three cases, the one here among them.
COVERED = {
    "offload_disk.py": ("test_train_offload.py", "test_disk_benchmark_smoke"),
    "gpu_validate.py": ("test_gpu_validate.py", "test_smoke_measures_every_case_byte_exact"),
}


def _digest() -> str:
    """Of the index and every results page, so a smoke run that writes any of them shows."""
    pages = [BENCH / "RESULTS.md", *sorted((BENCH / "results").glob("*.md"))]
    return hashlib.sha256(b"".join(p.read_bytes() for p in pages)).hexdigest()


def test_every_script_is_known_and_pins_its_threads() -> None:
    assert set(SCRIPTS) == set(EXPECT) | set(COVERED), "a benchmark without a smoke test"
    for test_file, test_name in COVERED.values():
        text = (BENCH.parent / "tests" / test_file).read_text()
        assert f"def {test_name}(" in text and '"--smoke"' in text
    for name in SCRIPTS:
        text = (BENCH / name).read_text()
        assert re.search(r"^import bench_env$", text, re.M), f"{name}: bench_env not imported"
        assert (
            text.index("import bench_env") < text.index("import torch")
            if "import torch" in text
            else True
        )
        assert '"--smoke"' in text, f"{name} has no --smoke"


# The smoke runs that start several processes each (1- and 2-rank trains, a calibrated
# host, a 27-layer stored shape's small twin, a census shape, timed traces): the slow tier
# (make test-slow) runs them, so the default tier stays in its time budget; their paths
# have default-tier tests of their own (test_train_sharded_load, test_train_run's CPU plan
# ratio, test_train_stored / test_train_offload, test_census, test_trace).
SLOW_SMOKE = {"sharded_load.py", "cpu_plan.py", "stored_offload.py", "gemma4_terms.py",
              "trace_speed.py"}  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SMOKE else n for n in sorted(EXPECT)],
)
def test_smoke_run(name: str, tmp_path: Path) -> None:
    args, pattern = EXPECT[name]
    before = _digest()
    env = os.environ | {"HF_HUB_OFFLINE": "1", "HOME": str(tmp_path), "OUT": str(tmp_path)}
    done = subprocess.run(
        [sys.executable, str(BENCH / name), *args, "--smoke"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(pattern, done.stdout), done.stdout[-3000:]
    assert _digest() == before, f"{name} --smoke wrote to a results page"


WRITERS = {"write_results", "append_results", "append_to_section"}  # bench_env's: the only
# ways to a results page
WRITE_ATTRS = {"write_text", "write_bytes", "open", "replace", "rename", "with_suffix"}


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Under an `if` that tests the record flag (args.record, args.record_from)."""
    while node in parents:
        child, node = node, parents[node]
        if isinstance(node, ast.If) and child in node.body and "record" in ast.unparse(node.test):
            return True
    return False


def _enclosing(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str | None:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.FunctionDef):
            return node.name
    return None


def _reaching(tree: ast.Module, parents: dict[ast.AST, ast.AST]) -> set[str | None]:
    """Functions (None: module level) that write RESULTS.md when called, unguarded."""
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    reach: set[str | None] = set()
    while True:
        more = {
            _enclosing(c, parents)
            for c in calls
            if (isinstance(c.func, ast.Attribute) and c.func.attr in WRITERS)
            or (isinstance(c.func, ast.Name) and (c.func.id in WRITERS or c.func.id in reach))
            if not _guarded(c, parents)
        }
        if more <= reach:
            return reach
        reach |= more


def _turns_on(target: ast.expr, value: ast.expr) -> bool:
    off = isinstance(value, ast.Constant) and value.value is False
    return isinstance(target, ast.Attribute) and target.attr == "record" and not off


def _assigned_record(tree: ast.Module) -> list[str]:
    """Assignments that could turn the record flag on (only `= False` is allowed)."""
    bad = []
    for node in (n for n in ast.walk(tree) if isinstance(n, ast.Assign)):
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts, strict=True))
            bad += [ast.unparse(node) for t, v in pairs if _turns_on(t, v)]
    return bad


def _own_writes(tree: ast.Module) -> list[str]:
    """Calls that write RESULTS.md around bench_env (RESULTS.write_text, tmp.replace(RESULTS))."""
    return [
        ast.unparse(c)
        for c in ast.walk(tree)
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
        and c.func.attr in WRITE_ATTRS and "RESULTS" in ast.unparse(c)
    ]  # fmt: skip


def _names(tree: ast.Module) -> set[str]:
    return {getattr(n, "attr", getattr(n, "id", "")) for n in ast.walk(tree)}


def record_problems(source: str) -> list[str]:
    """Why `source` (a benchmark script) could write RESULTS.md without --record."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    out = [f"{name or 'module level'} writes RESULTS.md unguarded"
           for name in _reaching(tree, parents) if name in (None, "main")]  # fmt: skip
    out += [f"writes RESULTS.md itself: {call}" for call in _own_writes(tree)]
    out += [f"turns recording on: {a}" for a in _assigned_record(tree)]
    if "--no-record" in source:
        out.append("--no-record: recording must be asked for, not declined")
    flag = re.search(r'"--record",\s*action="store_true"', source)
    if _names(tree) & WRITERS and not flag:
        out.append("writes RESULTS.md but has no --record flag (store_true)")
    return out


@pytest.mark.parametrize("name", SCRIPTS)
def test_results_are_written_only_with_record(name: str) -> None:
    assert record_problems((BENCH / name).read_text()) == []


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("def main(args):\n    args.record = args.record or not args.smoke\n"
         "    if args.record:\n        bench_env.append_results(RESULTS, 'h', 't')\n",
         "turns recording on"),
        ("def record(t):\n    bench_env.write_results(RESULTS, t)\n"
         "def main(args):\n    if args.smoke:\n        return 0\n    record('t')\n",
         "main writes RESULTS.md unguarded"),
        ("def main(args):\n    if not args.no_record:\n        RESULTS.open('a').write('x')\n",
         "writes RESULTS.md itself"),
    ],
)  # fmt: skip
def test_the_record_check_finds_a_default_write(source: str, says: str) -> None:
    """The check above is not vacuous: the patterns the scripts used to have are caught."""
    assert any(says in problem for problem in record_problems(source))


# --- the front door: benchmarks/README.md ------------------------------------------------

README = BENCH / "README.md"
ROW = re.compile(r"^\| \[(\w+\.py)\]\(\1\) \|(.*)$", re.M)  # a table row naming a script first
PAGE = re.compile(r"\]\((results/[\w-]+\.md)\)")
NAMED = re.compile(r"results_page\(\"([\w-]+)\"\)")  # the page a script records to


def _rows() -> dict[str, str]:
    return dict(ROW.findall(README.read_text()))


def test_every_script_has_a_row_in_the_readme() -> None:
    rows = _rows()
    assert sorted(set(SCRIPTS) - set(rows)) == [], "add a row to benchmarks/README.md"
    helpers = {p.name for p in BENCH.glob("*.py")} - set(SCRIPTS)  # imported, not run
    assert sorted(helpers - set(rows)) == [], "name the helper in benchmarks/README.md"


def test_the_readmes_pages_exist_and_each_script_row_names_its_own() -> None:
    named = set(PAGE.findall(README.read_text()))
    assert named and sorted(p for p in named if not (BENCH / p).exists()) == []
    rows = _rows()
    for name in SCRIPTS:
        pages = {f"results/{t}.md" for t in NAMED.findall((BENCH / name).read_text())}
        assert pages <= set(PAGE.findall(rows.get(name, ""))), f"{name}'s row: {pages}"


def test_the_index_links_every_results_page() -> None:
    index = (BENCH / "RESULTS.md").read_text()
    pages = {f"results/{p.name}" for p in (BENCH / "results").glob("*.md")}
    assert pages and pages == set(PAGE.findall(index))
