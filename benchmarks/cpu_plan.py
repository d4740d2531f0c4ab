"""The plan's CPU card against `moetune train` on this host: peak RSS and step time of a
disk-offloaded run, planned from `moetune doctor --calibrate`'s rates and measured.

As a user would, in subprocesses: `moetune doctor --calibrate --file <a shard of the
checkpoint>` (the disk the run reads; stored in a temp host.json unless --host-file names
one), a run.yaml (train.offload disk, fp32 compute on the CPU, LoRA r --rank on attention
and experts, batch 1 × --seq tokens, checkpointing off, --steps steps, no routing passes),
`moetune plan run.yaml --card cpu --json` and `moetune train run.yaml --json` with its RSS
sampled every 20 ms (stored_offload.Peak). Side by side: peak RSS, the mean step
(train's loop seconds / steps: the first step's warm-up included) and bytes read per step.

The model: --model DIR (a bf16 checkpoint with a tokenizer, e.g. one offload_disk.py
wrote), else a random Qwen3-MoE of --layers × --experts (hidden --hidden, expert
--moe, vocab --vocab) with the demo tokenizer, written to a temp dir and removed.

`--smoke`: a 4-layer hidden-16 model, a 4 MiB disk probe, one step, seconds (the test
suite runs it; nothing recorded). `--record` appends to results/offload-and-stored.md.

    python benchmarks/cpu_plan.py [--model DIR] [--layers 4] [--experts 128] [--hidden 1024]
        [--moe 768] [--vocab 4096] [--steps 3] [--seq 32] [--rank 4] [--threads N]
        [--host-file F] [--smoke] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bench_env
import torch

# Siblings: `python benchmarks/cpu_plan.py` puts benchmarks/ first on sys.path.
from stored_offload import Peak

GiB = 2**30
SRC = Path(__file__).resolve().parents[1] / "src"
RESULTS = bench_env.results_page("offload-and-stored")
HEAD = "## cpu_plan: the plan's CPU card vs `moetune train` (disk offload, this host)"


def _env(host_file: Path) -> dict[str, str]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1",
            "MOETUNE_HOST_FILE": str(host_file)}  # fmt: skip


def moetune(args: list[str], host_file: Path) -> dict[str, Any]:
    """`moetune <args> --json`'s document (exits with its stderr on failure)."""
    cmd = [sys.executable, "-m", "moetune", *args, "--json"]
    done = subprocess.run(cmd, env=_env(host_file), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"moetune {args[0]} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout))


def write_model(out: Path, args: argparse.Namespace) -> Path:
    """A random bf16 Qwen3-MoE of the asked shape, with the demo tokenizer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # lazy: only when building one

    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    heads = max(args.hidden // 64, 2)
    config = Qwen3MoeConfig(
        vocab_size=max(args.vocab, len(tok)), hidden_size=args.hidden,
        intermediate_size=2 * args.hidden, moe_intermediate_size=args.moe,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=2,
        head_dim=args.hidden // heads, num_experts=args.experts,
        num_experts_per_tok=min(8, args.experts // 2), max_position_embeddings=256,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: never a float32 copy in RAM
    try:
        Qwen3MoeForCausalLM(config).save_pretrained(out)
    finally:
        torch.set_default_dtype(torch.float32)
    tok.save_pretrained(out)
    return out


def write_run(root: Path, model: Path, args: argparse.Namespace) -> Path:
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    rows = [{"prompt": f"rev:{w}>", "completion": w[::-1]} for w in words * 4]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = {
        "model": {"id": str(model)},
        "lora": {"rank": args.rank, "targets": ["attention", "experts"], "engine": "moetune"},
        "data": {"train_file": str(data)},
        "output": {"dir": str(root / "run"), "ledger": str(root / "ledger.jsonl")},
        "train": {"device": "cpu", "precision": "fp32", "offload": "disk",
                  "max_steps": args.steps, "save_steps": args.steps, "batch_size": 1,
                  "seq_len": args.seq, "gradient_checkpointing": False, "routing_every": 0},
    }  # fmt: skip
    path = root / "run.yaml"
    path.write_text(json.dumps(run))  # JSON is YAML
    return path


def train(config: Path, host_file: Path) -> tuple[dict[str, Any], int]:
    """`moetune train run.yaml --json`: its result and the process tree's peak RSS."""
    cmd = [sys.executable, "-m", "moetune", "train", str(config), "--json"]
    proc = subprocess.Popen(cmd, env=_env(host_file), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    sampler = Peak(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    sampler.done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"moetune train failed:\n{err[-3000:]}")
    return dict(json.loads(out)), sampler.peak


def run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    model = Path(args.model) if args.model else write_model(root / "model", args)
    host_file = Path(args.host_file) if args.host_file else root / "host.json"
    if not args.host_file:
        shard = max(model.glob("*.safetensors"), key=lambda p: p.stat().st_size)
        probe = ["--probe-mib", "4"] if args.smoke else []
        moetune(["doctor", "--calibrate", "--file", str(shard), *probe], host_file)
    config = write_run(root, model, args)
    plan = moetune(["plan", str(config), "--card", "cpu"], host_file)["offload"]["cpu"]
    result, peak = train(config, host_file)
    moved = json.loads((root / "run" / "offload.json").read_text())["bytes_read"]
    steps = step_times(root / "run")
    return {
        "host": json.loads(host_file.read_text()), "model": _model_words(model, args),
        "steps": result["steps"],
        "plan": {k: plan[k] for k in ("device_peak_bytes", "step_time_s", "compute_s",
                                      "transfer_s", "bound", "bytes_moved_per_step")},
        "rss_peak": peak, "step_s": result["loop_seconds"] / max(result["steps"], 1),
        "steps_s": steps, "steady_s": statistics.median(steps[1:] or steps),
        "read_per_step": sum(moved.values()) / max(result["steps"], 1),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }  # fmt: skip


def step_times(run_dir: Path) -> list[float]:
    """Seconds per optimizer step from metrics.jsonl (each row's `step_seconds`: the mean
    over the steps since the row before)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out, step = [], 0
    for r in (r for r in rows if r.get("step_seconds") is not None):
        out += [float(r["step_seconds"])] * max(1, r["step"] - step)
        step = r["step"]
    return out or [0.0]


def _model_words(model: Path, args: argparse.Namespace) -> str:
    size = sum(p.stat().st_size for p in model.glob("*.safetensors")) / 1e9
    if args.model:
        return f"{model} ({size:.1f} GB)"
    return (f"random bf16 Qwen3-MoE, {args.layers} layers × {args.experts} experts (hidden "
            f"{args.hidden}, expert {args.moe}, vocab {args.vocab}), {size:.2f} GB")  # fmt: skip


def describe(r: dict[str, Any]) -> str:
    h, p = r["host"], r["plan"]
    planned_read = sum(p["bytes_moved_per_step"].values())
    rows = [
        ("peak RSS of `moetune train`", p["device_peak_bytes"] / GiB, r["rss_peak"] / GiB, "GiB"),
        ("step (median after the first)", p["step_time_s"], r["steady_s"], "s"),
        ("step (mean, the first's warm-up included)", p["step_time_s"], r["step_s"], "s"),
        ("bytes read per step", planned_read / GiB, r["read_per_step"] / GiB, "GiB"),
    ]
    table = ["| | plan (`--card cpu`) | measured | measured / plan |", "|---|---|---|---|"]
    table += [f"| {n} | {a:.2f} {u} | {b:.2f} {u} | {b / a:.3f} |" for n, a, b, u in rows]
    return "\n".join([
        f"- {r['when']} · {h['cpu']}, {h['cores']} cores, {bench_env.describe()} · host.json: "
        f"fp32 {h['fp32_gflops']:.1f} GFLOP/s, memcpy {h['memcpy_gb_per_s']:.2f} GB/s, disk "
        f"{h['disk_read_gb_per_s']:.2f} GB/s ({'O_DIRECT' if h['disk_direct'] else 'cached'})"
        f" · {r['model']}, {r['steps']} steps ("
        + ", ".join(f"{x:.3g}" for x in r["steps_s"]) + f" s); plan {p['bound']}-bound (compute "
        f"{p['compute_s']:.2f} s, read {p['transfer_s']:.2f} s)",
        "", *table,
    ])  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a bf16 checkpoint dir with a tokenizer (default: built)")
    for name, default in (("layers", 4), ("experts", 128), ("hidden", 1024), ("moe", 768),
                          ("vocab", 4096), ("steps", 3), ("seq", 32), ("rank", 4)):  # fmt: skip
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--host-file", help="plan with this host.json (default: calibrate now)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 1 step, nothing recorded")
    ap.add_argument("--record", action="store_true", help="append to results/offload-and-stored.md")
    bench_env.add_argument(ap)
    args = ap.parse_args(argv)
    if args.smoke:
        args.layers, args.experts, args.hidden, args.moe, args.vocab = 4, 4, 16, 8, 64
        args.steps, args.record = 1, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_env.apply()
    with tempfile.TemporaryDirectory(prefix="cpu-plan-") as tmp:
        text = describe(run(args, Path(tmp)))
    print(text)
    if args.record:
        bench_env.append_results(RESULTS, HEAD, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
