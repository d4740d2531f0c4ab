"""The gguf format's consumer for the served == trained check: llama.cpp through
llama-cpp-python, in its own venv (MOETUNE_LLAMACPP_PYTHON=<that venv's python>).

It scores base.gguf + adapter.gguf (the LoRA as llama.cpp applies it, stacked *_exps
experts included) – and merged.gguf where the export wrote one – on the reference's token
ids (no tokenizer round trip), in a subprocess, one JSON document each way."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moetune.export.check import ConsumerUnavailable, Served, register_consumer, run_in_venv
from moetune.export.registry import Source

RUNNER = Path(__file__).with_name("llamacpp_runner.py")


def run_llamacpp(
    model: Path, lora: Path | None, sequences: list[list[int]], prompts: list[list[int]], new: int
) -> Served:
    job = {"model": str(model), "lora": str(lora) if lora else None, "sequences": sequences,
           "prompts": prompts, "new_tokens": new}  # fmt: skip
    stdout = run_in_venv(
        "MOETUNE_LLAMACPP_PYTHON",
        "llama.cpp is not installed here (set MOETUNE_LLAMACPP_PYTHON to the python of a "
        "venv with llama-cpp-python)",
        [str(RUNNER)], job, f"llama.cpp could not run {model.name}",
    )  # fmt: skip
    doc = json.loads(stdout)
    return Served([torch.tensor(x, dtype=torch.float64) for x in doc["logits"]], doc["greedy"])


def gguf_consumer(
    out: Path, source: Source, sequences: list[list[int]], prompts: list[list[int]], new: int
) -> Served:
    """base.gguf + adapter.gguf in llama.cpp (base.gguf comes from llama.cpp's converter)."""
    if not (out / "base.gguf").is_file():
        raise ConsumerUnavailable(
            "no base.gguf beside the LoRA (set MOETUNE_LLAMA_CPP so the export converts the base)"
        )
    return run_llamacpp(out / "base.gguf", out / "adapter.gguf", sequences, prompts, new)


def gguf_baseline(out: Path, source: Source, sequences: list[list[int]]) -> list[torch.Tensor]:
    """base.gguf alone in llama.cpp: its kernels' own error on the base is the check's floor
    (gpt-oss's sinks, clamped SwiGLU and YaRN: 1e-4 to 2e-3 relative on tiny bases)."""
    return run_llamacpp(out / "base.gguf", None, sequences, [], 0).logits


register_consumer(
    "gguf", "llama.cpp (base.gguf + adapter.gguf)", gguf_consumer, baseline=gguf_baseline
)
