"""Load once, shard as you go: each rank's and the node's peak RSS of a 2-process FSDP2 run
(gloo, CPU) against the plan's host RAM, and the adapter against 1 process – for each experts
dtype side by side (bf16 stacks, int8, NF4: rank 0 loads and quantises, the other builds the
quantised stacks on meta and receives its shards).

Builds a random Qwen3-MoE, tiny-shaped but wide (many wide experts: ~0.5 GB of fp32
safetensors, written under a temp dir and deleted after), trains the same LoRA steps with
`moetune train` on 1 process (batch 4) and on 2 (`--nproc 2 --strategy fsdp`, batch 2
each), and samples every rank's RSS from this parent with psutil (the launcher's children
carry RANK in their environment); the node's figure is the peak of the ranks' sum, sampled
together. The plan: `plan.sharding.host_ram` for the load and, as a CPU rank also trains in
host RAM, the per-rank training peak (`per_rank_bytes`) plus the runtime, whichever is
larger. `--record` appends the figures, machine and date to results/distributed.md.

    python benchmarks/sharded_load.py [--smoke] [--record] [--arms bf16,int8,nf4]

An arm `zero3-bf16` runs the 2 ranks as DeepSpeed ZeRO-3 instead (`--strategy zero3`: the
base built under zero.Init, each rank its partition) – from the DeepSpeed venv
(`make setup-deepspeed`), beside the FSDP2 arm of the same dtype:

    /work/venvs/ds/bin/python benchmarks/sharded_load.py --arms bf16,zero3-bf16

`--smoke`: the tiny test model (31 KB), int8 only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import bench_env
import psutil
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

RESULTS = bench_env.results_page("distributed")
SECTION = "## Sharded load: FSDP2 host RAM per rank, 2 processes (gloo, CPU)"
SRC = Path(__file__).resolve().parents[1] / "src"
WIDE = {"hidden_size": 128, "moe_intermediate_size": 640, "num_experts": 128,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "num_attention_heads": 4,
        "head_dim": 32, "intermediate_size": 256}  # fmt: skip
SMOKE = {"hidden_size": 16, "moe_intermediate_size": 8, "num_experts": 4,
         "num_hidden_layers": 2, "num_key_value_heads": 2, "num_attention_heads": 4,
         "head_dim": 8, "intermediate_size": 24}  # fmt: skip
ARMS = ("bf16", "int8", "nf4")
WORDS = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


def build(root: Path, shape: dict[str, int]) -> Path:
    """A random Qwen3-MoE of `shape` with the demo tokenizer, saved as safetensors."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from moetune.demo.tokenizer import build_tokenizer

    tok = build_tokenizer()
    config = Qwen3MoeConfig(
        vocab_size=len(tok), num_experts_per_tok=2, max_position_embeddings=64,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id, **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    out = root / "model"
    Qwen3MoeForCausalLM(config).save_pretrained(out, max_shard_size="100GB")
    tok.save_pretrained(out)
    return out


def write_run(
    root: Path, model: Path, name: str, steps: int, experts_dtype: str, **train: Any
) -> Path:
    """A run config (the training data beside it): fp32 on CPU, LoRA r4 on every target."""
    from moetune.config import dump_config, parse_config

    data = root / "train.jsonl"
    rows = [{"prompt": f"rev:{w}>", "completion": w[::-1]} for w in WORDS * 3]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    section = {"max_steps": steps, "seq_len": 32, "learning_rate": 1e-2, "save_steps": 100,
               "routing_every": 2, "device": "cpu", **train}  # fmt: skip
    cfg = parse_config({
        "model": {"id": str(model), "dtype": "float32", "experts_dtype": experts_dtype},
        "lora": {"rank": 4},
        "data": {"train_file": str(data)},
        "output": {"dir": str(root / name), "ledger": str(root / "ledger.jsonl")},
        "train": section,
    })  # fmt: skip
    path = root / f"{name}.yaml"
    path.write_text(dump_config(cfg), encoding="utf-8")
    return path


class Sampler(threading.Thread):
    """Each rank's peak RSS among `pid`'s descendants (by their RANK), sampled; and its peak
    RSS without the resident pages of the mmap'd checkpoint (page cache the kernel can drop:
    not RAM the load needs, but RSS counts it while from_pretrained has the file mapped)."""

    def __init__(self, pid: int, every: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.root, self.every = psutil.Process(pid), every
        self.peaks: dict[int, int] = {}
        self.needed: dict[int, int] = {}
        self.node = 0  # the ranks' summed RSS without the mapped checkpoint, at its peak
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            found = self._ranks()
            # the root without RANK: the launcher of ranks, or itself the one process
            ranks = [r for r in found if r[0] >= 0] or [(0, *r[1:]) for r in found]
            for rank, rss, mapped in ranks:
                self.peaks[rank] = max(self.peaks.get(rank, 0), rss)
                self.needed[rank] = max(self.needed.get(rank, 0), rss - mapped)
            self.node = max(self.node, sum(rss - mapped for _, rss, mapped in ranks))
            time.sleep(self.every)

    def _ranks(self) -> list[tuple[int, int, int]]:
        found = []
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:  # the run just ended
            return []
        for proc in procs:
            try:
                rank = proc.environ().get("RANK")
                if rank is None and proc is not self.root:
                    continue
                maps = proc.memory_maps(grouped=True)
                mapped = sum(m.rss for m in maps if m.path.endswith(".safetensors"))
                found.append((int(rank or -1), proc.memory_info().rss, mapped))
            except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
                continue
        return found


def train(config: Path, *flags: str) -> tuple[dict[str, Any], Sampler, float]:
    """`moetune train CONFIG --json FLAGS`: its result, the ranks' sampled RSS, the seconds."""
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    # 2 ranks on the shared cores: one OpenMP thread each, whatever the parent's --threads
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "moetune", "train", str(config), "--json", *flags]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sampler = Sampler(proc.pid)
    sampler.start()
    out, err = proc.communicate()
    sampler.done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{config.name} failed:\n{err.decode()[-3000:]}")
    return json.loads(out), sampler, time.perf_counter() - started


def planned(model: Path, config: Path, strategy: str = "fsdp") -> dict[str, int]:
    """The plan's peak host RAM of rank 0, of rank 1 and of the node: the larger of the load
    (`host_ram`) and the CPU ranks' training (runtime + per-rank live bytes)."""
    from moetune.config import load_config
    from moetune.model import load_spec
    from moetune.plan.devices.host_ram import RUNTIME_HOST_BYTES, host_ram
    from moetune.plan.devices.sharding import per_rank_bytes, run_sizes

    cfg = load_config(config)
    spec = load_spec(str(model))
    ram = host_ram(run_sizes(spec, cfg), 2, strategy)
    training = RUNTIME_HOST_BYTES + sum(per_rank_bytes(spec, cfg, 2, strategy).values())
    return {"0": max(ram.main_rank_bytes, training), "1": max(ram.other_rank_bytes, training),
            "node": max(ram.per_node_bytes, 2 * training)}  # fmt: skip


def rel_diff(run: Path, reference: Path) -> float:
    from safetensors.torch import load_file

    got = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    want = load_file(str(reference / "adapter" / "adapter_model.safetensors"))
    return max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)


def measure(smoke: bool, steps: int, arms: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="moetune-sharded-") as tmp:
        root = Path(tmp)
        model = build(root, SMOKE if smoke else WIDE)
        size = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        return {"checkpoint_bytes": size, "steps": steps,
                "arms": {arm: measure_arm(root, model, arm, steps) for arm in arms}}  # fmt: skip


def measure_arm(root: Path, model: Path, arm: str, steps: int) -> dict[str, Any]:
    """1 process and 2 ranks (FSDP2, or ZeRO-3 for a `zero3-` arm) with the arm's experts
    dtype: RSS, plan, adapter."""
    strategy, _, experts_dtype = arm.rpartition("-")
    strategy = strategy or "fsdp"
    one = write_run(root, model, f"one-{arm}", steps, experts_dtype, batch_size=4)
    two = write_run(root, model, f"two-{arm}", steps, experts_dtype, batch_size=2,
                    nproc=2, strategy=strategy)  # fmt: skip
    _, single, one_s = train(one)
    result, ranks, two_s = train(two, "--nproc", "2", "--strategy", strategy)
    summary = json.loads((root / two.stem / "summary.json").read_text())
    return {"strategy": strategy,
        "steps": result["steps"], "one_rss": single.peaks[0], "one_needed": single.needed[0],
        "one_s": one_s, "two_s": two_s, "rss": ranks.peaks, "needed": ranks.needed,
        "node": ranks.node, "plan": planned(model, two, strategy),
        "rel_diff": rel_diff(root / two.stem, root / one.stem),
        "load": summary["distributed"]["load"]["ranks"],
    }  # fmt: skip


def report(m: dict[str, Any]) -> str:
    gib = 2**30
    head = (
        f"- {datetime.date.today().isoformat()}, {psutil.cpu_count()} shared CPU cores "
        f"({platform.machine()}, {psutil.virtual_memory().total / gib:.0f} GiB, "
        f"{bench_env.describe()}, 1 thread a rank), "
        f"torch {torch.__version__}: Qwen3-MoE {m['checkpoint_bytes'] / gib:.2f} GiB fp32 "
        f"safetensors, LoRA r4, {m['steps']} steps, each experts dtype side by side:\n"
    )  # fmt: skip
    return head + "".join(_arm(name, arm) for name, arm in m["arms"].items())


def _arm(name: str, a: dict[str, Any]) -> str:
    gib = 2**30
    ranks = "; ".join(_rank(a, r) for r in sorted(a["rss"]))
    node, plan = a["node"], a["plan"]["node"]
    return (
        f"  - **{name}** experts: 1 process: peak RSS {a['one_rss'] / gib:.2f} GiB "
        f"({a['one_needed'] / gib:.2f} without the mapped checkpoint; {a['one_s']:.0f} s); "
        f"2 {STRATEGY_NAMES[a['strategy']]} ranks ({a['two_s']:.0f} s): {ranks}; **node (both "
        f"ranks together) "
        f"{node / gib:.2f} GiB = {node / a['one_needed']:.2f}× the 1-process figure, plan "
        f"{plan / gib:.2f} GiB ({plan / node - 1:+.1%})**; adapter vs 1 process: worst "
        f"relative difference {a['rel_diff']:.1e}\n"
    )  # fmt: skip


def _rank(m: dict[str, Any], r: int) -> str:
    gib, load = 2**30, m["load"][r]
    need, plan = m["needed"][r], m["plan"][str(r)]
    figures = ", ".join(
        f"{LOAD_WORDS[k]} {v / gib:.3f} GiB" for k, v in load.items() if k in LOAD_WORDS
    )
    return (
        f"rank {r}: peak RSS {m['rss'][r] / gib:.2f} GiB, without the mapped checkpoint "
        f"{need / gib:.2f} GiB, plan {plan / gib:.2f} GiB ({plan / need - 1:+.1%}); {figures}"
    )


STRATEGY_NAMES = {"fsdp": "FSDP2", "zero3": "ZeRO-3"}
# summary.json's distributed.load figures, as the report words them (the order they have)
LOAD_WORDS = {"loaded_bytes": "base held after load", "broadcast_peak_bytes": "broadcast peak",
              "sharded_bytes": "shard", "load_peak_bytes": "live peak while loading",
              "peak_rss_bytes": "peak RSS by the end of the load"}  # fmt: skip


def record(line: str) -> None:
    """`line` at the end of this benchmark's section (before the next heading, if any)."""
    text = RESULTS.read_text() if RESULTS.exists() else ""
    if SECTION not in text:
        text += f"\n{SECTION}\n\n`python benchmarks/sharded_load.py`\n\n"
    end = text.find("\n\n## ", text.index(SECTION))
    end = len(text) if end < 0 else end + 1
    gap = "" if text[:end].endswith("\n\n") else "\n"  # a list of its own, not the paragraph's
    bench_env.write_results(RESULTS, text[:end] + gap + line + text[end:])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny model (a fast check)")
    parser.add_argument("--steps", type=int, default=2)
    arms = "experts dtypes, comma-separated (default: bf16,int8,nf4; --smoke: int8)"
    parser.add_argument("--arms", default=None, help=arms)
    parser.add_argument("--record", action="store_true", help="append to results/distributed.md")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench_env.add_argument(parser)
    args = parser.parse_args()
    bench_env.apply()
    arms = (args.arms or ("int8" if args.smoke else ",".join(ARMS))).split(",")
    m = measure(args.smoke, args.steps, arms)
    line = report(m)
    print(json.dumps(m) if args.json else line, end="" if not args.json else "\n")
    if args.record:
        record(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
