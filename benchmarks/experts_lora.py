"""Split LoRA (moetune) vs peft's ParamWrapper on fused MoE experts: step time and memory.

Cases, each one forward + backward with frozen base weights and LoRA r on the experts:
  layer: one Qwen3-MoE experts layer, 128 experts × hidden 2048 × intermediate 768, r=16,
         4096 tokens, top-8 with random routing, called directly (input requires grad).
  model: a small Qwen3-MoE causal LM (2 layers, 64 experts, top-8), LoRA on attention and
         experts, loss from labels, no gradient checkpointing.
Both paths run in one process on the same peft model (`apply_split_lora` and
`restore_peft_lora` switch it) with the same inputs, alternating per repeat so a change in
the load of a shared machine hits both alike. Outputs of the two paths are compared.

Time: median of `--repeats` steps after one warm-up step (the memory pass).
Peak extra bytes: on CUDA `torch.cuda.max_memory_allocated()` minus what was allocated
before the step; on CPU live tensor bytes counted at the aten dispatch level by
`moetune.plan.tracker.ByteTracker` (every op output's storage counted once until freed,
parameters, buffers and inputs registered first), i.e. what the step adds: activations,
transients and the LoRA gradients. No allocator or CUDA-context overhead.

    python benchmarks/experts_lora.py [--quick] [--json] [--record] [--repeats N]
                                      [--cases layer,model] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from moetune.engine import apply_split_lora, restore_peft_lora
from moetune.plan.tracker import FROZEN, ByteTracker

RESULTS = Path(__file__).with_name("RESULTS.md")
RESULTS_HEADER = "# Benchmark results (every figure with its machine and date)\n"
SECTION = "## Split LoRA on fused experts (`engine/experts_lora.py`)"
ABOUT = (
    "`python benchmarks/experts_lora.py`: peft 0.21 ParamWrapper (`target_parameters`) vs "
    "moetune's split LoRA on the same model, forward + backward, frozen base. speedup = peft "
    "time / moetune time (median after warm-up); mem_ratio = moetune peak extra bytes / "
    "peft's (CUDA: max_memory_allocated; CPU: live tensor bytes by ByteTracker)."
)
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


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


def build(case: Case, device: torch.device, dtype: torch.dtype) -> Any:
    """A random Qwen3-MoE model under peft, B non-zero (as after some training)."""
    import transformers
    from peft import LoraConfig, get_peft_model

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
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device)
    lora = LoraConfig(
        r=case.rank,
        lora_alpha=2 * case.rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=EXPERT_PARAMS,
    )
    model = get_peft_model(model, lora)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.02)
    return model


def layer_step(model: Any, case: Case, device: torch.device) -> tuple[Callable[[], Any], list]:
    """Forward + backward of layer 0's experts on random routing; returns (step, inputs)."""
    experts = model.base_model.model.model.layers[0].mlp.experts
    dtype = next(p for p in model.parameters() if p.dim() == 3).dtype
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    hidden.requires_grad_(True)
    index = torch.rand(case.tokens, case.experts, generator=gen).topk(case.top_k).indices
    weights = torch.rand(case.tokens, case.top_k, generator=gen).softmax(-1)
    grad = torch.randn(case.tokens, case.hidden, generator=gen).to(device, dtype)
    index, weights = index.to(device), weights.to(device, dtype)

    def step() -> torch.Tensor:
        out = experts(hidden, index, weights)
        out.backward(grad)
        return out.detach()

    return step, [hidden, index, weights, grad]


def model_step(model: Any, case: Case, device: torch.device) -> tuple[Callable[[], Any], list]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, case.vocab, (case.tokens // case.seq, case.seq), generator=gen)
    ids = ids.to(device)

    def step() -> torch.Tensor:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    return step, [ids]


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


def run_case(case: Case, repeats: int, device: torch.device, dtype: torch.dtype) -> dict:
    """Measure both paths on one model, switching it between them."""
    model = build(case, device, dtype)
    step, inputs = (layer_step if case.layer else model_step)(model, case, device)
    paths = {"peft": lambda: restore_peft_lora(model), "moetune": lambda: apply_split_lora(model)}

    def run(path: str, measure: Callable) -> Any:
        paths[path]()
        model.zero_grad(set_to_none=True)
        inputs[0].grad = None
        return measure(step)

    mem = {p: run(p, lambda s: peak_extra(s, model, inputs, device)) for p in paths}
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(repeats):
        for path in paths:
            times[path].append(run(path, lambda s: timed(s, device)))
    return summarize(case, mem, times)


def summarize(case: Case, mem: dict, times: dict[str, list[float]]) -> dict:
    (peft_bytes, peft_out), (ours_bytes, ours_out) = mem["peft"], mem["moetune"]
    peft_s, ours_s = statistics.median(times["peft"]), statistics.median(times["moetune"])
    diff = (ours_out.float() - peft_out.float()).norm() / peft_out.float().norm()
    return {
        "case": case.name,
        "shape": asdict(case),
        "peft_s": round(peft_s, 4),
        "moetune_s": round(ours_s, 4),
        "speedup": round(peft_s / ours_s, 2),
        "peft_peak_extra_bytes": peft_bytes,
        "moetune_peak_extra_bytes": ours_bytes,
        "mem_ratio": round(ours_bytes / peft_bytes, 3),
        "output_rel_diff": float(f"{diff.item():.2e}"),
        "repeats": len(times["peft"]),
    }


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}"
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
    mib = 2**20
    return (
        f"{row['case']} ({what}): peft {row['peft_s']} s, moetune {row['moetune_s']} s → "
        f"speedup {row['speedup']}×; peak extra peft {row['peft_peak_extra_bytes'] / mib:.1f} "
        f"MiB, moetune {row['moetune_peak_extra_bytes'] / mib:.1f} MiB → mem_ratio "
        f"{row['mem_ratio']}; outputs differ by {row['output_rel_diff']} (relative); "
        f"median of {row['repeats']}"
    )


def record(rows: list[dict], device: torch.device, dtype: torch.dtype, quick: bool) -> None:
    """Append one dated line per case under this benchmark's section of RESULTS.md."""
    text = RESULTS.read_text() if RESULTS.exists() else RESULTS_HEADER
    if SECTION not in text:
        text = text.rstrip("\n") + f"\n\n{SECTION}\n\n{ABOUT}\n\n"
    today = datetime.date.today().isoformat()
    tag = f"{machine(device)}, {str(dtype).removeprefix('torch.')}" + (", --quick" if quick else "")
    lines = "".join(f"- {today} · {tag} · {describe(r)}\n" for r in rows)
    head, _, tail = text.partition(SECTION)
    body, sep, rest = tail.partition("\n## ")  # the lines go at the end of this section
    after = f"\n## {rest}" if sep else ""
    RESULTS.write_text(f"{head}{SECTION}{body.rstrip()}\n{lines}{after}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    parser.add_argument("--json", action="store_true", help="print results as JSON")
    parser.add_argument("--record", action="store_true", help="append to benchmarks/RESULTS.md")
    parser.add_argument("--repeats", type=int, default=None, help="timed steps per path")
    parser.add_argument("--cases", default="layer,model", help="comma-separated: layer, model")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: no fast bf16 here
    repeats = args.repeats or (5 if args.quick or device.type == "cuda" else 2)
    shapes = QUICK if args.quick else CASES
    warnings.simplefilter("ignore")  # peft's FutureWarnings about renamed transformers APIs
    rows = [run_case(shapes[c], repeats, device, dtype) for c in args.cases.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"[{machine(device)}]")
        for row in rows:
            print(describe(row))
    if args.record:
        record(rows, device, dtype, args.quick)


if __name__ == "__main__":
    main()
