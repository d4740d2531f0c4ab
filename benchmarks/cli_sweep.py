"""Hostile-but-fair CLI sweep: bad YAML, bad flags, every numeric flag fuzzed, bad data and
random bytes, bad paths, planted secrets and fuzzed run configs (benchmarks/sweep_cases.py),
each a `moetune` process in its own scratch dir, each outcome classified.

    OK    a bad input refused (exit 1 or 2) with one line naming the cause and a fix, or a
          legal input accepted (exit 0)
    WEAK  a legal input refused, a refusal of more than one line, --json output that is
          not JSON
    BAD   exit 3 ("unexpected …"), a traceback, a timeout, any other exit, exit 0 on an
          input that must be refused, a refusal without a fix, a planted secret in any byte
          moetune printed or wrote, a temp file left behind (something half-written)

Each case runs in a process forked from one that imported moetune and torch once (a
`--subprocess` run starts `python -m moetune` per case instead: the same verdicts, ~3 s
more each). Prints a line per case, then every WEAK and BAD case and the counts.

    PYTHONPATH=src python benchmarks/cli_sweep.py [--smoke] [--only PREFIX] [--timeout S]
"""

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_env

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_cases import DEMO_BASE, SECRET_ENV, SECRETS, Case, all_cases, classify
from sweep_fresh import fresh_cases

ENV = {"HF_HUB_OFFLINE": "1", "COLUMNS": "200", "NO_COLOR": "1", **SECRET_ENV}
TEMP = re.compile(r"(\.tmp$|\.tmp\.|\.partial$|^tmp[-_.])")  # io.atomic_write's and others'


def build_shared(root: Path) -> Path:
    """The one tiny run dir every export / eval case reads: the demo base, a peft adapter on
    attention with random (seeded) B matrices, its config.yaml and eval items."""
    # lazy: heavy to import (torch, peft, transformers), and only when the sweep starts
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

    from moetune.config import dump_config, parse_config

    run = root / "shared-run"
    model = transformers.AutoModelForCausalLM.from_pretrained(str(DEMO_BASE), dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft.save_pretrained(str(run / "adapter"))
    items = root / "eval.jsonl"
    prompts = ["copy:abc>", "rev:hello>", "first:xyz>", "sum:123>"]
    items.write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in prompts))
    doc = {
        "model": {"id": str(DEMO_BASE), "dtype": "float32"},
        "output": {"dir": str(run), "ledger": str(root / "ledger.jsonl")},
        "eval": {"rungs": [{"name": "skills", "kind": "exact_match", "data": str(items)}]},
    }
    (run / "config.yaml").write_text(dump_config(parse_config(doc)))
    return run


def _prepare(case: Case, tmp: str, shared: str) -> list[str]:
    for name, content in case.files.items():
        # "base/config.json", a source dir's files
        Path(tmp, name).parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            Path(tmp, name).write_bytes(content)
        else:
            Path(tmp, name).write_text(content.replace("{dir}", tmp), encoding="utf-8")
    Path(tmp, "link.yaml").symlink_to(Path(tmp, "loop.yaml"))
    Path(tmp, "loop.yaml").symlink_to(Path(tmp, "link.yaml"))
    Path(tmp, "ro").mkdir()
    Path(tmp, "ro").chmod(0o500)
    return [a.replace("{dir}", tmp).replace("{shared}", shared) for a in case.args]


def _child(args: list[str], tmp: str, out: str, err: str, env: dict[str, str]) -> None:
    """The forked case: its own process group (a rank it starts dies with it), cwd, fds and
    the case's own environment variables."""
    code = 0
    try:
        os.setpgid(0, 0)
        os.chdir(tmp)
        os.environ.update(env)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
        from moetune.cli import app

        app(args=args, prog_name="moetune")
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 99
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, timeout: float) -> int | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    return None


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _run(
    args: list[str], tmp: str, logs: str, timeout: float, fork: bool, env: dict[str, str]
) -> int | None:
    out, err = os.path.join(logs, "stdout"), os.path.join(logs, "stderr")
    if not fork:
        with open(out, "wb") as fo, open(err, "wb") as fe:
            try:
                cmd = [sys.executable, "-m", "moetune", *args]
                done = subprocess.run(
                    cmd, stdout=fo, stderr=fe, cwd=tmp, timeout=timeout, env={**os.environ, **env}
                )
            except subprocess.TimeoutExpired:
                return None
        return done.returncode
    pid = os.fork()
    if pid == 0:
        _child(args, tmp, out, err, env)
    code = _wait(pid, timeout)
    _kill_group(pid)  # a timeout, or ranks and helpers it left behind
    if code is None:
        os.waitpid(pid, 0)
    return code


def _leaks(texts: list[bytes], tmp: str, case: Case) -> list[str]:
    """Planted secrets in what the case printed, and in every file it wrote."""
    found = [f"output holds {s[:8]}…" for s in SECRETS for t in texts if s.encode() in t]
    for path in Path(tmp).rglob("*"):
        if path.is_file() and not path.is_symlink() and path.name not in case.files:
            data = path.read_bytes()
            found += [f"{path.name} holds {s[:8]}…" for s in SECRETS if s.encode() in data]
    return found


def _leftovers(tmp: str) -> list[str]:
    return [p.name for p in Path(tmp).rglob("*") if TEMP.search(p.name)]


def run_case(
    case: Case, timeout: float, shared: str, fork: bool
) -> tuple[str, str, int | None, str]:
    with tempfile.TemporaryDirectory(prefix="sweep-") as tmp, tempfile.TemporaryDirectory() as logs:
        args = _prepare(case, tmp, shared)
        env = {k: v.replace("{dir}", tmp) for k, v in case.env.items()}
        code = _run(args, tmp, logs, timeout, fork, env)
        out_b, err_b = (
            Path(logs, n).read_bytes() if Path(logs, n).exists() else b""
            for n in ("stdout", "stderr")
        )
        out, err = out_b.decode(errors="replace"), err_b.decode(errors="replace")
        verdict, why = classify(case, code, out, err)
        bad = _leaks([out_b, err_b], tmp, case) + [f"left {n}" for n in _leftovers(tmp)]
        Path(tmp, "ro").chmod(0o700)
    if bad:
        verdict, why = "BAD", "; ".join(bad)
    last = (err.strip().splitlines() or [""])[-1]
    return verdict, why, code, last


# What the commands import lazily, imported once before the forks (no torch op runs here:
# a fork after OpenMP started can hang).
PRELOAD = ("moetune.cli", "moetune.model", "moetune.data", "moetune.recipe", "moetune.plan",
           "moetune.lint", "moetune.train", "moetune.evaluate", "moetune.export",
           "moetune.report", "moetune.lane", "peft", "trl")  # fmt: skip


def _preload() -> None:
    # lazy: heavy to import (torch, transformers, every stage), once, only for forked runs
    import importlib

    import transformers

    for name in PRELOAD:
        importlib.import_module(name)
    config = transformers.AutoConfig.from_pretrained(str(DEMO_BASE))
    transformers.AutoModelForCausalLM._model_mapping[type(config)]  # the demo's class


def _shared_in_child(root: str) -> str:
    """build_shared in a process of its own, so this one forks before torch computes."""
    cmd = [sys.executable, __file__, "--build-shared", root]
    subprocess.run(cmd, check=True, env={**os.environ, **ENV})
    return str(Path(root, "shared-run"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="the first 4 cases only")
    parser.add_argument(
        "--only", default="", help="cases whose name starts with this (a comma list)"
    )
    parser.add_argument("--fuzz", type=int, default=60, help="fuzzed configs")
    parser.add_argument("--garble", type=int, default=30, help="garbled run.yaml files")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--subprocess", action="store_true", help="python -m moetune per case")
    parser.add_argument("--threads", type=int, default=bench_env.DEFAULT_THREADS)
    parser.add_argument("--build-shared", default="", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.build_shared:
        build_shared(Path(opts.build_shared))
        return
    prefixes = tuple(opts.only.split(","))
    every = [*all_cases(opts.fuzz, opts.garble), *fresh_cases()]
    cases = [c for c in every if c.name.startswith(prefixes)]
    cases = cases[:4] if opts.smoke else cases
    os.environ.update(ENV)
    with tempfile.TemporaryDirectory(prefix="sweep-shared-") as root:
        needs_run = any("{shared}" in a for c in cases for a in c.args)
        shared = _shared_in_child(root) if needs_run else "/nonexistent-shared-run"
        if not opts.subprocess:
            _preload()

        start = time.monotonic()
        report(cases, opts, shared)
        print(f"wall: {time.monotonic() - start:.0f} s")


def report(cases: list[Case], opts: argparse.Namespace, shared: str) -> None:
    counts: dict[str, int] = {}
    flagged = []
    for case in cases:
        began = time.monotonic()
        verdict, why, code, last = run_case(case, opts.timeout, shared, not opts.subprocess)
        counts[verdict] = counts.get(verdict, 0) + 1
        if verdict != "OK":
            flagged.append(f"{verdict} {case.name}: {why}: {last[:160]}")
        took = time.monotonic() - began
        print(
            f"{verdict:5} {code if code is not None else '-':>3} {took:5.1f}s {case.name}",
            flush=True,
        )
    print(*flagged, sep="\n")
    print(f"cases: {len(cases)} · " + " · ".join(f"{k} {v}" for k, v in sorted(counts.items())))


if __name__ == "__main__":
    main()
