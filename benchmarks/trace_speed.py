"""How fast and how lean is the fake-tensor trace of a full training step?

Traces one step of Qwen3-30B-A3B and Qwen3-235B-A22B (vanilla peft LoRA r=16 on attention
and auto-mapped experts, seq 1024, batch 1, gradient checkpointing on), each in its own
process so max RSS is per model; `--record` appends a dated line to
benchmarks/results/trace-and-planner.md.

    python benchmarks/trace_speed.py [--json] [--models 30b,235b] [--seq 1024] [--record]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import bench_env

RESULTS = bench_env.results_page("trace-and-planner")

# The bundled catalog's config.json (moetune.model) is the one source of these models.
MODELS: dict[str, str] = {"30b": "Qwen/Qwen3-30B-A3B", "235b": "Qwen/Qwen3-235B-A22B"}
# --smoke: the shipped demo base (a tiny qwen3_moe), found without importing moetune.demo
MODELS["demo"] = str(Path(__file__).resolve().parents[1] / "src/moetune/demo/base_model")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def trace_one(key: str, seq_len: int) -> dict[str, Any]:
    """Run one trace in this process and measure it."""
    from peft import LoraConfig

    from moetune.model import load_spec, to_hf_config
    from moetune.plan.trace.fake_step import trace_step

    config = to_hf_config(load_spec(MODELS[key]))
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS)
    cpu = time.process_time()
    result = trace_step(config, lora, seq_len=seq_len)
    return {
        "model": MODELS[key].split("/")[-1],
        "seq_len": seq_len,
        "seconds": round(result.seconds, 1),
        "cpu_seconds": round(time.process_time() - cpu, 1),
        "peak_gib": round(result.peak_bytes / 2**30, 2),
        "peak_op": result.peak_op,
        "peak_phase": result.peak_phase,
        "trainable_params": result.trainable_params,
        "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
    }


def run_isolated(key: str, seq_len: int) -> dict[str, Any]:
    """Trace in a child process, so each model's max RSS is its own."""
    cmd = [sys.executable, __file__, "--child", key, "--seq", str(seq_len),
           "--threads", str(bench_env.THREADS)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"trace of {key} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> str:
    import torch

    cores = os.cpu_count()
    load = os.getloadavg()[0]  # wall seconds stretch when the cores are shared
    return (f"{platform.machine()}, {cores} cores, torch {torch.__version__}, load {load:.1f}, "
            f"{bench_env.describe()}")  # fmt: skip


def record(rows: list[dict[str, Any]]) -> None:
    """Append one dated line per model to its results page."""
    today = datetime.date.today().isoformat()
    lines = [
        f"- {today} trace_speed: {r['model']} LoRA r16 seq {r['seq_len']} gc on: "
        f"{r['seconds']} s ({r['cpu_seconds']} s CPU), peak {r['peak_gib']} GiB at "
        f"{r['peak_op']} ({r['peak_phase']}), max RSS {r['max_rss_gib']} GiB [{machine()}]\n"
        for r in rows
    ]
    text = RESULTS.read_text() if RESULTS.exists() else bench_env.RESULTS_HEADER
    bench_env.write_results(RESULTS, text + "".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--models", default="30b,235b", help="comma-separated: 30b, 235b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument(
        "--record", action="store_true", help="append to results/trace-and-planner.md"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument(
        "--smoke", action="store_true", help="the demo base at seq 64; never records"
    )
    bench_env.add_argument(parser)
    args = parser.parse_args()
    if args.smoke:
        args.models, args.seq, args.record = "demo", 64, False
    if args.child:
        bench_env.apply()
        print(json.dumps(trace_one(args.child, args.seq)))
        return
    rows = [run_isolated(key, args.seq) for key in args.models.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            print(
                f"{r['model']:>16}  {r['seconds']:6.1f} s  ({r['cpu_seconds']:.1f} s CPU)  "
                f"peak {r['peak_gib']:7.2f} GiB  at {r['peak_op']} ({r['peak_phase']})  "
                f"RSS {r['max_rss_gib']:.2f} GiB"
            )
    if args.record:
        record(rows)


if __name__ == "__main__":
    main()
