"""Hostile-but-fair CLI sweep: bad YAML, bad flags, bad data, bad paths and fuzzed run
configs, each a `moetune` subprocess, each outcome classified.

    ok       exit 0
    refused  exit 2 (or 1, a check that failed) with a one-line cause, no traceback
    BAD      exit 3 ("unexpected …"), a traceback, any other exit, a multi-line error, a timeout

Prints a count per class and every BAD case (name, exit, the last stderr line).
`--smoke` runs the first few cases only; the full sweep is opt-in (minutes: one process a case).

    PYTHONPATH=src python benchmarks/cli_sweep.py [--smoke] [--only PREFIX] [--timeout S]
"""

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import bench_env

DEMO_BASE = Path(__file__).resolve().parents[1] / "src" / "moetune" / "demo" / "base_model"


@dataclass(frozen=True)
class Case:
    name: str
    args: list[str]  # after `moetune`; {dir} is the case's scratch dir
    files: dict[str, str]  # scratch-dir file name -> text written before the run


def _yaml_cases() -> list[Case]:
    texts = {
        "empty": "",
        "list": "- a\n- b\n",
        "unclosed": "model: [\n",
        "tab-indent": "model:\n\tid: x\n",
        "duplicate-key": f"model: {{id: {DEMO_BASE}}}\nmodel: {{id: {DEMO_BASE}}}\n",
        "scalar-section": "model: 3\n",
        "unknown-section": f"model: {{id: {DEMO_BASE}}}\nbogus: 1\n",
        "unknown-field": f"model: {{id: {DEMO_BASE}, bogus: 1}}\n",
        "binary": "\x00\x01\x02",
        "huge-int": f"model: {{id: {DEMO_BASE}}}\nlora: {{rank: {10**30}}}\n",
        "nan-lr": f"model: {{id: {DEMO_BASE}}}\ntrain: {{learning_rate: .nan}}\n",
        "inf-lr": f"model: {{id: {DEMO_BASE}}}\ntrain: {{learning_rate: .inf}}\n",
        "missing-model": "train: {batch_size: 2}\n",
        "model-dir-missing": "model: {id: /nonexistent/model}\n",
        "model-is-file": "model: {id: /etc/hostname}\n",
    }
    return [
        Case(f"yaml/{cmd}/{name}", [cmd, "{dir}/run.yaml", "--json"], {"run.yaml": text})
        for name, text in texts.items()
        for cmd in ("recipe", "lint")
    ]


def _flag_cases() -> list[Case]:
    run = {"run.yaml": f"model: {{id: {DEMO_BASE}}}\n"}
    flags = [
        ["--rank", "0"], ["--rank", "x"], ["--rank", "-3"], ["--seq", "0"], ["--batch", "-1"],
        ["--method", "ppo"], ["--targets", "bogus"], ["--targets", ","], ["--stack", "jax"],
        ["--engine", "warp"], ["--experts-dtype", "int3"], ["--nproc", "0"],
        ["--set", "lora.rank"], ["--set", "nope.x=1"], ["--set", "lora.rank=[1"],
    ]  # fmt: skip
    cases = [
        Case(f"flag/{cmd}/{'='.join(f)}", [cmd, "{dir}/run.yaml", *f, "--json"], run)
        for cmd in ("recipe", "plan")
        for f in flags
        if not (cmd == "recipe" and f[0] in ("--nproc",))
    ]
    quick = [["--steps", "0"], ["--steps", "x"], ["--method", "ppo"], ["--seed", "-1"],
             ["--seed", "x"], ["--stack", "jax"]]  # fmt: skip
    cases += [
        Case(f"flag/quickstart/{'='.join(f)}", ["quickstart", *f, "--json"], {}) for f in quick
    ]
    return cases


def _path_cases() -> list[Case]:
    paths = ["/nonexistent.yaml", "/tmp", "/dev/null", "{dir}/link.yaml", "{dir}/ro/run.yaml"]
    cases = [
        Case(f"path/{cmd}/{p}", [cmd, p, "--json"], {})
        for cmd in ("plan", "lint", "eval")
        for p in paths
    ]
    for fmt in ("merged", "gguf", "vllm", "mlx"):
        for src in ("/nonexistent", "{dir}", "/dev/null"):
            args = ["export", src, "--format", fmt, "--out", "{dir}/out", "--json"]
            cases.append(Case(f"path/export/{fmt}/{src}", args, {}))
    return cases


def _data_cases() -> list[Case]:
    rows = {
        "missing": None,
        "empty": "",
        "not-json": "hello\n",
        "no-fields": '{"x": 1}\n',
        "empty-completion": '{"prompt": "a", "completion": ""}\n',
        "number-prompt": '{"prompt": 3, "completion": "b"}\n',
        "array": "[1, 2]\n",
    }
    cases = []
    for name, text in rows.items():
        yaml = f"model: {{id: {DEMO_BASE}}}\ndata: {{train_file: {{dir}}/train.jsonl}}\n"
        files = {"run.yaml": yaml} | ({} if text is None else {"train.jsonl": text})
        cases.append(Case(f"data/lint/{name}", ["lint", "{dir}/run.yaml", "--json"], files))
    return cases


def _fuzz_cases(n: int, seed: int = 0) -> list[Case]:
    """Random fields of `moetune schema` set to values of the wrong kind."""
    # the schema's field list, from the package itself (no subprocess per field)
    from moetune.config import schema_rows

    fields = [f for f, _, _ in schema_rows() if "." in f and f.count(".") == 1]
    values = ["x", -1, 0, 1e309, [], {}, None, True, "../../etc", "9" * 40]
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        section, leaf = rng.choice(fields).split(".")
        value = rng.choice(values)
        doc = {"model": {"id": str(DEMO_BASE)}, section: {leaf: value}}
        if section == "model":
            doc["model"] = {"id": str(DEMO_BASE), leaf: value}
        text = json.dumps(doc).replace("Infinity", "1e309")
        cases.append(
            Case(
                f"fuzz/{i}/{section}.{leaf}={value!r}"[:90],
                ["recipe", "{dir}/run.yaml", "--json"],
                {"run.yaml": text},
            )
        )
    return cases


def all_cases(fuzz: int) -> list[Case]:
    return [*_yaml_cases(), *_flag_cases(), *_path_cases(), *_data_cases(), *_fuzz_cases(fuzz)]


def classify(code: int, stderr: str) -> str:
    """ok / refused / BAD (see the module doc); a refusal must say something."""
    if code == 3 or "Traceback" in stderr or "error: unexpected" in stderr:
        return "BAD"
    if code == 0:
        return "ok"
    if code in (1, 2) and stderr.strip():
        return "refused"
    return "BAD"


def run_case(case: Case, timeout: float) -> tuple[str, int, str]:
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
        for name, text in case.files.items():
            Path(tmp, name).write_text(text.replace("{dir}", tmp))
        Path(tmp, "link.yaml").symlink_to(Path(tmp, "loop.yaml"))
        Path(tmp, "loop.yaml").symlink_to(Path(tmp, "link.yaml"))
        args = [a.replace("{dir}", tmp) for a in case.args]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}
        try:
            done = subprocess.run(
                [sys.executable, "-m", "moetune", *args], capture_output=True, text=True,
                timeout=timeout, env=env, cwd=tmp, check=False,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return "BAD", -1, f"timeout after {timeout:g} s"
    last = (done.stderr.strip().splitlines() or [""])[-1]
    return classify(done.returncode, done.stderr), done.returncode, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="the first 4 cases only")
    parser.add_argument("--only", default="", help="cases whose name starts with this")
    parser.add_argument("--fuzz", type=int, default=60, help="fuzzed configs")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--threads", type=int, default=bench_env.DEFAULT_THREADS)
    opts = parser.parse_args()
    cases = [c for c in all_cases(opts.fuzz) if c.name.startswith(opts.only)]
    cases = cases[:4] if opts.smoke else cases
    counts: dict[str, int] = {}
    bad = []
    for case in cases:
        verdict, code, last = run_case(case, opts.timeout)
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict == "BAD":
            bad.append(f"BAD {case.name}: exit {code}: {last[:160]}")
        print(f"{verdict:8} {code:3} {case.name}", flush=True)
    print(*bad, sep="\n")
    print(f"cases: {len(cases)} · " + " · ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
