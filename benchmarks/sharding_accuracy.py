"""How close is the per-device planner (`plan.sharding`, FSDP2) to a measured per-rank peak?

Runs real training steps of a small random Qwen3-MoE (full fine-tuning, fp32, AdamW fused,
no gradient checkpointing) on the CPU: once on one process without FSDP, then with world
size 2 (torch.multiprocessing spawn, gloo) and FSDP2 (`fully_shard` on each decoder layer,
then on the model). Each rank counts its live tensor bytes with a TorchDispatchMode byte
tracker (`plan.trace.bytes.ByteTracker`, DTensors counted by their local shard) over the second
step (Adam moments live), and the peak is compared with `per_rank_bytes(spec, cfg, N,
"fsdp")` and with the single-device analytic. `--record` appends a dated line to
results/distributed.md.

    python benchmarks/sharding_accuracy.py [--record]
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import weakref
from dataclasses import replace
from typing import Any

import bench_env
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moetune.config import RunConfig, parse_config
from moetune.model import spec_from_config
from moetune.plan.analytic import estimate_step
from moetune.plan.devices.sharding import per_rank_bytes
from moetune.plan.step import Step
from moetune.plan.trace.bytes import FROZEN, GRADIENTS, OPTIMIZER, TRAINABLE, ByteTracker

RESULTS = bench_env.results_page("distributed")
SECTION = "## Per-device planner: FSDP2 per-rank peak, 2 processes (gloo, CPU)"
CONFIG: dict[str, Any] = {
    "model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512,
    "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 4096, "max_position_embeddings": 512, "tie_word_embeddings": False,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip
SEQ = 256
# --smoke: a narrower model and shorter sequence (the spawned ranks see it through the env)
SMOKE = "--smoke" in sys.argv[1:] or os.environ.get("MOETUNE_BENCH_SMOKE") == "1"
if SMOKE:
    CONFIG |= {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
               "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 512}  # fmt: skip
    SEQ = 32
GRANULE = 1 << 10


def run_config() -> RunConfig:
    return parse_config(
        {
            "model": {"dtype": "float32"},
            "train": {"tuning": "full", "seq_len": SEQ, "gradient_checkpointing": False},
        }
    )


class ShardTracker(ByteTracker):
    """ByteTracker for FSDP2: a DTensor counts by its local shard (sharded parameters,
    gradients and Adam moments are DTensors; a wrapper has no storage of its own), and live
    bytes are re-summed from each storage's current size after every op, because FSDP2
    frees and re-allocates its all-gather buffers in place (`storage.resize_(0)` / back),
    which no op and no finalizer reports."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        self.true_peak = 0
        self.true_at_peak: dict[str, int] = {}

    def _add(self, storage: torch.UntypedStorage, category: str) -> bool:
        added = super()._add(storage, category)
        if added:
            self._refs[self._live[storage._cdata]] = weakref.ref(storage)
        return added

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        self.last_op = func
        for tensor in _local(out):
            self._add(tensor.untyped_storage(), "activations")
        self._resum()
        return out

    def _resum(self) -> None:
        by_category: dict[str, int] = {}
        for index in self._live.values():
            storage = self._refs[index]()
            if storage is not None:
                category = self._category[index]
                by_category[category] = by_category.get(category, 0) + storage.nbytes()
        total = sum(by_category.values())
        if total > self.true_peak:
            self.true_peak, self.true_at_peak = total, by_category


def _local(out: Any) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    if isinstance(out, (tuple, list)):
        return [t for item in out for t in _local(item)]
    if isinstance(out, DTensor):
        return [out._local_tensor]
    return [out] if isinstance(out, torch.Tensor) else []


def _model() -> torch.nn.Module:
    from moetune.model.build import build_model

    torch.manual_seed(0)
    return build_model(spec_from_config(dict(CONFIG), "bench-moe"), device="cpu", dtype="float32")


def _step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    ids: torch.Tensor,
    tracker: ByteTracker | None = None,
) -> None:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if tracker is not None:  # label the gradients while they are live (the peak may follow)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        tracker.classify(_local(grads), GRADIENTS)
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(rank: int, world: int) -> int:
    """One rank's live-byte peak over the second training step."""
    model = _model()
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(
        3, CONFIG["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(rank)
    )
    _step(model, opt, ids)  # step 1 creates the Adam moments
    tracker = ShardTracker()
    params = [p for p in model.parameters()]
    with tracker:
        tracker.register(_local(params), TRAINABLE)
        tracker.register(_local(list(model.buffers())), FROZEN)
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        tracker.register(_local(states), OPTIMIZER)
        tracker.step = 2
        _step(model, opt, ids, tracker)
    parts = {k: round(v / 2**20, 2) for k, v in tracker.true_at_peak.items()}
    print(f"world {world} rank {rank} at peak:", parts, flush=True)
    return tracker.true_peak


def _worker(rank: int, world: int, init_file: str, queue: Any) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        queue.put((rank, measure(rank, world)))
    finally:
        dist.destroy_process_group()


def measure_world(world: int) -> list[int]:
    if world == 1:
        return [measure(0, 1)]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        mp.spawn(_worker, args=(world, init, queue), nprocs=world, join=True)
        got = dict(queue.get() for _ in range(world))
    return [got[r] for r in range(world)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="append to results/distributed.md")
    parser.add_argument("--smoke", action="store_true", help="a tiny model; never records")
    bench_env.add_argument(parser)
    args = parser.parse_args()
    bench_env.apply()
    if args.smoke:
        os.environ["MOETUNE_BENCH_SMOKE"] = "1"
    spec, cfg = spec_from_config(dict(CONFIG), "bench-moe"), run_config()
    # the step here takes the model's own loss (full logits), not TRL's fused LM head
    step = replace(Step.from_config(cfg, spec), fused_head=False)
    est = estimate_step(spec, step, None)
    rows = []
    for world in (1, 2):
        measured = measure_world(world)
        parts = est.components if world == 1 else per_rank_bytes(spec, cfg, world, "fsdp", est)
        print(f"planned N={world}:", {k: round(v / 2**20, 2) for k, v in parts.items()})
        planned = sum(parts.values())
        for rank, peak in enumerate(measured):
            err = (planned - peak) / peak
            rows.append((world, rank, peak, planned, err))
            print(f"world {world} rank {rank}: measured {peak / 2**20:.2f} MiB, "
                  f"planned {planned / 2**20:.2f} MiB ({err:+.1%})")  # fmt: skip
    if args.record and not args.smoke:  # a smoke figure is no result
        _record(spec.total_params, rows)
    return 0


def _record(params: int, rows: list[tuple[int, int, int, int, float]]) -> None:
    today = datetime.date.today().isoformat()
    cases = "; ".join(
        f"N={w} rank {r}: measured {m / 2**20:.1f} MiB, planned {p / 2**20:.1f} MiB ({e:+.1%})"
        for w, r, m, p, e in rows
    )
    line = (f"- {today}, {os.cpu_count()} shared CPU cores ({bench_env.describe()}), "
            f"torch {torch.__version__}: Qwen3-MoE "
            f"{params / 1e6:.1f} M params, full fine-tune fp32, seq {SEQ}, fused AdamW, "
            f"step 2 – {cases}\n")  # fmt: skip
    text = RESULTS.read_text() if RESULTS.exists() else ""
    if SECTION not in text:
        text += f"\n{SECTION}\n\n`python benchmarks/sharding_accuracy.py`\n\n"
    bench_env.write_results(RESULTS, text + line)


if __name__ == "__main__":
    sys.exit(main())
