"""kt-kernel's CPU LoRA MoE op (KTransformers SFT) vs moetune's split LoRA on one experts layer.

Same shape as `experts_lora.py`'s layer case (or its --quick one), bf16, one forward +
backward with frozen experts and LoRA r on gate, up and down; step times interleaved
per repeat, printed beside the CPU's SIMD flags (from /proc/cpuinfo) and the kernel
variant kt-kernel loaded (AMX / AVX-512 / AVX2).

Opt-in: kt-kernel lives in a venv of its own, installed without its dependencies, so the
main venv never depends on it; torch, transformers and peft come from the main venv
through one .pth line, and moetune from the source tree:

    python -m venv /work/venvs/kt && /work/venvs/kt/bin/pip install --no-deps kt-kernel==0.7.2
    echo /work/main/.venv/lib/python3.11/site-packages \\
        > /work/venvs/kt/lib/python3.11/site-packages/main-venv.pth
    PYTHONPATH=src /work/venvs/kt/bin/python benchmarks/kt_kernel.py [--quick] [--record]

Same function on both sides: kt-kernel keeps gate and up as two projections, each with its
own LoRA A; Qwen3-MoE's fused gate_up_proj has one A over both, so the kt side gets that A
twice and the two halves of B, and the script reports how far the outputs differ.

    python benchmarks/kt_kernel.py [--quick] [--repeats N] [--record] [--json] [--smoke]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import warnings
from importlib import metadata
from typing import Any

import bench_env
import torch

SECTION = "## kt-kernel's CPU LoRA op vs split LoRA (`benchmarks/kt_kernel.py`)"
FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
INSTALL = (
    "python -m venv /work/venvs/kt && /work/venvs/kt/bin/pip install --no-deps "
    "kt-kernel==0.7.2, a .pth line to the main venv's site-packages, then run this script "
    "with /work/venvs/kt/bin/python"
)


def cpu_flags() -> str:
    """The CPU model and which of the SIMD / AMX flags that pick kt-kernel's variant it has."""
    info = {}
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        for line in f:
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    have = set(info.get("flags", "").split())
    flags = " ".join(f for f in FLAGS if f in have) or "none of " + " ".join(FLAGS)
    return f"{info.get('model name', 'unknown CPU')}; flags: {flags}"


def kt_wrapper_class() -> tuple[Any, str] | str:
    """(kt-kernel's SFT MoE wrapper class, loaded variant), or why it cannot run here."""
    here, path = os.path.dirname(os.path.abspath(__file__)), sys.path[:]
    sys.path[:] = [p for p in path if os.path.abspath(p or ".") != here]  # not this script
    try:
        import kt_kernel  # lazy: optional, only in its own venv
        from kt_kernel.sft.amx import AMXSFTMoEWrapper  # lazy: optional
    except Exception as exc:  # ImportError, or the extension refusing this CPU
        return f"kt-kernel does not run in this interpreter ({type(exc).__name__}: {exc})"
    finally:
        sys.path[:] = path
    return AMXSFTMoEWrapper, str(getattr(kt_kernel, "__cpu_variant__", "unknown"))


def factors(model: Any, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """peft's LoRA factors of one experts projection as (A [E, r, in], B [E, out, r]·scaling)."""
    from peft.tuners.lora.layer import ParamWrapper  # lazy: heavy to import (peft)

    for module in model.modules():
        if isinstance(module, ParamWrapper) and module.parameter_name == name:
            a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
            experts = module.num_experts
            a = a.view(experts, -1, a.shape[-1])
            b = b.view(b.shape[0], -1, experts).permute(2, 0, 1) * module.scaling["default"]
            bf16 = torch.bfloat16  # as the split path casts them for a bf16 stack
            return a.detach().to(bf16).contiguous(), b.detach().to(bf16).contiguous()
    raise LookupError(name)


def kt_layer(cls: type, case: Any, model: Any, threads: int) -> Any:
    """kt-kernel's bf16 SFT layer holding the model's layer-0 experts and LoRA (scaling 1:
    peft's is folded into B)."""
    experts = model.base_model.model.model.layers[0].mlp.experts.get_base_layer()
    i = case.intermediate
    layer = cls(layer_idx=0, num_experts=case.experts, num_experts_per_tok=case.top_k,
                hidden_size=case.hidden, moe_intermediate_size=i, num_gpu_experts=0,
                cpuinfer_threads=threads, threadpool_count=1, weight_path="",
                chunked_prefill_size=case.tokens, lora_rank=case.rank,
                lora_alpha=float(case.rank), method="AMXBF16_SFT")  # fmt: skip
    gate_up = experts.gate_up_proj.detach()
    layer.load_weights_from_tensors(gate_up[:, :i].contiguous(), gate_up[:, i:].contiguous(),
                                    experts.down_proj.detach().contiguous(),
                                    torch.arange(case.experts))  # fmt: skip
    a, b = factors(model, "gate_up_proj")
    down_a, down_b = factors(model, "down_proj")
    lora = [a, b[:, :i].contiguous(), a.clone(), b[:, i:].contiguous(), down_a, down_b]
    layer.init_lora_weights(*lora, *[torch.zeros_like(t) for t in lora])
    return layer


def measure(case: Any, repeats: int, cls: type, threads: int) -> dict:
    """Both paths on the same bf16 layer and inputs, alternating per repeat."""
    import experts_lora as bench  # lazy: sibling benchmark (peft, transformers)

    cpu = torch.device("cpu")
    model = bench.build_models(case, ["bf16"], "off", cpu, torch.bfloat16)["float"]
    inputs = bench.make_inputs(case, cpu, torch.bfloat16)
    side = bench.make_side(model, case, inputs, bench.apply_split_lora)
    side.activate()
    layer = kt_layer(cls, case, model, threads)
    hidden, index, weights, grad = inputs

    def kt_step() -> torch.Tensor:
        out = layer.forward(hidden.detach(), index, weights.float())
        layer.backward(grad)
        return out

    ours, theirs = side.step(), kt_step()  # warm-up, and the outputs to compare
    times: dict[str, list[float]] = {"moetune": [], "kt": []}
    for _ in range(repeats):
        times["moetune"].append(bench.timed(side.step, cpu))
        times["kt"].append(bench.timed(kt_step, cpu))
    moetune_s, kt_s = (statistics.median(times[k]) for k in ("moetune", "kt"))
    return {"moetune_s": round(moetune_s, 4), "kt_s": round(kt_s, 4),
            "kt_over_moetune": round(kt_s / moetune_s, 2),
            "output_rel_diff": bench.rel_diff(theirs, ours), "repeats": repeats}  # fmt: skip


def describe(row: dict) -> str:
    c = row["shape"]
    return (
        f"layer {c['experts']} experts × hidden {c['hidden']} × intermediate "
        f"{c['intermediate']}, r={c['rank']}, {c['tokens']} tokens top-{c['top_k']}, bf16: "
        f"kt-kernel {row['kt_version']} ({row['kt_variant']}, AMXBF16_SFT) {row['kt_s']} s, "
        f"moetune split LoRA {row['moetune_s']} s → kt/moetune {row['kt_over_moetune']}×; "
        f"outputs differ by {row['output_rel_diff']} (relative); median of {row['repeats']}; "
        f"CPU {row['cpu']}"
    )


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="experts_lora.py's quick layer")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per path")
    parser.add_argument("--json", action="store_true", help="print the row as JSON")
    parser.add_argument("--record", action="store_true", help="append to results/engine.md")
    parser.add_argument("--smoke", action="store_true",
                        help="quick layer, 1 repeat, no record; without kt-kernel: the flags "
                        "and why it cannot run")  # fmt: skip
    bench_env.add_argument(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        args.quick, args.repeats, args.record = True, 1, False
    return args


def main(argv: list[str] | None = None) -> dict | None:
    args = parse(argv)
    threads = bench_env.apply()
    print(f"CPU {cpu_flags()}")
    found = kt_wrapper_class()
    if isinstance(found, str):
        print(f"{found}; to measure it: {INSTALL}")
        if args.smoke:
            return None
        raise SystemExit(2)
    import experts_lora as bench  # lazy: sibling benchmark (peft, transformers)

    case = (bench.QUICK if args.quick else bench.CASES)["layer"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = measure(case, args.repeats, found[0], threads)
    row |= {"shape": bench.asdict(case), "kt_variant": found[1], "cpu": cpu_flags(),
            "kt_version": metadata.version("kt-kernel")}  # fmt: skip
    print(json.dumps(row, indent=2) if args.json else describe(row))
    if args.record:
        load = f"load {os.getloadavg()[0]:.1f}"
        where = f"{os.cpu_count()} cores, {load}, {bench_env.describe()}, torch {torch.__version__}"
        quick = ", --quick" if args.quick else ""
        line = f"- {datetime.date.today().isoformat()} · {where}{quick} · {describe(row)}"
        bench_env.append_results(bench.RESULTS, SECTION, line)
    return row


if __name__ == "__main__":
    main()
