"""Planner vs real CUDA memory: does the trace's peak match `torch.cuda.max_memory_allocated`?

For each case (Qwen3-30B-A3B at full size, randomly initialised on the GPU, and OLMoE-1B-7B)
the planner's estimates are computed – the fake-tensor trace of the step
(`plan.tracecache.cached_trace`, steady state: 2 steps, fused AdamW, TRL's fused LM head)
and the analytic formula (`plan.fit.analytic`) – and the same step is run for real:

1. build: the model as the trace builds it (`plan.trace._build` on the device, random init
   from the config, peft, split LoRA, NF4 experts quantised at build); cases that differ only
   in engine / sequence / checkpointing reuse one build (`apply_split_lora` /
   `restore_peft_lora` switch the engine, as benchmarks/experts_lora.py does);
2. warm-up: one step with a throw-away optimizer (Triton compiles TRL's LM-head kernels,
   cuBLAS takes its workspaces), then grads and optimizer state are freed;
3. measured pass: a fresh fused AdamW, 3 steps, each timed with `torch.cuda.synchronize()`
   and its `torch.cuda.max_memory_allocated()` read after `reset_peak_memory_stats()`.
   The trace counts the weights (parameters and buffers) plus everything the step
   allocates, so measured = max allocated − (allocated before step 1 − weight bytes): what
   else is allocated before the step (cuBLAS workspaces, the allocator's 512-byte rounding
   of the weights) is not in the trace, nor is the CUDA context in either. measured_bytes is
   the larger of steps 1 and 2 (the trace's 2 steps); step_s the median of the 3;
4. tracker pass: a fresh optimizer and 2 steps under `plan.tracker.ByteTracker` (the trace's
   own loop, `plan.trace._run_steps`), i.e. the trace's counting on real CUDA tensors with
   the real kernels: tracker − predicted isolates what fake tensors get wrong, measured −
   tracker what the allocator and untracked kernels add.

error = predicted / measured − 1 (goal |error| ≤ 3 %). Also recorded: max_memory_reserved
and the memory outside PyTorch (CUDA context) against the planner's overhead terms
(`plan.overhead`), and the analytic's error.

The traces run in CPU worker processes (spawned, one thread each, CUDA hidden) while the
GPU measures, so their 20–60 s each overlap the GPU work. Cases start only while the
expected time fits `--budget-s`; the JSON is rewritten after every case.

`--smoke` runs tiny versions of every case on the CPU in seconds: the measured pass then
has no allocator to read, so measured_bytes is the tracker's count of the real-tensor step
(what `trace_step(..., fake=False)` counts), which must equal the prediction byte for byte.
TRL's CPU fold of the LM head makes fp32 copies that its CUDA kernels do not, so on the CPU
the folds are the trace's in-place stand-ins (`plan.trace._in_place_folds`).

Expected H200 wall time (guesses, no GPU measured yet; each case's `expect_s`/`tracker_s`):
imports ~15 s; a 30B bf16 build (random init on the GPU, peft) ~10–30 s, OLMoE ~5 s; 30B steps
at 2k tokens ~0.5–1.5 s (launch-bound, ~40k aten ops; peft also moves every expert stack as
W+ΔW and a full-size weight gradient), 8k ~2 s; the first step JIT-compiles TRL's Triton
kernels (~10–20 s); tracker passes run every op through Python (~2–4× a step); NF4 dequantises
one expert at a time (~1.5 M ops, ~10–15 s a step), so its tracker pass (~100–150 s) runs only
if the budget still allows (a tracker pass starts only if max(tracker_s, 8 × step_s) fits).
All default cases: ~440 s if every guess holds, so with `--budget-s 420` the NF4 tracker pass
is the part left out; 30B NF4 goes last. The budget clock starts after the imports.
A device run: `--out $OUT --budget-s 420` with a 540 s timeout; then, on this machine,
`--record-from <files_at>/gpu_validate.json` appends the summary to RESULTS.md (the device's
copy of the tree does not come back).

    python benchmarks/gpu_validate.py [--out DIR] [--budget-s 420] [--cases a,b]
        [--results PATH | --no-record] [--jobs N] [--no-tracker] [--json] [--smoke]
    python benchmarks/gpu_validate.py --record-from gpu_validate.json [--results PATH]
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

GiB = 2**30
GOAL = 0.03  # |predicted / measured − 1|
RESULTS = Path(__file__).with_name("RESULTS.md")
RESULTS_HEADER = "# Benchmark results (every figure with its machine and date)\n"
SECTION = "## GPU validation: planner vs real CUDA memory (`benchmarks/gpu_validate.py`)"
ABOUT = (
    "`python benchmarks/gpu_validate.py`: the planner's trace (steady state, 2 steps, fused "
    "AdamW, TRL's fused LM head, batch 1, bf16, LoRA r=16 α=32 on attention + experts, "
    "explicit `target_parameters`) against the same step run on randomly initialised "
    "weights. measured = `torch.cuda.max_memory_allocated` over steps 1–2 minus what was "
    "allocated before the step besides the weights; error = predicted / measured − 1 (goal "
    "≤ 3 %); tracker = the trace's byte counting on the real CUDA step; reserved + context "
    "= `max_memory_reserved` + memory outside PyTorch, against the planner's required "
    "(peak + `plan.overhead`); step s = median of 3 steps after a warm-up."
)
QWEN, OLMOE = "Qwen/Qwen3-30B-A3B", "allenai/OLMoE-1B-7B-0924"
SMOKE_SEQ_DIVISOR = 64
# Tiny shapes of each family for --smoke (2 layers, 8 experts; NF4 blocks need in % 64 == 0).
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 8, "head_dim": 16, "num_key_value_heads": 2},
    "olmoe": {"num_experts": 8, "num_key_value_heads": 4},
}
SMOKE_COMMON = {
    "hidden_size": 64,
    "intermediate_size": 64,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_experts_per_tok": 2,
    "vocab_size": 512,
}


@dataclass(frozen=True)
class Case:
    """One step to validate: LoRA r on attention + experts of `model`, batch 1."""

    name: str
    model: str  # a bundled catalog id
    engine: str  # "peft" | "moetune"
    seq_len: int
    gc: bool = True
    experts_dtype: str = "bf16"
    double_quant: bool = False
    rank: int = 16
    mapping: str = "explicit"  # lora.expert_mapping; "automap" is vanilla peft's gate/up/down
    expect_s: float = 30.0  # H200 wall seconds: warm-up + 3 measured steps (no build)
    tracker_s: float = 10.0  # H200 wall seconds: 2 steps under the Python-level ByteTracker
    default: bool = True  # run when --cases is not given

    @property
    def group(self) -> tuple[Any, ...]:
        """Cases with the same group share one built model."""
        return (self.model, self.experts_dtype, self.double_quant, self.rank, self.mapping)

    def config(self, seq_len: int) -> Any:
        from moetune.config import parse_config

        return parse_config({
            "model": {"id": self.model, "experts_dtype": self.experts_dtype,
                      "experts_double_quant": self.double_quant},
            "lora": {"rank": self.rank, "targets": ["attention", "experts"],
                     "expert_mapping": self.mapping, "engine": self.engine},
            "train": {"seq_len": seq_len, "batch_size": 1, "gradient_checkpointing": self.gc},
        })  # fmt: skip


# Cheap and certain first, so a short budget still gets six; NF4 (the slowest) last.
# expect_s / tracker_s are H200 guesses (see the module docstring).
CASES = (
    Case("30b-peft-2k", QWEN, "peft", 2048, expect_s=40, tracker_s=12),  # + Triton JIT
    Case("30b-moetune-2k", QWEN, "moetune", 2048, expect_s=10, tracker_s=8),
    Case("30b-moetune-8k", QWEN, "moetune", 8192, expect_s=20, tracker_s=12),
    Case("30b-moetune-2k-nogc", QWEN, "moetune", 2048, gc=False, expect_s=8, tracker_s=6),
    Case("olmoe-peft-4k", OLMOE, "peft", 4096, expect_s=8, tracker_s=5),
    Case("olmoe-moetune-4k", OLMOE, "moetune", 4096, expect_s=6, tracker_s=4),
    # one expert dequantised at a time: ~1.5 M eager aten ops per step (launch-bound)
    Case("30b-moetune-nf4dq-2k", QWEN, "moetune", 2048, experts_dtype="nf4", double_quant=True,
         expect_s=70, tracker_s=150),
    # vanilla peft (names auto-mapped, gate_up rank 2r): plan.overhead's calibration step
    Case("30b-peft-automap-2k", QWEN, "peft", 2048, mapping="automap", expect_s=40,
         tracker_s=12, default=False),
)  # fmt: skip
_FRESH_HOOKS = "_gpu_validate_fresh_hooks"  # input-embedding hook ids right after the build
BUILD_S = {QWEN: 30.0, OLMOE: 8.0}  # H200 guess: random init of the bf16 weights on the GPU
NF4_BUILD_S = 15.0  # quantising 96 expert stacks on the GPU, on top of the bf16 build


# ---------------------------------------------------------------- predictions (CPU)


def spec_for(case: Case, smoke: bool) -> Any:
    from moetune.model import load_spec, spec_from_config

    spec = load_spec(case.model)
    if not smoke:
        return spec
    shape = {**SMOKE_COMMON, **SMOKE_SHAPES[spec.model_type]}
    return spec_from_config({**spec.hf_config, **shape}, f"{case.model} (smoke)")


def seq_for(case: Case, smoke: bool) -> int:
    return case.seq_len // SMOKE_SEQ_DIVISOR if smoke else case.seq_len


def predict(case: Case, smoke: bool) -> dict[str, Any]:
    """The planner's two estimates of `case` (the trace is cached on disk)."""
    from moetune.plan.fit import analytic
    from moetune.plan.overhead import overhead_for
    from moetune.plan.tracecache import cached_trace

    spec, cfg = spec_for(case, smoke), case.config(seq_for(case, smoke))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = cached_trace(spec, cfg)
    est = analytic(spec, cfg)
    return {
        "predicted_bytes": trace.peak_bytes,
        "predicted_peak": {"op": trace.peak_op, "phase": trace.peak_phase,
                           "step": trace.peak_step, "at_peak": trace.at_peak},
        "trace_s": round(trace.seconds, 1),
        "analytic_bytes": est.peak_bytes,
        "analytic_phase": est.peak_phase,
        "overhead_bytes": overhead_for("cuda", trace.peak_bytes).total,
        "trainable_params": trace.trainable_params,
        "total_params": trace.total_params,
    }  # fmt: skip


def _worker_init() -> None:
    """Trace workers: CPU only (no CUDA context on the measured GPU), one thread each."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")


class Predictions:
    """Predictions computed in spawned worker processes (jobs > 0) or inline when asked."""

    def __init__(self, cases: list[Case], smoke: bool, jobs: int) -> None:
        self.smoke = smoke
        self.pool: ProcessPoolExecutor | None = None
        self.futures: dict[str, Future[dict[str, Any]]] = {}
        if jobs > 0 and cases:
            import multiprocessing

            self.pool = ProcessPoolExecutor(
                min(jobs, len(cases)), multiprocessing.get_context("spawn"), _worker_init
            )
            self.futures = {c.name: self.pool.submit(predict, c, smoke) for c in cases}

    def get(self, case: Case) -> dict[str, Any]:
        future = self.futures.get(case.name)
        if future is not None:
            try:
                return future.result()
            except Exception as exc:  # a broken worker: trace here instead
                print(f"  trace worker failed ({type(exc).__name__}: {exc}); tracing inline")
        return predict(case, self.smoke)

    def close(self) -> None:
        """Drop predictions no case needs any more; end only this pool's own workers."""
        if self.pool is None:
            return
        busy = any(not f.done() for f in self.futures.values())
        processes = list(getattr(self.pool, "_processes", {}).values()) if busy else []
        self.pool.shutdown(wait=not busy, cancel_futures=True)
        for process in processes:  # a 30B trace still running would hold the exit
            process.terminate()


# ---------------------------------------------------------------- the real step


def build(case: Case, spec: Any, device: torch.device) -> Any:
    """The model exactly as the trace builds it (real tensors on `device`), fused LM head on."""
    from moetune.model import to_hf_config
    from moetune.plan import trace
    from moetune.recipe.targets import build_peft_config

    cfg = case.config(2048)
    peft_config = build_peft_config(spec, cfg.lora.model_copy(update={"dropout": 0.0}))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        experts = (case.experts_dtype, case.double_quant)
        model = trace._build(to_hf_config(spec), peft_config, torch.bfloat16, str(device),
                             False, case.engine, experts)  # fmt: skip
    trace._add_fused_head(model)
    embeddings = model.get_base_model().get_input_embeddings()
    model.__dict__[_FRESH_HOOKS] = set(embeddings._forward_hooks)
    return model


def configure(model: Any, case: Case) -> None:
    """Switch a built model to `case`'s engine and checkpointing, as a fresh build has them."""
    from moetune.engine import apply_split_lora, restore_peft_lora
    from moetune.engine.experts_lora import is_split
    from moetune.plan import trace

    if case.engine == "moetune" and not is_split(model):
        apply_split_lora(model)
    elif case.engine == "peft" and is_split(model):
        restore_peft_lora(model)
    base = model.get_base_model()
    disable = getattr(base, "activation_checkpointing_disable", None)
    (disable or base.gradient_checkpointing_disable)()
    # Enabling twice (transformers' enable, then peft/TRL's) registers two input-grad hooks
    # and forgets the first, so disabling leaves one: drop every hook a fresh build lacks.
    embeddings = base.get_input_embeddings()
    for key in set(embeddings._forward_hooks) - model.__dict__[_FRESH_HOOKS]:
        for hooks in (embeddings._forward_hooks, embeddings._forward_hooks_with_kwargs,
                      embeddings._forward_hooks_always_called):  # fmt: skip
            hooks.pop(key, None)
    trace._prepare_for_training(model, False, case.gc)


def weight_bytes(model: Any) -> int:
    """Bytes of the distinct parameter and buffer storages (what the trace registers)."""
    storages = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _loop(model: Any, seq: int, device: torch.device) -> Any:
    from moetune.plan import trace

    return trace._Loop(model, "fused", (1, seq), str(device), True)


def one_step(loop: Any) -> float:
    """`plan.trace._run_steps`' step without the tracker; returns the loss."""
    loss = loop.loss()
    loss.backward()
    value = float(loss.detach())
    del loss
    loop.optimizer.step()
    loop.optimizer.zero_grad(set_to_none=True)
    return value


def warm_up(model: Any, seq: int, device: torch.device) -> float:
    start = time.perf_counter()
    one_step(_loop(model, seq, device))  # its optimizer state dies with the loop
    _sync(device)
    _free(device)
    return time.perf_counter() - start


def measured_pass(model: Any, seq: int, device: torch.device, weights: int) -> dict[str, Any]:
    """3 timed steps with a fresh optimizer; per-step CUDA peaks (see the module docstring)."""
    cuda = device.type == "cuda"
    loop = _loop(model, seq, device)
    _sync(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    leftover = max(0, before - weights)
    times, losses, peaks, reserved = [], [], [], []
    for _ in range(3):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        losses.append(one_step(loop))
        _sync(device)
        times.append(time.perf_counter() - start)
        if cuda:
            peaks.append(torch.cuda.max_memory_allocated(device) - leftover)
            reserved.append(torch.cuda.max_memory_reserved(device))
    out: dict[str, Any] = {
        "step_s": round(statistics.median(times), 4),
        "step_times_s": [round(t, 4) for t in times],
    }
    if cuda:  # (on the CPU the LM-head folds are stand-ins: no meaningful loss)
        free, total = torch.cuda.mem_get_info(device)
        out |= {
            "loss": losses,
            "measured_bytes": max(peaks[:2]),
            "peak_steps_bytes": peaks,
            "allocated_before_bytes": before,
            "leftover_bytes": leftover,
            "max_reserved_bytes": max(reserved[:2]),
            "non_torch_bytes": total - free - torch.cuda.memory_reserved(device),
        }
    del loop
    _free(device)
    return out


def tracker_pass(model: Any, seq: int, device: torch.device, weights: int) -> dict[str, Any]:
    """2 steps of the trace's own loop under ByteTracker, on the real tensors."""
    from moetune.plan import trace
    from moetune.plan.tracker import ByteTracker

    cuda = device.type == "cuda"
    loop = _loop(model, seq, device)
    tracker = ByteTracker()
    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        leftover = max(0, torch.cuda.memory_allocated(device) - weights)
    start = time.perf_counter()
    trace._run_steps(tracker, loop, 2)
    _sync(device)
    out: dict[str, Any] = {
        "tracker_bytes": tracker.peak.bytes,
        "tracker_peak": {"op": tracker.peak.op, "phase": tracker.peak.phase,
                         "step": tracker.peak.step, "at_peak": tracker.at_peak()},
        "tracker_s": round(time.perf_counter() - start, 2),
    }  # fmt: skip
    if cuda:
        out["measured_under_tracker_bytes"] = torch.cuda.max_memory_allocated(device) - leftover
    del loop, tracker
    _free(device)
    return out


def run_case(
    model: Any, case: Case, seq: int, device: torch.device, tracker: Callable[[float], bool]
) -> dict[str, Any]:
    """Warm-up, measured pass and (when `tracker(step_s)` says so) tracker pass, on `model`
    switched to `case`."""
    from moetune.plan import trace

    configure(model, case)
    model.zero_grad(set_to_none=True)  # a failed case before may have left grads
    weights = weight_bytes(model)
    config = model.get_base_model().config
    out: dict[str, Any] = {"weight_bytes": weights,
                           "attn_implementation": config._attn_implementation,
                           "experts_implementation": config._experts_implementation}  # fmt: skip
    with trace._in_place_folds(device.type != "cuda"):  # CPU: TRL's folds copy, CUDA's don't
        out["warm_up_s"] = round(warm_up(model, seq, device), 2)
        out |= measured_pass(model, seq, device, weights)
        if device.type != "cuda":  # no allocator to read: the tracker's real-tensor count
            out |= tracker_pass(model, seq, device, weights)
            out["measured_bytes"] = out["tracker_bytes"]
        elif tracker(out["step_s"]):
            try:  # the measurement stands without it
                out |= tracker_pass(model, seq, device, weights)
            except Exception as exc:
                out["tracker_failed"] = f"{type(exc).__name__}: {exc}"
                del exc
                _free(device)
    return out


def compare(case: Case, seq: int, pred: dict[str, Any], meas: dict[str, Any]) -> dict[str, Any]:
    """One JSON row: both estimates, the measurements, and their relative errors."""
    measured = meas["measured_bytes"]
    row: dict[str, Any] = {"case": case.name, "status": "ok", **asdict(case), "seq_len": seq}
    row |= pred | meas
    row["error"] = pred["predicted_bytes"] / measured - 1
    row["analytic_error"] = pred["analytic_bytes"] / measured - 1
    row["within_goal"] = abs(row["error"]) <= GOAL
    row["tokens_per_s"] = round(seq / meas["step_s"], 1)
    if "tracker_bytes" in meas:
        row["tracker_error"] = pred["predicted_bytes"] / meas["tracker_bytes"] - 1
    if "max_reserved_bytes" in meas:  # what the card must hold vs the planner's required
        need = meas["max_reserved_bytes"] + meas["non_torch_bytes"]
        row["required_measured_bytes"] = need
        row["required_predicted_bytes"] = pred["predicted_bytes"] + pred["overhead_bytes"]
        row["required_error"] = row["required_predicted_bytes"] / need - 1
    return row


# ---------------------------------------------------------------- the run


@dataclass
class Run:
    """Where the run stands: rows so far, the clock, where the JSON goes."""

    args: argparse.Namespace
    device: torch.device
    out: Path
    start: float
    rows: list[dict[str, Any]]

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def fits(self, seconds: float) -> bool:
        """Whether work expected to take `seconds` on an H200 ends within the budget."""
        return self.elapsed + (0 if self.args.smoke else seconds) <= self.args.budget_s

    def wants_tracker(self, case: Case, step_s: float) -> bool:
        """Tracker pass: 2 steps, every op through Python (guessed ~4x an eager step)."""
        return not self.args.no_tracker and self.fits(max(case.tracker_s, 8 * step_s))

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        err = f"error {100 * row['error']:+.2f} %" if row["status"] == "ok" else row["status"]
        print(f"[{self.elapsed:6.1f} s] {row['case']}: {err} {row.get('reason', '')}".rstrip())
        write_json(self.out, report(self))


def grouped(cases: list[Case]) -> Iterator[list[Case]]:
    """Cases by build, in the order their groups first appear."""
    groups: dict[tuple, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.group, []).append(case)
    yield from groups.values()


def build_seconds(case: Case) -> float:
    return BUILD_S.get(case.model, 30.0) + (NF4_BUILD_S if case.experts_dtype != "bf16" else 0)


def run_group(run: Run, cases: list[Case], predictions: Predictions) -> None:
    """Build once, then each case that still fits the budget; failures are rows too."""
    model, build_error, build_s = None, "", 0.0
    for case in cases:
        seq = seq_for(case, run.args.smoke)
        need = case.expect_s + (build_seconds(case) if model is None and not build_error else 0)
        if build_error or not run.fits(need):
            reason = build_error or f"budget: {run.elapsed:.0f} s used, ~{need:.0f} s expected"
            run.add({"case": case.name, "status": "skipped", "reason": reason})
            continue
        try:
            if model is None:
                spec = spec_for(case, run.args.smoke)
                start = time.perf_counter()
                model = build(case, spec, run.device)
                _sync(run.device)
                build_s = round(time.perf_counter() - start, 1)
            wants = functools.partial(run.wants_tracker, case)
            meas = run_case(model, case, seq, run.device, wants)
            row = compare(case, seq, predictions.get(case), {**meas, "build_s": build_s})
        except Exception as exc:  # OOM or a broken path: record it, go on with the rest
            row = {"case": case.name, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            if model is None:
                build_error = f"build failed: {row['reason']}"
            del exc
            _free(run.device)
        run.add(row)
    del model
    _free(run.device)


def machine(device: torch.device) -> dict[str, Any]:
    from transformers.utils import is_triton_available

    names = ("torch", "transformers", "peft", "trl")
    info: dict[str, Any] = {n: metadata.version(n) for n in names}
    info |= {"host": f"{platform.machine()} {platform.system()}, {os.cpu_count()} cores",
             "date": datetime.date.today().isoformat(),
             "triton": is_triton_available()}  # fmt: skip
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        info |= {"device": torch.cuda.get_device_name(device), "cuda": torch.version.cuda,
                 "device_memory_gib": round(total / GiB, 1),
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}  # fmt: skip
    else:
        info["device"] = "cpu"
    return info


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["status"] == "ok"]
    out: dict[str, Any] = {"cases": len(rows), "ok": len(ok), "goal": GOAL,
                           "within_goal": sum(r["within_goal"] for r in ok)}  # fmt: skip
    if ok:
        worst = max(ok, key=lambda r: abs(r["error"]))
        out |= {"worst_error": worst["error"], "worst_case": worst["case"],
                "mean_abs_error": statistics.fmean(abs(r["error"]) for r in ok)}  # fmt: skip
    return out


def report(run: Run) -> dict[str, Any]:
    return {"smoke": run.args.smoke, "wall_s": round(run.elapsed, 1),
            "budget_s": run.args.budget_s, "machine": machine(run.device),
            "summary": summary(run.rows), "cases": run.rows}  # fmt: skip


def write_json(out: Path, data: dict[str, Any]) -> Path:
    """Atomically (temp file + rename), so a run killed mid-case leaves the cases before it."""
    return _write(out / "gpu_validate.json", json.dumps(data, indent=2, default=str) + "\n")


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return path


# ---------------------------------------------------------------- RESULTS.md


def table(rows: list[dict[str, Any]], smoke: bool = False) -> str:
    unit, size = ("MiB", 2**20) if smoke else ("GiB", GiB)

    def mem(n: float | None) -> str:
        return "–" if n is None else f"{n / size:.2f}"

    def pct(x: float | None) -> str:
        return "–" if x is None else f"{100 * x:+.1f} %"

    lines = [f"| case | predicted {unit} | measured {unit} | error | tracker {unit} | analytic "
             f"error | reserved + context {unit} | planner required {unit} | step s |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['case']} | {r['status']}: {r.get('reason', '')} | | | | | | | |")
            continue
        lines.append(
            f"| {r['case']} | {mem(r['predicted_bytes'])} | {mem(r['measured_bytes'])} | "
            f"{pct(r['error'])} | {mem(r.get('tracker_bytes'))} | {pct(r['analytic_error'])} | "
            f"{mem(r.get('required_measured_bytes'))} | {mem(r.get('required_predicted_bytes'))} "
            f"| {r['step_s']} |"
        )
    return "\n".join(lines) + "\n"


def markdown(data: dict[str, Any]) -> str:
    """A dated line and the case table: what goes under this benchmark's section."""
    m, s = data["machine"], data["summary"]
    cuda = f" (CUDA {m['cuda']})" if m.get("cuda") else ""
    where = (f"{m['device']} · torch {m['torch']}{cuda}, transformers {m['transformers']}, "
             f"peft {m['peft']}, trl {m['trl']}")  # fmt: skip
    worst = (f", worst error {100 * s['worst_error']:+.2f} % ({s['worst_case']}), mean |error| "
             f"{100 * s['mean_abs_error']:.2f} %" if s["ok"] else "")  # fmt: skip
    smoke = " · --smoke (tiny models)" if data["smoke"] else ""
    line = (f"- {m['date']} · {where}{smoke} · {s['ok']}/{s['cases']} cases ran{worst}, "
            f"{s['within_goal']}/{s['ok']} within {100 * GOAL:.0f} %; "
            f"{data['wall_s']} s wall")  # fmt: skip
    return f"{line}\n\n{table(data['cases'], data['smoke'])}"


def record(path: Path, data: dict[str, Any]) -> None:
    """Append the run's block at the end of this benchmark's section (made if missing)."""
    text = path.read_text() if path.exists() else RESULTS_HEADER
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{ABOUT}\n"
    head, _, tail = text.partition(SECTION)
    body, sep, rest = tail.partition("\n## ")
    after = f"\n## {rest}" if sep else ""
    _write(path, f"{head}{SECTION}{body.rstrip()}\n\n{markdown(data)}{after}")


# ---------------------------------------------------------------- entry


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = [c.name for c in CASES]
    default = ",".join(c.name for c in CASES if c.default)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cases", default=default, help=f"comma list of: {', '.join(names)} (default: {default})"
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="start no case expected to end after this many seconds (default 420)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="gpu_validate.json and .md go here (default $OUT or ./gpu_validate_out)",
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=None,
        help="append the summary here (default benchmarks/RESULTS.md; --smoke "
        "appends only when given)",
    )
    ap.add_argument("--no-record", action="store_true", help="append to no results file")
    ap.add_argument(
        "--record-from",
        type=Path,
        default=None,
        metavar="JSON",
        help="append a finished run's gpu_validate.json to --results, run nothing "
        "(the device machine's copy of RESULTS.md does not come back)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="trace worker processes (default: cores − 2; --smoke: 0 = inline)",
    )
    ap.add_argument(
        "--no-tracker", action="store_true", help="skip the ByteTracker pass on the real CUDA step"
    )
    ap.add_argument("--json", action="store_true", help="print the whole JSON at the end")
    ap.add_argument("--smoke", action="store_true", help="tiny models on the CPU (seconds)")
    args = ap.parse_args(argv)
    unknown = set(args.cases.split(",")) - set(names)
    if unknown:
        ap.error(f"unknown case(s) {', '.join(sorted(unknown))}; choose from {', '.join(names)}")
    return args


def record_from(args: argparse.Namespace) -> int:
    data = json.loads(args.record_from.read_text())
    if not data["summary"]["ok"]:
        print(f"gpu_validate: {args.record_from} has no finished case; nothing recorded.")
        return 1
    results = args.results or RESULTS
    record(results, data)
    print(f"appended {data['summary']['ok']} case(s) to {results}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.record_from is not None:
        return record_from(args)
    start = time.perf_counter()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_validate: CUDA is not available here; run it on a GPU machine, or pass --smoke "
              "for the CPU check.", file=sys.stderr)  # fmt: skip
        return 2
    device = torch.device("cpu" if args.smoke else "cuda")
    out = args.out or Path(os.environ.get("OUT") or "gpu_validate_out")
    wanted = args.cases.split(",")
    cases = [c for c in CASES if c.name in wanted]
    cores = os.cpu_count() or 1
    jobs = args.jobs if args.jobs is not None else (0 if args.smoke else max(1, cores - 2))
    run = Run(args, device, out, start, [])
    threads = torch.get_num_threads()
    if args.smoke:
        torch.set_num_threads(1)  # tiny steps: threads only contend on a shared machine
    predictions = Predictions(cases, args.smoke, jobs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft calls renamed transformers APIs
            for group in grouped(cases):
                run_group(run, group, predictions)
    finally:
        predictions.close()
        torch.set_num_threads(threads)
    return finish(run)


def finish(run: Run) -> int:
    """Final JSON and markdown under --out; the summary appended to the results file."""
    args, data = run.args, report(run)
    path = write_json(run.out, data)
    _write(run.out / "gpu_validate.md", markdown(data))
    results = None if args.no_record else args.results or (None if args.smoke else RESULTS)
    if not data["summary"]["ok"]:
        results = None  # nothing finished: nothing to record
    if results is not None:
        record(results, data)
    print(json.dumps(data, indent=2, default=str) if args.json else markdown(data))
    print(f"wrote {path}" + (f"; appended to {results}" if results else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
