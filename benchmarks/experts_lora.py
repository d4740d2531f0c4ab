"""Split LoRA (moetune) vs peft's ParamWrapper on fused MoE experts: step time and memory.

Cases, each one forward + backward with frozen base weights and LoRA r on the experts:
  layer: one Qwen3-MoE experts layer, 128 experts × hidden 2048 × intermediate 768, r=16,
         4096 tokens, top-8 with random routing, called directly (input requires grad);
         nothing to checkpoint, so `--gc` does not apply and its rows say gc "off".
  model: a small Qwen3-MoE causal LM (2 layers, 64 experts, top-8), LoRA on attention and
         experts, loss from labels, once per `--gc` setting: "on" is non-reentrant gradient
         checkpointing with input grads enabled, as a peft/TRL training run sets it up
         (`plan.trace.prepare_for_training`).
Frozen experts (`--experts-dtype`): "bf16" is the float stack at the run's dtype
(`--dtype`: bf16 on CUDA, fp32 on CPU unless asked); "int8", "nf4" ("nf4dq": double-quantised
scales) store it as `engine.quant.QuantizedStack`s, built as the trainer builds them
(quantise, then peft inside `peft_targets`), and run moetune's split LoRA on them. peft
cannot adapt a quantised stack at all, so every row compares against peft on the *float*
stack of the same shape: that baseline is measured once per case and gc setting and reused for each
experts dtype. All paths run in one process, the float ones on one peft model
(`apply_split_lora` / `restore_peft_lora` switch it), all with the same inputs and LoRA
values, alternating per repeat so a change in the load of a shared machine hits all alike.

Bound (layer case, CPU): `lora_bound.py` counts the FLOPs and bytes of both paths and turns
them into the speedup a roofline allows, on this machine's matmul FLOP/s and copy bandwidth
measured after each repeat (between the timed steps); each row gives the measured speedup
as a fraction of that bound (`of_bound`).

Time: median of `--repeats` steps after one warm-up step (the memory pass).
Peak extra bytes: on CUDA `torch.cuda.max_memory_allocated()` minus what was allocated
before the step; on CPU live tensor bytes counted at the aten dispatch level by
`moetune.plan.trace.bytes.ByteTracker` (every op output's storage counted once until freed,
parameters, buffers and inputs registered first), i.e. what the step adds: activations,
transients and the LoRA gradients. No allocator or CUDA-context overhead. A quantised
model holds fewer bytes before the step, so each row also gives the frozen bytes (frozen
parameters + buffers; `expert_bytes`: the expert stacks alone) of both sides.
Outputs (the layer's output, or the loss): a float row compares the split path's with
peft's; a quantised row compares it with peft's forward on the float model holding the
dequantised stacks (same weights: only the path differs), and `quant_rel_diff` is its
distance to peft on the original float stack (the quantisation error).

    python benchmarks/experts_lora.py [--quick] [--json] [--record] [--repeats N]
                                      [--cases layer,model] [--experts-dtype bf16,int8,nf4]
                                      [--gc off,on] [--device cpu|cuda] [--dtype fp32|bf16]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

import bench_env
import lora_bound
import torch

from moetune.engine import IMPLEMENTATION, apply_split_lora, register, restore_peft_lora
from moetune.engine.quant.stacks import experts_modules, peft_targets, quantize_experts_, stacks_of
from moetune.plan.trace.bytes import FROZEN, ByteTracker
from moetune.plan.trace.fake_step import prepare_for_training

RESULTS = bench_env.results_page("engine")
SECTION = "## Split LoRA on fused experts (`engine/experts_lora.py`)"
ABOUT = (
    "`python benchmarks/experts_lora.py`: peft 0.21 ParamWrapper (`target_parameters`) vs "
    "moetune's split LoRA, forward + backward, frozen base. speedup = peft time / moetune "
    "time (median after warm-up); mem_ratio = moetune peak extra bytes / peft's (CUDA: "
    "max_memory_allocated; CPU: live tensor bytes by ByteTracker), counted above the frozen "
    "weights. int8/nf4 rows: moetune on quantised experts against peft on the float stack "
    "(peft cannot adapt quantised stacks)."
)
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
FLOAT = ("bf16", "fp32", "float")  # the unquantised stack, at the run's dtype
QUANT = {"int8": ("int8", False), "nf4": ("nf4", False), "nf4dq": ("nf4", True)}
GC = ("off", "on")


@dataclass(frozen=True)
class Case:
    """A Qwen3-MoE shape; `layer=True` times one experts layer, else the whole model."""

    name: str
    layer: bool
    experts: int
    hidden: int
    intermediate: int
    top_k: int
    tokens: int  # batch × seq for a model case
    rank: int
    layers: int = 1
    vocab: int = 64
    seq: int = 1


CASES = {
    "layer": Case("layer", True, 128, 2048, 768, 8, 4096, 16),
    "model": Case("model", False, 64, 512, 256, 8, 1024, 16, layers=2, vocab=2048, seq=256),
}
# Seconds, same tokens per expert as the full cases (256 and 128), so ratios stay telling.
QUICK = {
    "layer": Case("layer", True, 32, 512, 256, 8, 1024, 16),
    "model": Case("model", False, 32, 256, 128, 8, 512, 16, layers=2, vocab=512, seq=128),
}


@dataclass
class Side:
    """One path to measure: its model, the switch onto the path, forward and train step."""

    model: Any
    activate: Callable[[], Any]
    forward: Callable[[], torch.Tensor]
    step: Callable[[], torch.Tensor]


def base_model(case: Case, device: torch.device, dtype: torch.dtype) -> Any:
    """A random Qwen3-MoE model of the case's shape (seeded: every build is the same)."""
    import transformers

    config = transformers.Qwen3MoeConfig(
        hidden_size=case.hidden,
        num_hidden_layers=case.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=case.hidden // 8,
        vocab_size=case.vocab,
        num_experts=case.experts,
        num_experts_per_tok=case.top_k,
        moe_intermediate_size=case.intermediate,
        intermediate_size=case.intermediate,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)


def add_lora(base: Any, case: Case, experts: str) -> Any:
    """peft LoRA on attention and experts; quantised experts first, as
    plan/trace/fake_step.py builds."""
    from peft import LoraConfig, get_peft_model

    if experts in QUANT:
        quantize_experts_(base, *QUANT[experts], error_experts=0)
        register()
        base.set_experts_implementation(IMPLEMENTATION)
    lora = LoraConfig(
        r=case.rank,
        lora_alpha=2 * case.rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=EXPERT_PARAMS,
    )
    with peft_targets(base):  # a no-op on float stacks
        return get_peft_model(base, lora)


def copy_lora(source: Any, target: Any) -> None:
    """The source's LoRA values into the target (same adapters: names and shapes match)."""
    params = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in source.named_parameters():
            if param.requires_grad:
                params[name].copy_(param)


def build_models(case: Case, dtypes: list[str], gc: str, device: torch.device,
                 dtype: torch.dtype) -> dict[str, Any]:  # fmt: skip
    """Peft models by experts dtype ("float": peft's and the float split path's), all with
    the same base and LoRA weights, B non-zero (as after some training)."""
    base = base_model(case, device, dtype)
    models = {d: add_lora(copy.deepcopy(base), case, d) for d in dtypes if d in QUANT}
    models["float"] = add_lora(base, case, "float")
    with torch.no_grad():
        for name, param in models["float"].named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    for model in models.values():
        copy_lora(models["float"], model)
        if not case.layer:
            prepare_for_training(model, False, gc == "on")
    return models


def make_inputs(case: Case, device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Layer: [hidden (requires grad), top-k index, weights, output grad]; model: [ids]."""
    gen = torch.Generator().manual_seed(1)
    if not case.layer:
        ids = torch.randint(0, case.vocab, (case.tokens // case.seq, case.seq), generator=gen)
        return [ids.to(device)]
    hidden = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    index = torch.rand(case.tokens, case.experts, generator=gen).topk(case.top_k).indices
    weights = torch.rand(case.tokens, case.top_k, generator=gen).softmax(-1)
    grad = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    return [hidden.requires_grad_(True), index.to(device), weights.to(device, dtype), grad]


def make_side(model: Any, case: Case, inputs: list, activate: Callable[[Any], Any]) -> Side:
    """Layer: layer 0's experts on the random routing; model: the loss from labels."""
    if case.layer:
        experts = model.base_model.model.model.layers[0].mlp.experts

        def forward() -> torch.Tensor:
            return experts(*inputs[:3])
    else:

        def forward() -> torch.Tensor:
            return model(input_ids=inputs[0], labels=inputs[0]).loss

    def step() -> torch.Tensor:
        out = forward()
        out.backward(inputs[3] if case.layer else None)
        return out.detach()

    return Side(model, lambda: activate(model), forward, step)


def make_sides(models: dict[str, Any], case: Case, dtypes: list[str], inputs: list) -> dict:
    """The peft side on the float model, then one split-LoRA side per experts dtype."""
    sides = {"peft": make_side(models["float"], case, inputs, restore_peft_lora)}
    for d in dtypes:
        model = models[d if d in QUANT else "float"]
        sides[d] = make_side(model, case, inputs, apply_split_lora)
    return sides


def peak_extra(step: Callable[[], Any], model: Any, inputs: list, device: torch.device) -> tuple:
    """(peak bytes the step adds, its output); see the module docstring for the method."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before, out
    tracker = ByteTracker()
    with tracker:
        tracker.register([*model.parameters(), *model.buffers(), *inputs], FROZEN)
        before = tracker.live_bytes
        out = step()
    return tracker.peak.bytes - before, out


def timed(step: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def frozen_bytes(model: Any) -> tuple[int, int]:
    """(frozen parameters + buffers, the expert stacks alone, float or quantised)."""
    frozen = sum(p.nbytes for p in model.parameters() if not p.requires_grad)
    frozen += sum(b.nbytes for b in model.buffers())
    quant = sum(s.nbytes for m in model.modules() for s in stacks_of(m).values())
    floats = sum(m._parameters[n].nbytes for _, m, names in experts_modules(model) for n in names)
    return frozen, quant + floats


@contextlib.contextmanager
def dequantised(model: Any, quantised: Any) -> Iterator[None]:
    """The float model's expert stacks hold the quantised model's dequantised values."""
    modules = quantised.named_modules()
    stacks = {path.replace(".base_layer", ""): stacks_of(m) for path, m in modules if stacks_of(m)}
    saved = []
    for path, module, names in experts_modules(model):
        for name in names:
            param = module._parameters[name]
            saved.append((param, param.data))
            param.data = stacks[path][name].dequantize(param.dtype)
    try:
        yield
    finally:
        for param, data in saved:
            param.data = data


def reference(peft: Side, side: Side) -> torch.Tensor:
    """peft's forward on the dequantised stacks of the side's quantised model."""
    with dequantised(peft.model, side.model), torch.no_grad():
        peft.activate()
        return peft.forward().detach()


def run_case(case: Case, gc: str, dtypes: list[str], repeats: int, device: torch.device,
             dtype: torch.dtype) -> list[dict]:  # fmt: skip
    """Measure peft once and split LoRA per experts dtype; one row per dtype."""
    models = build_models(case, dtypes, gc, device, dtype)
    inputs = make_inputs(case, device, dtype)
    sides = make_sides(models, case, dtypes, inputs)

    def run(name: str, measure: Callable[[Side], Any]) -> Any:
        sides[name].activate()
        sides[name].model.zero_grad(set_to_none=True)
        inputs[0].grad = None
        return measure(sides[name])

    mem = {n: run(n, lambda s: peak_extra(s.step, s.model, inputs, device)) for n in sides}
    times: dict[str, list[float]] = {n: [] for n in sides}
    machines = []
    for _ in range(repeats):
        for name in sides:
            times[name].append(run(name, lambda s: timed(s.step, device)))
        if case.layer and device.type == "cpu":  # the roofline's rates, between the steps
            machines.append(lora_bound.measure_machine(bound_shape(case, dtype), dtype))
    refs = {d: reference(sides["peft"], sides[d]) for d in dtypes if d in QUANT}
    got = {n: (*mem[n], times[n], *frozen_bytes(s.model)) for n, s in sides.items()}
    label = dtype_name(dtype)
    rows = []
    for d in dtypes:
        key = {"case": case.name, "experts_dtype": d if d in QUANT else label, "gc": gc}
        row = summarize(case, key, label, got["peft"], got[d], refs.get(d))
        rows.append({**row, **against_bound(row, case, dtype, machines)})
    return rows


def bound_shape(case: Case, dtype: torch.dtype) -> lora_bound.Shape:
    width = torch.finfo(dtype).bits // 8
    return lora_bound.Shape(case.experts, case.top_k, case.hidden, case.intermediate,
                            case.tokens, case.rank, width)  # fmt: skip


def against_bound(row: dict, case: Case, dtype: torch.dtype, machines: list) -> dict:
    """The layer's roofline bound (benchmarks/lora_bound.py) on the rates measured between
    the timed steps (their medians), and the measured speedup as a fraction of it."""
    if not machines:
        return {"bound": None}
    machine = lora_bound.Machine(statistics.median(m.matmul_flops for m in machines),
                                 statistics.median(m.bandwidth for m in machines))  # fmt: skip
    bound = lora_bound.bound(bound_shape(case, dtype), machine)
    rates = {
        "matmul_gflops": round(machine.matmul_flops / 1e9, 1),
        "bandwidth_gbs": round(machine.bandwidth / 1e9, 1),
    }
    return {
        "bound": {**bound, **rates},
        "of_bound": round(row["speedup"] / bound["bound_speedup"], 2),
    }


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = (out.float() - ref.float()).norm() / ref.float().norm()
    return float(f"{diff.item():.2e}")


def summarize(case: Case, key: dict, label: str, peft: tuple, ours: tuple,
              ref: torch.Tensor | None) -> dict:  # fmt: skip
    """One row; peft, ours: (peak extra bytes, output, times, frozen bytes, expert bytes)."""
    peft_bytes, peft_out, peft_times, peft_frozen, peft_experts = peft
    ours_bytes, ours_out, ours_times, ours_frozen, ours_experts = ours
    peft_s, ours_s = statistics.median(peft_times), statistics.median(ours_times)
    return {
        **key,
        "baseline": f"peft on the {label} stack",
        "shape": asdict(case),
        "peft_s": round(peft_s, 4),
        "moetune_s": round(ours_s, 4),
        "speedup": round(peft_s / ours_s, 2),
        "peft_peak_extra_bytes": peft_bytes,
        "moetune_peak_extra_bytes": ours_bytes,
        "mem_ratio": round(ours_bytes / peft_bytes, 3),
        "peft_frozen_bytes": peft_frozen,
        "frozen_bytes": ours_frozen,
        "peft_expert_bytes": peft_experts,
        "expert_bytes": ours_experts,
        "output_rel_diff": rel_diff(ours_out, peft_out if ref is None else ref),
        "quant_rel_diff": None if ref is None else rel_diff(ours_out, peft_out),
        "repeats": len(ours_times),
    }


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
    where += f", {bench_env.describe()}"
    versions = f"torch {torch.__version__}, peft {metadata.version('peft')}"
    return f"{where}, {versions}, transformers {metadata.version('transformers')}"


def describe(row: dict) -> str:
    s = row["shape"]
    what = (
        f"{s['experts']} experts × hidden {s['hidden']} × intermediate {s['intermediate']}, "
        f"r={s['rank']}, {s['tokens']} tokens top-{s['top_k']}"
    )
    if not s["layer"]:
        what = f"{s['layers']}-layer model, {what}, vocab {s['vocab']}, seq {s['seq']}"
    checked = "peft's"
    if row["quant_rel_diff"] is not None:
        checked += f" on the dequantised stacks ({row['quant_rel_diff']} from the float one's)"
    return _measured(row, what, checked) + _bound_text(row)


def _bound_text(row: dict) -> str:
    b = row.get("bound")
    if not b:
        return ""
    return (
        f"; bound (roofline at {b['matmul_gflops']} GFLOP/s, {b['bandwidth_gbs']} GB/s): peft "
        f"{b['peft_gflop']} GFLOP + {b['peft_gb']} GB → {b['peft_roofline_s']} s, split "
        f"{b['split_gflop']} GFLOP + {b['split_gb']} GB → {b['split_roofline_s']} s, speedup "
        f"{b['bound_speedup']}×; measured/bound {row['of_bound']}"
    )


def _measured(row: dict, what: str, checked: str) -> str:
    mib = 2**20
    return (
        f"{row['case']}, {row['experts_dtype']} experts, gc {row['gc']} ({what}): "
        f"{row['baseline']} {row['peft_s']} s, moetune {row['moetune_s']} s → speedup "
        f"{row['speedup']}×; peak extra peft {row['peft_peak_extra_bytes'] / mib:.1f} MiB, "
        f"moetune {row['moetune_peak_extra_bytes'] / mib:.1f} MiB → mem_ratio "
        f"{row['mem_ratio']}; frozen peft {row['peft_frozen_bytes'] / mib:.1f} MiB (experts "
        f"{row['peft_expert_bytes'] / mib:.1f}), moetune {row['frozen_bytes'] / mib:.1f} MiB "
        f"(experts {row['expert_bytes'] / mib:.1f}); output differs from {checked} by "
        f"{row['output_rel_diff']} (relative); median of {row['repeats']}"
    )


def record(rows: list[dict], device: torch.device, dtype: torch.dtype, quick: bool) -> None:
    """Append one dated line per row under this benchmark's section of its results page."""
    today = datetime.date.today().isoformat()
    tag = f"{machine(device)}, {dtype_name(dtype)}" + (", --quick" if quick else "")
    lines = "".join(f"- {today} · {tag} · {describe(r)}\n" for r in rows)
    bench_env.append_to_section(RESULTS, SECTION, ABOUT, lines)


def choices(text: str, allowed: tuple[str, ...] | list[str], what: str) -> list[str]:
    picked = [c.strip() for c in text.split(",") if c.strip()]
    if not picked or any(c not in allowed for c in picked):
        raise SystemExit(f"{what}: {text!r}; choose from {', '.join(allowed)}")
    return picked


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--record", action="store_true", help="append to results/engine.md")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per path")
    parser.add_argument("--cases", default="layer,model", help="comma-separated: layer, model")
    parser.add_argument("--experts-dtype", default="bf16,int8,nf4",
                        help="comma-separated frozen experts: bf16 (the float stack), int8, "
                        "nf4, nf4dq; each against peft on the float stack")  # fmt: skip
    parser.add_argument("--gc", default="off,on", help="model case: off, on or off,on")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16"],
                        help="compute dtype of the float stack and both paths (default: bf16 on "
                        "CUDA, fp32 on CPU)")  # fmt: skip
    parser.add_argument("--smoke", action="store_true",
                        help="quick layer case, bf16+int8, 1 repeat; no record")  # fmt: skip
    bench_env.add_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick, args.repeats, args.record = True, 1, False
        args.cases, args.experts_dtype, args.gc = "layer", "bf16,int8", "off"
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse(argv)
    bench_env.apply()
    cases = choices(args.cases, list(CASES), "--cases")
    dtypes = choices(args.experts_dtype, [*FLOAT, *QUANT], "--experts-dtype")
    gcs = choices(args.gc, GC, "--gc")
    device = torch.device(args.device)
    default = "bf16" if device.type == "cuda" else "fp32"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype or default]
    repeats = args.repeats or (5 if args.quick or device.type == "cuda" else 2)
    shapes = QUICK if args.quick else CASES
    with warnings.catch_warnings():  # peft's FutureWarnings about renamed transformers APIs
        warnings.simplefilter("ignore")
        rows = [row for c in cases for gc in (["off"] if shapes[c].layer else gcs)
                for row in run_case(shapes[c], gc, dtypes, repeats, device, dtype)]  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"[{machine(device)}]")
        for row in rows:
            print(describe(row))
    if args.record:
        record(rows, device, dtype, args.quick)
    return rows


if __name__ == "__main__":
    main()
