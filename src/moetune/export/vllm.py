"""`--format vllm`: an adapter vLLM (0.32) serves for this family, and the exact options.

vLLM picks an expert-LoRA wrapper per model class: classes flagged `is_3d_moe_weight`
(gpt-oss, Qwen3.5/3.6-MoE) take peft's fused 3-D expert adapters; the others use a 2-D
wrapper that reads per-expert keys (`…experts.N.gate_proj.lora_A.weight`) and refuses
peft's fused adapter at the first request unless the engine runs with
`--enable-mixed-moe-lora-format` and the request sets `is_3d_lora_weight=True`. For those
families moetune writes the per-expert 2-D layout, which needs no flag (or, with
`--vllm-layout fused`, keeps peft's adapter and prints both flags). Families whose expert
LoRA vLLM is known to ignore are refused: serve them merged.

Every layer's peft scaling is folded into B and the config says lora_alpha = r, so vLLM's
one alpha/r reproduces rank / alpha patterns exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch

from moetune.export.deltas import PREFIX, LoraTarget, expert_factors, iter_deltas
from moetune.export.registry import (
    Exporter,
    ExportError,
    ExportOptions,
    ExportResult,
    Source,
    register,
)
from moetune.io import atomic_write_text
from moetune.model.families.serving import VLLM_FAMILIES, VLLM_RANKS, VllmFamily

MIXED_FLAG = "--enable-mixed-moe-lora-format"


def engine_rank(rank: int) -> int:
    """The smallest --max-lora-rank vLLM accepts that holds `rank`."""
    fits = [r for r in VLLM_RANKS if r >= rank]
    if not fits:
        raise ExportError(f"LoRA rank {rank} is above vLLM's largest, 512", "train with r ≤ 512")
    return fits[0]


def family_of(base: str) -> tuple[str, VllmFamily]:
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    model_type = AutoConfig.from_pretrained(base).model_type
    family = VLLM_FAMILIES.get(model_type)
    if family is None:
        raise ExportError(
            f"moetune has no vLLM entry for {model_type!r} "
            f"(known: {', '.join(sorted(VLLM_FAMILIES))})",
            "export --format merged and serve the merged checkpoint with vllm serve",
        )
    if family.experts == "ignored":
        raise ExportError(
            f"vLLM ignores expert LoRA for {model_type} ({family.why}): the fine-tune is lost",
            "export --format merged and serve the merged checkpoint",
        )
    return model_type, family


def per_expert(target: LoraTarget, a: torch.Tensor, b: torch.Tensor) -> dict[str, torch.Tensor]:
    """2-D keys (scaling folded into B) for one LoRA layer."""
    if not target.is_experts:
        return {
            f"{PREFIX}{target.key}.lora_A.weight": a,
            f"{PREFIX}{target.key}.lora_B.weight": target.scaling * b,
        }
    per_a, per_b = expert_factors(target, a, b)
    stem, _, which = target.param.rpartition(".")
    parts = {"gate_up_proj": ("gate_proj", "up_proj")}.get(which, (which,))
    halves = per_b.chunk(len(parts), dim=1)  # gate then up: transformers' fused order
    out = {}
    for e in range(target.experts):
        for name, half in zip(parts, halves, strict=True):
            key = f"{PREFIX}{stem}.{e}.{name}"
            out[f"{key}.lora_A.weight"] = per_a[e].clone()  # gate and up share A: two copies
            out[f"{key}.lora_B.weight"] = (target.scaling * half[e]).contiguous()
    return out


def write_per_expert(source: Source, out: Path) -> dict[str, Any]:
    """The 2-D adapter: safetensors + an adapter_config.json vLLM reads (alpha = r)."""
    # lazy: heavy to import (safetensors)
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for target, a, b in iter_deltas(source.adapter_dir, source.base, torch.float32):
        if target.is_experts and target.transposed:
            raise ExportError(
                f"{target.param} is stored transposed: no 2-D layout", "use --vllm-layout fused"
            )
        tensors.update(per_expert(target, a, b))
    save_file(tensors, str(out / "adapter_model.safetensors"))
    rank = max(t.shape[0] for k, t in tensors.items() if ".lora_A." in k)
    config = json.loads((source.adapter_dir / "adapter_config.json").read_text())
    leaves = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    config.update(r=rank, lora_alpha=rank, target_modules=leaves, target_parameters=None,
                  rank_pattern={}, alpha_pattern={}, use_rslora=False)  # fmt: skip
    atomic_write_text(out / "adapter_config.json", json.dumps(config, indent=2))
    return {"rank": rank, "tensors": len(tensors), "target_modules": leaves}


def copy_peft(source: Source, out: Path) -> dict[str, Any]:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy2(source.adapter_dir / name, out / name)
    config = json.loads((source.adapter_dir / "adapter_config.json").read_text())
    ranks = [int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())]
    return {"rank": max(ranks)}


def serve_options(base: str, out: Path, layout: str, rank: int) -> dict[str, Any]:
    """The exact engine flags and LoRARequest fields this adapter needs."""
    mixed = layout == "fused-mixed"
    flags = ["--enable-lora", f"--max-lora-rank {engine_rank(rank)}"] + [MIXED_FLAG] * mixed
    module: dict[str, Any] = {"name": "moetune", "path": str(out), "base_model_name": base}
    request: dict[str, Any] = {"lora_name": "moetune", "lora_int_id": 1, "lora_path": str(out)}
    if mixed:
        module["is_3d_lora_weight"] = request["is_3d_lora_weight"] = True
    serve = f"vllm serve {base} {' '.join(flags)} --lora-modules '{json.dumps(module)}'"
    return {"layout": layout, "engine_flags": flags, "lora_request": request, "serve": serve}


def readme(base: str, model_type: str, family: VllmFamily, opts: dict[str, Any]) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in opts["lora_request"].items())
    rank = opts["engine_flags"][1].split()[-1]
    mixed = ["enable_mixed_moe_lora_format=True"] if MIXED_FLAG in opts["engine_flags"] else []
    engine = ", ".join(["enable_lora=True", f"max_lora_rank={rank}", *mixed])
    return (
        f"# vLLM adapter ({model_type}, {family.vllm_class}: {family.experts} expert LoRA)\n\n"
        f"Layout: {opts['layout']}.\n\n```bash\n{opts['serve']}\n```\n\n"
        f"```python\nfrom vllm import LLM\nfrom vllm.lora.request import LoRARequest\n"
        f"llm = LLM(model={base!r}, {engine})\n"
        f"llm.generate(prompts, lora_request=LoRARequest({args}))\n```\n"
    )


def export_vllm(source: Source, out: Path, opts: ExportOptions) -> ExportResult:
    model_type, family = family_of(source.base)
    wanted = str(opts.extra.get("vllm_layout", "auto"))
    if family.experts == "3d" or wanted == "fused":
        layout = "fused" if family.experts == "3d" else "fused-mixed"
        details = copy_peft(source, out)
    else:
        layout, details = "per-expert", write_per_expert(source, out)
    final = Path(opts.destination or out)
    options = serve_options(source.base, final, layout, int(details["rank"]))
    atomic_write_text(out / "README.md", readme(source.base, model_type, family, options))
    atomic_write_text(out / "vllm.json", json.dumps(options, indent=2))
    result = ExportResult("vllm", out, files=sorted(p.name for p in out.iterdir()))
    result.details = {"family": model_type, "vllm_class": family.vllm_class, **details, **options}
    result.notes.append(options["serve"])
    return result


register(
    Exporter(
        "vllm",
        export_vllm,
        "vLLM adapter in the layout its MoE LoRA wrapper reads + options",
        needs_weights=False,
    )
)
