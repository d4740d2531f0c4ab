"""The CPU analog of "235B on one 80 GB card": LoRA steps on a base larger than this
machine's RAM, its expert stacks left in the safetensors files (train.offload: disk).

It writes a random-weight checkpoint of the Qwen3-30B-A3B shape with fewer layers (27 by
default: 35 GB of bf16 safetensors), shard by shard – one layer in memory at a time, and the
page cache of each shard dropped once written – under --out (never committed; deleted at the
end unless --keep). Then it loads it with `engine.offload.load.load_offloaded(..., "disk")`
(everything but the expert stacks on the "device", here the CPU), puts LoRA r --rank on every
expert stack (split LoRA, AdamW) and takes --steps steps of batch 1, --seq tokens, sampling
the process RSS with psutil on a thread (every 20 ms). Per step: wall time, bytes read from the
files and the store's peak resident expert bytes. Beside them: `moetune.plan.offload.memory`'s
figures for the same run when that module is importable ("plan: n/a" otherwise).
`--smoke`: a tiny shape, one step, seconds (the fast test runs it; nothing recorded).

    python benchmarks/offload_disk.py [--layers 27] [--steps 3] [--seq 32] [--rank 4]
        [--threads N] [--out /tmp/moetune-offload] [--keep] [--smoke] [--record] [--json F]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import bench_env
import psutil
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GiB = 2**30
QWEN3_30B = {  # Qwen/Qwen3-30B-A3B config.json, layers aside
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "dtype": "bfloat16",
}  # fmt: skip
SMOKE = {**QWEN3_30B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
         "moe_intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2}  # fmt: skip
KEEP_FREE = 20 * 10**9  # bytes the disk keeps free for everyone else


# ---------------------------------------------------------------- the checkpoint


def layer_tensors(cfg: dict[str, Any], i: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One decoder layer in the hub's layout (one tensor per expert and projection)."""
    names = ("hidden_size", "moe_intermediate_size", "num_attention_heads",
             "num_key_value_heads", "head_dim")  # fmt: skip
    h, inter, heads, kv, hd = (cfg[k] for k in names)
    p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
    shapes = {
        f"{a}.q_proj.weight": (heads * hd, h), f"{a}.k_proj.weight": (kv * hd, h),
        f"{a}.v_proj.weight": (kv * hd, h), f"{a}.o_proj.weight": (h, heads * hd),
        f"{p}.mlp.gate.weight": (cfg["num_experts"], h),
    }  # fmt: skip
    for e in range(cfg["num_experts"]):
        shapes |= {f"{p}.mlp.experts.{e}.gate_proj.weight": (inter, h),
                   f"{p}.mlp.experts.{e}.up_proj.weight": (inter, h),
                   f"{p}.mlp.experts.{e}.down_proj.weight": (h, inter)}  # fmt: skip
    out = {k: _rand(s, gen, 0.02) for k, s in shapes.items()}
    for norm in ("input_layernorm", "post_attention_layernorm"):
        out[f"{p}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    out[f"{p}.self_attn.q_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
    out[f"{p}.self_attn.k_norm.weight"] = torch.ones(hd, dtype=torch.bfloat16)
    return out


_POOL: dict[int, torch.Tensor] = {}
_POOL_SIZE = 2**26  # bf16 values drawn once (128 MiB); drawing 35 GB would take ~30 min here


def _rand(shape: tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    """Uniform values with that std: a copy of the pool from a random offset (a tensor of
    the pool's size or more is drawn afresh)."""
    n = math.prod(shape)
    if n >= _POOL_SIZE // 2:
        return _uniform(n, gen, std).view(shape)
    if 0 not in _POOL:
        _POOL[0] = _uniform(_POOL_SIZE, gen, 0.02)
    start = int(torch.randint(0, _POOL_SIZE - n, (1,), generator=gen))
    return (_POOL[0][start : start + n] * (std / 0.02)).view(shape)


def _uniform(n: int, gen: torch.Generator, std: float) -> torch.Tensor:
    bound = std * 3**0.5
    return torch.empty(n, dtype=torch.bfloat16).uniform_(-bound, bound, generator=gen)


def write_checkpoint(out: Path, cfg: dict[str, Any], progress: bool) -> int:
    """config.json + one shard per layer (and one for embeddings/head); returns the bytes."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen3MoeForCausalLM"]}))
    gen = torch.Generator().manual_seed(0)
    layers = cfg["num_hidden_layers"]
    weight_map: dict[str, str] = {}
    shards = [("model-edge.safetensors", lambda: _edges(cfg, gen))]
    shards += [(f"model-{i:05d}.safetensors", lambda i=i: layer_tensors(cfg, i, gen))
               for i in range(layers)]  # fmt: skip
    total = 0
    for n, (name, make) in enumerate(shards):
        tensors = make()
        save_file(tensors, str(out / f".{name}.tmp"), metadata={"format": "pt"})
        os.replace(out / f".{name}.tmp", out / name)
        bench_env.drop_cache(out / name)
        weight_map |= dict.fromkeys(tensors, name)
        total += (out / name).stat().st_size
        del tensors
        if progress:
            print(f"  wrote {name} ({n + 1}/{len(shards)}, {total / GiB:.1f} GiB)", flush=True)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return total


def reused(out: Path, cfg: dict[str, Any]) -> int:
    """The bytes of a complete checkpoint of this shape already in `out` (0: none)."""
    index = out / "model.safetensors.index.json"
    if not index.is_file():
        return 0
    config = json.loads((out / "config.json").read_text())
    if any(config.get(k) != v for k, v in cfg.items()):
        return 0
    return int(json.loads(index.read_text())["metadata"]["total_size"])


def _edges(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, torch.Tensor]:
    v, h = cfg["vocab_size"], cfg["hidden_size"]
    return {"model.embed_tokens.weight": _rand((v, h), gen, 0.02),
            "lm_head.weight": _rand((v, h), gen, 0.02),
            "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}  # fmt: skip


def expected_bytes(cfg: dict[str, Any]) -> int:
    h, inter, e = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["num_experts"]
    attn = h * cfg["head_dim"] * (2 * cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
    per_layer = 3 * e * h * inter + attn + e * h
    return 2 * (cfg["num_hidden_layers"] * per_layer + 2 * cfg["vocab_size"] * h)


# ---------------------------------------------------------------- measuring


class RssSampler:
    """The process RSS, sampled on a thread; `peak` since the last `reset`."""

    def __init__(self, every_s: float = 0.02) -> None:
        self.proc, self.every, self.peak = psutil.Process(), every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(self.every)

    def reset(self) -> int:
        self.peak = now = self.proc.memory_info().rss
        return int(now)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self.proc.memory_info().rss)


def build(model_dir: Path, rank: int) -> tuple[Any, Any]:
    """The base with its experts left in the files, split LoRA r `rank` on every stack."""
    from peft import LoraConfig, get_peft_model

    from moetune.engine import IMPLEMENTATION, apply_split_lora, register
    from moetune.engine.offload.load import load_offloaded
    from moetune.engine.offload.store import peft_targets

    # fp32 compute, as moetune trains on a CPU: torch's bf16 matmul backward on a CPU without
    # AVX512-BF16 falls back to a reference GEMM (measured: > 15 min for one LM-head backward)
    model, store, _ = load_offloaded(model_dir, "disk", "cpu", torch.float32)
    register()
    model.set_experts_implementation(IMPLEMENTATION)
    stacks = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=[], target_parameters=stacks)
    with warnings.catch_warnings(), peft_targets(model):
        warnings.simplefilter("ignore")
        peft_model = get_peft_model(model, lora)
    apply_split_lora(peft_model)
    peft_model.train()
    return peft_model, store


def take_steps(model: Any, store: Any, cfg: dict[str, Any], args: argparse.Namespace,
               rss: RssSampler) -> list[dict[str, Any]]:  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for step in range(args.steps):
        ids = torch.randint(0, cfg["vocab_size"], (1, args.seq), generator=gen)
        read0, moved0 = sum(store.stats.bytes_read.values()), dict(store.stats.bytes_moved)
        store.reset_peak()
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start
        read = sum(store.stats.bytes_read.values()) - read0
        moved = {k: v - moved0[k] for k, v in store.stats.bytes_moved.items()}
        rows.append({"step": step + 1, "seconds": round(seconds, 2), "loss": float(loss.detach()),
                     "bytes_read": read, "bytes_moved": moved,
                     "peak_resident_expert_bytes": store.stats.peak_resident_bytes,
                     "read_GBps": round(read / seconds / 1e9, 3)})  # fmt: skip
        if not args.smoke:
            print(
                f"  step {step + 1}: {seconds:.1f} s, read {read / GiB:.1f} GiB, "
                f"RSS peak so far {rss.peak / GiB:.2f} GiB",
                flush=True,
            )
    return rows


def plan_figures(model_dir: Path, args: argparse.Namespace) -> dict[str, Any] | None:
    """moetune.plan.offload.memory's figures for this run, if that module exists here."""
    try:
        from moetune.plan.offload.memory import plan_offload
    except ImportError:
        return None
    from moetune.config import parse_config
    from moetune.model import load_spec

    cfg = parse_config({
        "model": {"id": str(model_dir), "dtype": "float32"},  # computed in fp32, as measured
        "lora": {"rank": args.rank, "targets": ["experts"], "engine": "moetune"},
        "train": {"offload": "disk", "seq_len": args.seq, "batch_size": 1, "device": "cpu",
                  "precision": "fp32", "gradient_checkpointing": False},
    })  # fmt: skip
    plan = plan_offload(load_spec(str(model_dir)), cfg, card=None)
    keys = ("device_peak_bytes", "host_ram_bytes", "disk_bytes", "bytes_moved_per_step",
            "step_time_s")  # fmt: skip
    return {k: getattr(plan, k, None) for k in keys}


def machine() -> dict[str, Any]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())  # fmt: skip
    return {"cpu": cpu, "cores": psutil.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "torch": torch.__version__, "threads": bench_env.describe(),
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}  # fmt: skip


# ---------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = {**(SMOKE if args.smoke else QWEN3_30B), "num_hidden_layers": args.layers}
    out = Path(args.out)
    need = 0 if args.reuse and reused(out, cfg) else expected_bytes(cfg)
    free = shutil.disk_usage(out.parent if not out.exists() else out).free
    if free - need < (0 if args.smoke else KEEP_FREE):
        raise SystemExit(
            f"offload_disk: needs {need / 1e9:.1f} GB and keeps {KEEP_FREE / 1e9:.0f} GB "
            f"free; only {free / 1e9:.1f} GB are free"
        )
    import peft  # noqa: F401  imported before the load is timed
    import transformers  # noqa: F401

    try:
        started = time.perf_counter()
        written = reused(out, cfg) if args.reuse else 0
        written = written or write_checkpoint(out, cfg, progress=not args.smoke)
        write_s = time.perf_counter() - started
        rss = RssSampler()
        before_load = rss.reset()
        started = time.perf_counter()
        model, store = build(out, args.rank)
        load_s, after_load = time.perf_counter() - started, rss.peak
        rss.reset()
        steps = take_steps(model, store, cfg, args, rss)
        peak = rss.stop()
        plan = plan_figures(out, args)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
    return {
        "machine": machine(), "shape": {k: cfg[k] for k in ("num_hidden_layers", "num_experts",
                                        "hidden_size", "moe_intermediate_size", "vocab_size")},
        "checkpoint_bytes": written, "write_s": round(write_s, 1), "load_s": round(load_s, 1),
        "rss_before_load": before_load, "rss_peak_load": after_load, "rss_peak_steps": peak,
        "expert_layer_bytes": store.stats.layer_bytes, "expert_bytes": store.stats.stored_bytes,
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "rank": args.rank, "seq": args.seq, "steps": steps, "plan": plan, "kept": args.keep,
    }  # fmt: skip


def describe(r: dict[str, Any]) -> str:
    """The markdown its results page gets: a dated line, a table per step, the plan beside."""
    m, s = r["machine"], r["shape"]
    g = lambda n: f"{n / GiB:.2f} GiB"  # noqa: E731
    lines = [
        f"- {m['date']} · {m['cpu']}, {m['cores']} cores, {g(m['ram_bytes'])} RAM, torch "
        f"{m['torch']}, {m['threads']} threads · Qwen3-30B-A3B shape with "
        f"{s['num_hidden_layers']} layers ({s['num_experts']} experts × hidden "
        f"{s['hidden_size']} × {s['moe_intermediate_size']}): **{r['checkpoint_bytes'] / 1e9:.1f} "
        f"GB** of bf16 safetensors ({g(r['expert_bytes'])} of expert stacks, "
        f"{g(r['expert_layer_bytes'])} a layer), written in {r['write_s']} s (0: reused); fp32 "
        f"compute; LoRA r {r['rank']} "
        f"on every expert stack ({r['trainable_params'] / 1e6:.0f} M params, AdamW), batch 1 × "
        f"{r['seq']} tokens, checkpointing off.",
        f"- Load (all but the experts): {r['load_s']} s, RSS peak {g(r['rss_peak_load'])}. "
        f"**Peak RSS over the steps: {g(r['rss_peak_steps'])}** (psutil, every 20 ms).",
        "", "| step | s | GiB read | read GB/s | moved fwd / bwd GiB | "
        "peak resident experts (fp32) |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    for st in r["steps"]:
        mv = st["bytes_moved"]
        fwd, bwd = mv["forward"] / GiB, mv["backward"] / GiB
        lines.append(f"| {st['step']} | {st['seconds']} | {st['bytes_read'] / GiB:.1f} | "
                     f"{st['read_GBps']} | {fwd:.1f} / {bwd:.1f} | "
                     f"{g(st['peak_resident_expert_bytes'])} |")  # fmt: skip
    lines += ["", plan_line(r)]
    return "\n".join(lines)


def plan_line(r: dict[str, Any]) -> str:
    plan = r["plan"]
    if plan is None:
        return "- plan: n/a (moetune.plan.offload.memory not importable in this tree)"
    peak = plan.get("device_peak_bytes")
    err = f" ({100 * (peak / r['rss_peak_steps'] - 1):+.1f} % vs measured RSS)" if peak else ""
    return (f"- plan: device peak {peak and peak / GiB:.2f} GiB{err}, host "
            f"RAM {plan.get('host_ram_bytes')}, disk {plan.get('disk_bytes')}, bytes moved/step "
            f"{plan.get('bytes_moved_per_step')}, step {plan.get('step_time_s')} s")  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 27; smoke 4)")
    ap.add_argument("--steps", type=int, default=None, help="LoRA steps (default 3; smoke 1)")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--rank", type=int, default=4)
    bench_env.add_argument(ap)
    ap.add_argument("--out", default="/tmp/moetune-offload")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--reuse", action="store_true", help="use a complete checkpoint of the "
                    "same shape already in --out (kept or left by a killed run)")  # fmt: skip
    ap.add_argument("--smoke", action="store_true", help="tiny shape, 1 step, nothing recorded")
    ap.add_argument("--record", action="store_true", help="append to results/offload-and-stored.md")
    ap.add_argument("--json", help="write the results JSON here")
    args = ap.parse_args(argv)
    args.layers = args.layers or (4 if args.smoke else 27)
    args.steps = args.steps or (1 if args.smoke else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bench_env.apply()
    result = run(args)
    text = describe(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.record and not args.smoke:  # a smoke figure is no result
        head = "## offload_disk: LoRA on a base larger than RAM, experts read from disk"
        bench_env.append_results(bench_env.results_page("offload-and-stored"), head, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
