"""The cases of benchmarks/cli_sweep.py: hostile-but-fair inputs a user could type, each a
`moetune` command line, the files it needs, and what a careful CLI must do with it.

`expect` is "bad" where the input is wrong (exit 0 is then a BAD case: it was accepted),
"good" where it is a legal input (a refusal is WEAK), "any" where either is defensible
(fuzzed values that may happen to be legal). {dir} is the case's scratch dir, {shared}
the one tiny run dir (demo base + a random adapter) built once for all cases; a case's
files may lie in subfolders ("base/config.json") and its `env` is set for it alone.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

DEMO_BASE = Path(__file__).resolve().parents[1] / "src" / "moetune" / "demo" / "base_model"
RUN = f"model: {{id: {DEMO_BASE}}}\n"
# Planted under innocuous names and under a known one: none may appear in anything moetune
# prints or writes (issue 26: secrets by value, not only by name).
SECRETS = ("zq-sweep-secret-7f3a", "zq-sweep-value-91c2", "hf_sweepTOKENa1b2c3d4e5f6g7h8",
           "4242424242427", "zq-sweep-listed-5e")  # fmt: skip
SECRET_ENV = {"HF_TOKEN": SECRETS[2]}
LANE = f"lane: {{provider: runpod, env: {{DB_PASS: {SECRETS[0]}, MY_STUFF: {SECRETS[1]}}}}}\n"


@dataclass(frozen=True)
class Case:
    name: str
    args: list[str]  # after `moetune`
    files: dict[str, str | bytes] = field(default_factory=dict)  # scratch name -> content
    expect: str = "bad"  # bad | good | any (see the module doc)
    env: dict[str, str] = field(default_factory=dict)  # set for this case only ({dir} too)


def _yaml_cases() -> list[Case]:
    texts = {
        "empty": "",
        "list": "- a\n- b\n",
        "unclosed": "model: [\n",
        "tab-indent": "model:\n\tid: x\n",
        "duplicate-key": RUN + RUN,
        "scalar-section": "model: 3\n",
        "unknown-section": RUN + "bogus: 1\n",
        "unknown-field": f"model: {{id: {DEMO_BASE}, bogus: 1}}\n",
        "binary": "\x00\x01\x02",
        "huge-int": RUN + f"lora: {{rank: {10**30}}}\n",
        "nan-lr": RUN + "train: {learning_rate: .nan}\n",
        "inf-lr": RUN + "train: {learning_rate: .inf}\n",
        "missing-model": "train: {batch_size: 2}\n",
        "model-dir-missing": "model: {id: /nonexistent/model}\n",
        "model-is-file": "model: {id: /etc/hostname}\n",
        "alias-bomb": "a: &a [x,x,x,x,x,x,x,x,x]\n"
        + "".join(
            f"{c}: &{c} [{','.join(['*' + p] * 9)}]\n"
            for p, c in zip("abcdefgh", "bcdefghi", strict=False)
        )
        + "model: *i\n",
        "python-tag": "model: !!python/object/apply:os.system ['echo pwned']\n",
        "deep-nesting": "model: " + "[" * 5000 + "]" * 5000 + "\n",
        "bom-utf16": RUN.encode("utf-16").decode("latin-1"),
        "rtl-override": f'model: {{id: "{DEMO_BASE}\u202e"}}\n',
        "anchor-merge": f"x: &x {{id: {DEMO_BASE}}}\nmodel: {{<<: *x, dtype: float99}}\n",
    }
    legal = {"missing-model": "any"}  # model.id has a default (the catalog's Qwen3-30B-A3B)
    return [
        Case(
            f"yaml/{cmd}/{name}",
            [cmd, "{dir}/run.yaml", "--json"],
            {"run.yaml": text},
            legal.get(name, "bad"),
        )
        for name, text in texts.items()
        for cmd in ("recipe", "lint")
    ]


def _flag_cases() -> list[Case]:
    run = {"run.yaml": RUN}
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
    cases += [Case(f"flag/quickstart/{'='.join(f)}", ["quickstart", *f, "--json"]) for f in quick]
    return cases


# Every numeric flag of every command: light commands get every value, heavy ones (they
# train or export when a value is accepted) only values that must be refused.
NUMERIC_LIGHT = {
    ("plan", "{dir}/run.yaml"): ["--rank", "--seq", "--batch", "--gpus", "--nodes", "--host-ram"],
    ("recipe", "{dir}/run.yaml"): ["--rank"],
    ("serve-plan", str(DEMO_BASE)): [
        "--ctx", "--max-model-len", "--max-loras", "--max-lora-rank",
        "--gpu-memory-utilization", "--tp",
    ],
    ("gate", "{dir}/results.json"): ["--alpha"],
}  # fmt: skip
NUMERIC_HEAVY = {
    ("train", "{dir}/run.yaml"): ["--nproc", "--nnodes", "--node-rank", "--master-port"],
    ("quickstart",): ["--steps", "--seed"],
    ("eval", "{shared}/config.yaml"): ["--limit"],
    ("export", "{shared}", "--format", "merged", "--out", "{dir}/out"): ["--limit"],
    ("bench", "gm1"): ["--seeds", "--steps", "--tokens"],
}
NUMBERS = {
    "neg": ("-5", "bad"),
    "huge": ("9" * 30, "bad"),
    "inf": ("1e400", "bad"),
    "nan": ("nan", "bad"),
    "empty": ("", "bad"),
    "zero": ("0", "any"),
    "arabic-digit": ("\u0663", "any"),  # Python's int() reads it as 3
    "fullwidth": ("\uff13", "any"),
    "frac": ("2.5", "any"),
}
HEAVY_NUMBERS = ("neg", "huge", "inf", "nan", "empty")
# where a flag's "bad" values are legal (a seed may be any integer >= 0 …)
NUMERIC_OK = {
    ("--seed", "huge"): "any",
    ("--ctx", "huge"): "any",
    ("--limit", "huge"): "any",
}  # a limit above the items takes them all


def _numeric_cases() -> list[Case]:
    files = {"run.yaml": RUN, "results.json": "{}"}
    cases = []
    for table, names in ((NUMERIC_LIGHT, list(NUMBERS)), (NUMERIC_HEAVY, HEAVY_NUMBERS)):
        for head, flags in table.items():
            for flag in flags:
                for name in names:
                    value, expect = NUMBERS[name]
                    expect = NUMERIC_OK.get((flag, name), expect)
                    args = [*head, f"{flag}={value}", "--json"]
                    cases.append(Case(f"num/{head[0]}/{flag}/{name}", args, files, expect))
    return cases


def _path_cases() -> list[Case]:
    paths = ["/nonexistent.yaml", "/tmp", "/dev/null", "{dir}/link.yaml", "{dir}/ro/run.yaml"]
    cases = [
        Case(f"path/{cmd}/{p}", [cmd, p, "--json"])
        for cmd in ("plan", "lint", "eval")
        for p in paths
    ]
    for fmt in ("merged", "gguf", "vllm", "mlx"):
        for src in ("/nonexistent", "{dir}", "/dev/null"):
            args = ["export", src, "--format", fmt, "--out", "{dir}/out", "--json"]
            cases.append(Case(f"path/export/{fmt}/{src}", args))
    return cases


def _data_cases(seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    rows: dict[str, str | bytes | None] = {
        "missing": None,
        "empty": "",
        "not-json": "hello\n",
        "no-fields": '{"x": 1}\n',
        "empty-completion": '{"prompt": "a", "completion": ""}\n',
        "number-prompt": '{"prompt": 3, "completion": "b"}\n',
        "array": "[1, 2]\n",
        "random-bytes": rng.randbytes(4096),
        "nul-in-row": '{"prompt": "a\\u0000", "completion": "b"}\n' + "\x00" * 10,
        "torn-last-row": '{"prompt": "a", "completion": "b"}\n{"prompt": "a", "compl',
    }
    cases = []
    for name, text in rows.items():
        yaml = RUN + "data: {train_file: {dir}/train.jsonl}\n"
        files: dict[str, str | bytes] = {"run.yaml": yaml}
        files |= {} if text is None else {"train.jsonl": text}
        for cmd in ("lint", "data"):
            expect = "any" if cmd == "lint" else "bad"  # lint may only warn about data
            cases.append(
                Case(f"data/{cmd}/{name}", [cmd, "{dir}/run.yaml", "--json"], files, expect)
            )
    for ext in ("parquet", "csv", "json.gz", "arrow"):  # random bytes under a known suffix
        yaml = RUN + f"data: {{train_file: {{dir}}/train.{ext}}}\n"
        files = {"run.yaml": yaml, f"train.{ext}": rng.randbytes(2048)}
        cases.append(Case(f"data/data/random.{ext}", ["data", "{dir}/run.yaml", "--json"], files))
    cases.append(Case("data/data/a-directory", ["data", "{dir}/run.yaml", "--json"],
                      {"run.yaml": RUN + "data: {train_file: {dir}}\n"}))  # fmt: skip
    return cases


def _secret_cases() -> list[Case]:
    """lane.env values under innocuous names, the token in the environment: every command
    that shows or writes the config (the runner greps every byte for the values)."""
    files = {"run.yaml": RUN + LANE}
    commands = {
        "launch-dry": ["launch", "{dir}/run.yaml", "--dry-run"],
        "launch-dry-json": ["launch", "{dir}/run.yaml", "--dry-run", "--json"],
        "sky-task": ["sky-task", "{dir}/run.yaml", "--set", "lane.provider=skypilot", "--json"],
        "workflow": ["workflow", "github", "{dir}/run.yaml", "--json"],
        "workflow-out": ["workflow", "github", "{dir}/run.yaml", "--out", "{dir}/wf.yml"],
        "lint": ["lint", "{dir}/run.yaml", "--json"],
        "plan": ["plan", "{dir}/run.yaml", "--json"],
    }
    cases = [Case(f"secret/{n}", args, files, "good") for n, args in commands.items()]
    bad = {"run.yaml": RUN + LANE.replace("provider: runpod", "provider: nowhere")}
    cases.append(Case("secret/bad-provider", ["launch", "{dir}/run.yaml", "--dry-run"], bad))
    return cases


def _misc_cases() -> list[Case]:
    """Commands the first sweep did not reach: ledger, gate, report, inspect, serve-plan."""
    torn = '{"run_id": "a", "status": "ok"}\n{"run_id": "b", "sta'
    return [
        Case("misc/ledger/status-weird", ["ledger", "show", "--status", "weird", "--json"]),
        Case(
            "misc/ledger/torn",
            ["ledger", "show", "--path", "{dir}/l.jsonl", "--json"],
            {"l.jsonl": torn},
            "any",
        ),
        Case(
            "misc/ledger/random-bytes",
            ["ledger", "verify", "--path", "{dir}/l.jsonl"],
            {"l.jsonl": random.Random(3).randbytes(512)},
        ),
        Case("misc/gate/empty-json", ["gate", "{dir}/r.json", "--json"], {"r.json": "{}"}),
        Case("misc/gate/not-json", ["gate", "{dir}/r.json", "--json"], {"r.json": "nope"}),
        Case("misc/gate/nan", ["gate", "{dir}/r.json", "--json"], {"r.json": '{"rungs": NaN}'}),
        Case("misc/report/missing", ["report", "/nonexistent/run", "--json"]),
        Case("misc/report/empty-dir", ["report", "{dir}", "--json"]),
        Case("misc/inspect/missing", ["inspect", "/nonexistent/model", "--json"]),
        Case("misc/inspect/empty-config", ["inspect", "{dir}", "--json"], {"config.json": "{}"}),
        Case("misc/inspect/config-list", ["inspect", "{dir}", "--json"], {"config.json": "[]"}),
        Case("misc/inspect/demo", ["inspect", str(DEMO_BASE), "--json"], {}, "good"),
        Case("misc/serve-plan/rank-3", ["serve-plan", str(DEMO_BASE), "--max-lora-rank", "3"]),
        Case("misc/pods/reap-unknown", ["pods", "reap", "nope", "--json"], {}, "any"),
        Case("misc/schema", ["schema", "--json"], {}, "good"),
        Case(
            "misc/export/layout",
            [
                "export",
                "{shared}",
                "--format",
                "vllm",
                "--vllm-layout",
                "sideways",
                "--out",
                "{dir}/out",
                "--json",
            ],
        ),
        Case(
            "misc/export/shard",
            [
                "export",
                "{shared}",
                "--format",
                "merged",
                "--max-shard-size",
                "lots",
                "--out",
                "{dir}/out",
            ],
        ),
        Case(
            "misc/export/out-is-file",
            ["export", "{shared}", "--format", "merged", "--out", "{dir}/f", "--json"],
            {"f": "x"},
        ),
    ]


# lane.env values YAML reads as a number and a list (issue 36 item 5): never shown
def _fuzz_cases(n: int, seed: int = 0) -> list[Case]:
    """Random fields of `moetune schema` set to values of the wrong kind."""
    # the schema's field list, from the package itself (no subprocess per field)
    from moetune.config import schema_rows

    fields = [f for f, _, _ in schema_rows() if "." in f and f.count(".") == 1]
    values = ["x", -1, 0, 1e309, [], {}, None, True, "../../etc", "9" * 40, "\u0663", -(10**20)]
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        section, leaf = rng.choice(fields).split(".")
        value = rng.choice(values)
        doc = {"model": {"id": str(DEMO_BASE)}, section: {leaf: value}}
        if section == "model":
            doc["model"] = {"id": str(DEMO_BASE), leaf: value}
        text = json.dumps(doc).replace("Infinity", "1e309")
        name = f"fuzz/{i}/{section}.{leaf}={value!r}"[:90]
        cases.append(Case(name, ["recipe", "{dir}/run.yaml", "--json"], {"run.yaml": text}, "any"))
    return cases


GARBLE = ["1e999", "-0", "0x1F", "~", "'open", "\u202e", "\U0001d7d8", "x" * 5000, "[", "}",
          "-1e-400", "!!binary AAAA", "2026-12-02", "yes", "&", "*nope", "\t", "NaN"]  # fmt: skip


def _garbled_cases(n: int, seed: int = 1) -> list[Case]:
    """A realistic run.yaml with one scalar replaced by garbage (YAML-level fuzzing)."""
    base = (
        f"model:\n  id: {DEMO_BASE}\n  dtype: float32\nlora:\n  rank: 8\n  alpha: 16\n"
        "train:\n  batch_size: 2\n  seq_len: 64\n  learning_rate: 0.0002\n  max_steps: 2\n"
        "data:\n  max_rows: 10\n"
    )
    lines = base.splitlines()
    scalars = [i for i, line in enumerate(lines) if ": " in line]
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        at, junk = rng.choice(scalars), rng.choice(GARBLE)
        text = list(lines)
        text[at] = text[at].split(": ")[0] + ": " + junk
        key = lines[at].split(":")[0].strip()
        files = {"run.yaml": "\n".join(text) + "\n"}
        cmd = rng.choice(("lint", "recipe", "plan"))
        name = f"garble/{i}/{cmd}/{key}={junk[:12]!r}"
        cases.append(Case(name, [cmd, "{dir}/run.yaml", "--json"], files, "any"))
    return cases


def all_cases(fuzz: int, garble: int) -> list[Case]:
    return [
        *_yaml_cases(), *_flag_cases(), *_path_cases(), *_data_cases(), *_numeric_cases(),
        *_secret_cases(), *_misc_cases(), *_fuzz_cases(fuzz), *_garbled_cases(garble),
    ]  # fmt: skip


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def classify(case: Case, code: int | None, out: str, err: str) -> tuple[str, str]:
    """(OK | WEAK | BAD, why) – see the module doc."""
    lines = [line for line in err.splitlines() if line.strip()]
    usage = "Try 'moetune" in err and "--help' for help" in err  # click's own usage error
    if code is None:
        return "BAD", "timeout"
    if code == 3 or "Traceback" in err or "Traceback" in out or "error: unexpected" in err:
        return "BAD", f"exit {code}: unexpected"
    if code not in (0, 1, 2):
        return "BAD", f"exit {code}"
    if code == 0:
        if case.expect == "bad":
            return "BAD", "exit 0 on bad input"
        if "--json" in case.args and not _is_json(out):
            return "WEAK", "--json printed no JSON"
        return "OK", ""
    if code == 1 and not lines and _is_json(out) and "fix" in out:
        return "OK", ""  # a check that failed, reported (lint, gate) with its fixes
    if code == 1 and lines and all(line.startswith("fix:") for line in lines):
        return "OK", ""  # a check that failed (ledger verify): its report, then what to do
    if not usage and "fix" not in err.lower():
        return "BAD", "refused without a fix"
    if case.expect == "good":
        return "WEAK", "a legal input refused"
    errors = [line for line in lines if line.startswith("error:")]
    if not usage and len(errors) != 1:
        return "WEAK", f"{len(lines)} lines of error"
    return "OK", ""
