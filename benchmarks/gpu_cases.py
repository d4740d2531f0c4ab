"""gpu_validate.py's cases, the planner's predictions of them, and the real step.

A group of cases shares one build (`plan.trace.build_step_model` on the device: random init
from the config, peft, split LoRA, NF4 experts quantised at build); its cases differ only in
engine / sequence / checkpointing and switch that build (`apply_split_lora` /
`restore_peft_lora`, as benchmarks/experts_lora.py does). Each case then runs a warm-up step
with a throw-away optimizer (Triton compiles TRL's LM-head kernels, cuBLAS takes its
workspaces), a measured pass (a fresh fused AdamW, 3 steps, each timed with
`torch.cuda.synchronize()` and its peak read after `reset_peak_memory_stats()`) and a tracker
pass: 2 steps of the trace's own loop (`plan.trace.run_steps`) under `ByteTracker` on the real
tensors and kernels. tracker − predicted isolates what fake tensors get wrong, measured −
tracker what the allocator and untracked kernels add.

The trace counts the weights (parameters and buffers) plus everything the step allocates, so
measured = max allocated − (allocated before step 1 − weight bytes): what else is allocated
before the step (cuBLAS workspaces, the allocator's 512-byte rounding of the weights) is not in
the trace, nor is the CUDA context in either. measured_bytes is the larger of steps 1 and 2
(the trace's 2 steps); step_s the median of the 3.

Expected H200 wall time (guesses, no GPU measured yet; each case's `expect_s`/`tracker_s`):
imports ~15 s; a 30B bf16 build (random init on the GPU, peft) ~10–30 s, OLMoE ~5 s; 30B steps
at 2k tokens ~0.5–1.5 s (launch-bound, ~40k aten ops; peft also moves every expert stack as
W+ΔW and a full-size weight gradient), 8k ~2 s; the first step JIT-compiles TRL's Triton
kernels (~10–20 s); tracker passes run every op through Python (~2–4× a step); NF4 dequantises
one expert at a time (~1.5 M ops, ~10–15 s a step), so its tracker pass (~100–150 s) runs only
if the budget still allows. OLMoE with its expert stacks offloaded to pinned host RAM
(engine/offload/store.py) builds like OLMoE, then copies 12.9 GB of stacks to the host (~20 s) and
streams ~2 × 12.9 GB per step over PCIe (~1 s a step at 25–50 GB/s); its row compares
`moetune.plan.offload.memory`'s device peak (when that module exists, else "plan: n/a") with
max_memory_allocated, and carries the store's counts (peak resident expert bytes, bytes moved
per phase); no tracker pass (the copies run on a side thread). All default cases: ~500 s if
every guess holds, so with `--budget-s 420` the NF4 tracker pass and, if NF4 ran long, the
offload case (its own build, after NF4) are what the budget leaves out.

Stored bases (`Case.stored`: "fp8", "mxfp4"): a random bf16 Qwen3-MoE / gpt-oss of
STORED_SHAPES (6 layers, 32 experts, hidden 1024; ~0.5 B params) saved on the CPU, rewritten by
`engine.stored.write.write_stored` in the published layout (block FP8 128x128, MXFP4 experts)
and loaded by `engine.stored.load.load_stored` with the stacks as stored on the device (what
`moetune train` does for such a base), then peft + split LoRA as the other builds; the plan is
the trace (or, where the trace cannot build the stored base, the analytic: `predicted_from`)
of the same shape with the checkpoint's quantization_config. ~30 s to build (CPU work, guess)
+ ~25 s of steps each; they run before NF4, so a tight budget drops NF4 first.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

QWEN, OLMOE, GPT_OSS = "Qwen/Qwen3-30B-A3B", "allenai/OLMoE-1B-7B-0924", "openai/gpt-oss-20b"
SMOKE_SEQ_DIVISOR = 64
# Tiny shapes of each family for --smoke (2 layers, 8 experts; NF4 blocks need in % 64 == 0).
SMOKE_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"num_experts": 8, "head_dim": 16, "num_key_value_heads": 2},
    "olmoe": {"num_experts": 8, "num_key_value_heads": 4},
    "gpt_oss": {"num_local_experts": 8, "head_dim": 16, "num_key_value_heads": 2,
                "layer_types": ["sliding_attention", "full_attention"]},
}  # fmt: skip
# Stored (published-layout) bases: tiny but not trivial on the GPU – a few layers, block sizes
# that divide (fp8 128x128, mxfp4 32) – written from a random float checkpoint by
# engine.stored.write and loaded by engine.stored.load (expert stacks as stored).
STORED_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3_moe": {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 768,
                  "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
                  "num_experts": 32, "num_local_experts": 32, "num_experts_per_tok": 8,
                  "num_hidden_layers": 6, "vocab_size": 32768},
    "gpt_oss": {"hidden_size": 1024, "intermediate_size": 768, "num_attention_heads": 16,
                "num_key_value_heads": 4, "head_dim": 64, "num_local_experts": 32,
                "num_experts_per_tok": 4, "num_hidden_layers": 6, "vocab_size": 32768,
                "layer_types": ["sliding_attention", "full_attention"] * 3},
}  # fmt: skip
SPECIAL_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
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
    offload: str = "none"  # train.offload: expert stacks streamed from host RAM or disk
    stored: str = ""  # a published format (fp8, mxfp4): the base written and loaded as stored

    @property
    def group(self) -> tuple[Any, ...]:
        """Cases with the same group share one built model."""
        return (self.model, self.experts_dtype, self.double_quant, self.rank, self.mapping,
                self.offload, self.stored)  # fmt: skip

    def config(self, seq_len: int) -> Any:
        from moetune.config import parse_config

        return parse_config({
            "model": {"id": self.model, "experts_dtype": self.experts_dtype,
                      "experts_double_quant": self.double_quant},
            "lora": {"rank": self.rank, "targets": ["attention", "experts"],
                     "expert_mapping": self.mapping, "engine": self.engine},
            "train": {"seq_len": seq_len, "batch_size": 1, "gradient_checkpointing": self.gc,
                      "offload": self.offload},
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
    # stored bases (STORED_SHAPES: 6 layers, 32 experts, hidden 1024): block-FP8 Qwen3-MoE and
    # MXFP4 gpt-oss, each expert dequantised alone in the split forward and backward
    Case("qwen3-fp8-stored-2k", QWEN, "moetune", 2048, stored="fp8", expect_s=25, tracker_s=40),
    Case("gptoss-mxfp4-stored-2k", GPT_OSS, "moetune", 2048, stored="mxfp4", expect_s=25,
         tracker_s=40),
    # one expert dequantised at a time: ~1.5 M eager aten ops per step (launch-bound)
    Case("30b-moetune-nf4dq-2k", QWEN, "moetune", 2048, experts_dtype="nf4", double_quant=True,
         expect_s=70, tracker_s=150),
    # expert stacks in pinned host RAM, one layer (+1 prefetched) on the GPU: OLMoE's 12.9 GB
    # of stacks, ~2 × 12.9 GB over PCIe per step; no tracker pass (its copies run on a thread)
    Case("olmoe-moetune-offload-cpu-4k", OLMOE, "moetune", 4096, offload="cpu", expect_s=25,
         tracker_s=0),
    # the disk reader of engine/direct_io.py (pinned staging, a CUDA stream per reader worker)
    Case("olmoe-moetune-offload-disk-4k", OLMOE, "moetune", 4096, offload="disk", expect_s=90,
         tracker_s=0),
    # vanilla peft (names auto-mapped, gate_up rank 2r): plan.overhead's calibration step
    Case("30b-peft-automap-2k", QWEN, "peft", 2048, mapping="automap", expect_s=40,
         tracker_s=12, default=False),
)  # fmt: skip
_FRESH_HOOKS = "_gpu_validate_fresh_hooks"  # input-embedding hook ids right after the build
BUILD_S = {QWEN: 30.0, OLMOE: 8.0}  # H200 guess: random init of the bf16 weights on the GPU
NF4_BUILD_S = 15.0  # quantising 96 expert stacks on the GPU, on top of the bf16 build
OFFLOAD_BUILD_S = 20.0  # copying the stacks into pinned host RAM (or a scratch file)
STORED_BUILD_S = 30.0  # random init on the CPU, save, write_stored, load_stored (~1 GB)


# ---------------------------------------------------------------- predictions (CPU)


def spec_for(case: Case, smoke: bool) -> Any:
    from moetune.model import load_spec, spec_from_config

    spec = load_spec(case.model)
    if not smoke and not case.stored:
        return spec
    if case.stored:  # the shape written, its quantization_config as the checkpoint has it
        tiny = {**SMOKE_COMMON, **SMOKE_SHAPES[spec.model_type], "num_local_experts": 8}
        shape = tiny if smoke else STORED_SHAPES[spec.model_type]
        shape = {**shape, **SPECIAL_IDS, "quantization_config": stored_config(case, smoke)}
        return spec_from_config({**spec.hf_config, **shape}, f"{case.model} ({case.stored})")
    shape = {**SMOKE_COMMON, **SMOKE_SHAPES[spec.model_type]}
    return spec_from_config({**spec.hf_config, **shape}, f"{case.model} (smoke)")


def stored_options(case: Case, smoke: bool) -> dict[str, Any]:
    """write_stored's options: the smoke shape's 64-wide Linears take 32x32 FP8 blocks."""
    return {"block": (32, 32)} if smoke and case.stored == "fp8" else {}


def stored_config(case: Case, smoke: bool) -> dict[str, Any]:
    from moetune.engine.quant.stacks import QUANTIZERS

    return QUANTIZERS.get(case.stored).config(**stored_options(case, smoke))


def seq_for(case: Case, smoke: bool) -> int:
    return case.seq_len // SMOKE_SEQ_DIVISOR if smoke else case.seq_len


def predict(case: Case, smoke: bool) -> dict[str, Any]:
    """The planner's two estimates of `case` (the trace is cached on disk)."""
    if case.offload != "none":
        return predict_offload(case, smoke)
    from moetune.plan.fit import analytic
    from moetune.plan.overhead import overhead_for
    from moetune.plan.trace.cache import cached_trace

    spec, cfg = spec_for(case, smoke), case.config(seq_for(case, smoke))
    est = analytic(spec, cfg)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trace = cached_trace(spec, cfg)
    except Exception as exc:  # a stored base the trace does not build yet: the analytic stands
        if not case.stored:
            raise
        return {"predicted_bytes": est.peak_bytes, "predicted_from": "analytic",
                "trace_failed": f"{type(exc).__name__}: {exc}", "analytic_bytes": est.peak_bytes,
                "analytic_phase": est.peak_phase, "overhead_bytes": None,
                "trainable_params": None, "total_params": None}  # fmt: skip
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


def predict_offload(case: Case, smoke: bool) -> dict[str, Any]:
    """moetune.plan.offload.memory's device peak and step time, where that module exists (None:
    "plan: n/a" – the row then has measurements and no error)."""
    try:
        from moetune.plan.offload.memory import plan_offload
    except ImportError:
        return {"predicted_bytes": None, "analytic_bytes": None, "plan": "n/a"}
    from moetune.plan.hardware import card_for_device

    card = None if smoke else card_for_device(torch.cuda.get_device_name())
    plan = plan_offload(spec_for(case, smoke), case.config(seq_for(case, smoke)), card=card)
    keys = ("device_peak_bytes", "host_ram_bytes", "disk_bytes", "bytes_moved_per_step",
            "step_time_s")  # fmt: skip
    figures = {k: getattr(plan, k, None) for k in keys}
    return {"predicted_bytes": figures["device_peak_bytes"], "analytic_bytes": None,
            "plan": figures}  # fmt: skip


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
    from moetune.plan.trace.fake_step import add_fused_head, build_step_model
    from moetune.recipe.targets import build_peft_config

    cfg = case.config(2048)
    peft_config = build_peft_config(spec, cfg.lora.model_copy(update={"dropout": 0.0}))
    if case.stored:
        return build_stored(case, spec, peft_config, device)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        experts = (case.experts_dtype, case.double_quant, {})  # no format options (NF4 / int8)
        model = build_step_model(to_hf_config(spec), peft_config, torch.bfloat16, str(device),
                                 False, case.engine, experts)  # fmt: skip
    add_fused_head(model)
    if case.offload != "none":  # the stacks leave the device for the store
        offload(model, case, device)
    embeddings = model.get_base_model().get_input_embeddings()
    model.__dict__[_FRESH_HOOKS] = set(embeddings._forward_hooks)
    return model


def build_stored(case: Case, spec: Any, peft_config: Any, device: torch.device) -> Any:
    """A random float checkpoint of `spec`'s shape (CPU), rewritten in the published layout
    (engine.stored.write), loaded with its expert stacks as stored (engine.stored.load) on
    `device`, then LoRA and the split engine as build_step_model puts them on."""
    import tempfile

    from peft import get_peft_model

    from moetune.engine import IMPLEMENTATION, apply_split_lora, register
    from moetune.engine.forwards import apply_overrides
    from moetune.engine.quant.stacks import peft_targets
    from moetune.engine.stored.load import load_stored
    from moetune.engine.stored.write import write_stored
    from moetune.model import to_hf_config
    from moetune.model.derive import causal_lm_class
    from moetune.plan.trace.fake_step import add_fused_head

    smoke = device.type != "cuda"
    hf_config = to_hf_config(spec)
    hf_config.__dict__.pop("quantization_config", None)  # the float source has none
    root = Path(tempfile.mkdtemp(prefix="gpu-validate-stored-"))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        float_model = causal_lm_class(hf_config)._from_config(hf_config, dtype=torch.bfloat16)
        float_model.save_pretrained(root / "float")
        del float_model
        write_stored(root / "float", root / "stored", case.stored,
                     **stored_options(case, smoke))  # fmt: skip
        model, report = load_stored(root / "stored", device, torch.bfloat16)
        register()
        model.set_experts_implementation(IMPLEMENTATION)
        with peft_targets(model):
            model = get_peft_model(model, peft_config)
        apply_overrides(model)
        apply_split_lora(model)
    model.__dict__["_gpu_validate_stored"] = report.to_json()
    add_fused_head(model)
    embeddings = model.get_base_model().get_input_embeddings()
    model.__dict__[_FRESH_HOOKS] = set(embeddings._forward_hooks)
    return model


def offload(model: Any, case: Case, device: torch.device) -> None:
    import tempfile

    from moetune.engine.offload.store import offload_experts_

    scratch = Path(tempfile.mkdtemp(prefix="gpu-validate-")) / "experts.bin"
    offload_experts_(model.get_base_model(), case.offload, device, scratch=scratch)  # type: ignore[arg-type]


def offload_stats(model: Any) -> dict[str, Any] | None:
    """The store's measurements (peak resident expert bytes, bytes moved per phase)."""
    from moetune.engine.offload.store import store_of

    store = store_of(model)
    return store.stats.to_json() if store is not None else None


def release_offloaded(model: Any) -> None:
    """Drop the layers a step left materialised, so they are not counted as weights."""
    from moetune.engine.offload.store import store_of

    store = store_of(model)
    if store is not None:
        store.release()
        store.reset_peak()


def configure(model: Any, case: Case) -> None:
    """Switch a built model to `case`'s engine and checkpointing, as a fresh build has them."""
    from moetune.engine import apply_split_lora, restore_peft_lora
    from moetune.engine.experts_lora import is_split
    from moetune.plan.trace.fake_step import prepare_for_training

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
    prepare_for_training(model, False, case.gc)


def weight_bytes(model: Any) -> int:
    """Bytes of the distinct parameter and buffer storages (what the trace registers)."""
    storages = {}
    for tensor in (*model.parameters(), *model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _loop(model: Any, seq: int, device: torch.device) -> Any:
    from moetune.plan.trace.fake_step import TrainLoop

    return TrainLoop(model, "fused", (1, seq), str(device), True)


def one_step(loop: Any) -> float:
    """`plan.trace.run_steps`' step without the tracker; returns the loss."""
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
    sync_device(device)
    release_offloaded(model)
    free_memory(device)
    return time.perf_counter() - start


def measured_pass(model: Any, seq: int, device: torch.device, weights: int) -> dict[str, Any]:
    """3 timed steps with a fresh optimizer; per-step CUDA peaks (see the module docstring)."""
    cuda = device.type == "cuda"
    loop = _loop(model, seq, device)
    sync_device(device)
    before = torch.cuda.memory_allocated(device) if cuda else 0
    leftover = max(0, before - weights)
    times, losses, peaks, reserved = [], [], [], []
    for _ in range(3):
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        losses.append(one_step(loop))
        sync_device(device)
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
    free_memory(device)
    return out


def tracker_pass(model: Any, seq: int, device: torch.device, weights: int) -> dict[str, Any]:
    """2 steps of the trace's own loop under ByteTracker, on the real tensors."""
    from moetune.plan.trace.bytes import ByteTracker
    from moetune.plan.trace.fake_step import run_steps

    cuda = device.type == "cuda"
    loop = _loop(model, seq, device)
    tracker = ByteTracker()
    sync_device(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        leftover = max(0, torch.cuda.memory_allocated(device) - weights)
    start = time.perf_counter()
    run_steps(tracker, loop, 2)
    sync_device(device)
    out: dict[str, Any] = {
        "tracker_bytes": tracker.peak.bytes,
        "tracker_peak": {"op": tracker.peak.op, "phase": tracker.peak.phase,
                         "step": tracker.peak.step, "at_peak": tracker.at_peak()},
        "tracker_s": round(time.perf_counter() - start, 2),
    }  # fmt: skip
    if cuda:
        out["measured_under_tracker_bytes"] = torch.cuda.max_memory_allocated(device) - leftover
    del loop, tracker
    free_memory(device)
    return out


def run_case(
    model: Any, case: Case, seq: int, device: torch.device, tracker: Callable[[float], bool]
) -> dict[str, Any]:
    """Warm-up, measured pass and (when `tracker(step_s)` says so) tracker pass, on `model`
    switched to `case`."""
    from moetune.plan.trace.fake_step import in_place_folds

    configure(model, case)
    model.zero_grad(set_to_none=True)  # a failed case before may have left grads
    weights = weight_bytes(model)
    config = model.get_base_model().config
    out: dict[str, Any] = {"weight_bytes": weights,
                           "attn_implementation": config._attn_implementation,
                           "experts_implementation": config._experts_implementation}  # fmt: skip
    if "_gpu_validate_stored" in model.__dict__:  # what load_stored kept as stored
        out["stored"] = model.__dict__["_gpu_validate_stored"]
    with in_place_folds(device.type != "cuda"):  # CPU: TRL's folds copy, CUDA's don't
        out["warm_up_s"] = round(warm_up(model, seq, device), 2)
        out |= measured_pass(model, seq, device, weights)
        if case.offload != "none":  # the store counts what it streamed
            out["offload_stats"] = offload_stats(model)
            # CPU (no allocator): the resident weights + the store's peak of streamed stacks
            out.setdefault("measured_bytes", weights + out["offload_stats"]["peak_resident_bytes"])
        elif device.type != "cuda":  # no allocator to read: the tracker's real-tensor count
            out |= tracker_pass(model, seq, device, weights)
            out["measured_bytes"] = out["tracker_bytes"]
        elif tracker(out["step_s"]):
            try:  # the measurement stands without it
                out |= tracker_pass(model, seq, device, weights)
            except Exception as exc:
                out["tracker_failed"] = f"{type(exc).__name__}: {exc}"
                del exc
                free_memory(device)
    return out


def grouped(cases: list[Case]) -> Iterator[list[Case]]:
    """Cases by build, in the order their groups first appear."""
    groups: dict[tuple, list[Case]] = {}
    for case in cases:
        groups.setdefault(case.group, []).append(case)
    yield from groups.values()


def build_seconds(case: Case) -> float:
    if case.stored:
        return STORED_BUILD_S
    extra = NF4_BUILD_S if case.experts_dtype != "bf16" else 0
    extra += OFFLOAD_BUILD_S if case.offload != "none" else 0
    extra += STORED_BUILD_S if case.stored else 0
    return BUILD_S.get(case.model, 30.0) + extra
