"""The gguf format's consumer for the served == trained check: llama.cpp in its own venv
(MOETUNE_LLAMACPP_PYTHON=<that venv's python>; `make setup-llamacpp` builds one from
prebuilt wheels), through whichever binding it holds (llamacpp_runner.py's registry).

It scores base.gguf + adapter.gguf (the LoRA as llama.cpp applies it, stacked *_exps
experts included) – and merged.gguf, against transformers on the same merged weights
(merged-hf), for the check's floor – on the reference's token ids (no tokenizer round
trip), in a subprocess, one JSON document each way."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from moetune.export.check import (
    ConsumerUnavailable,
    OwnError,
    Served,
    merged_consumer,
    register_consumer,
    run_in_venv,
)
from moetune.export.registry import Source

RUNNER = Path(__file__).with_name("llamacpp_runner.py")


def run_llamacpp(
    model: Path, lora: Path | None, sequences: list[list[int]], prompts: list[list[int]], new: int
) -> Served:
    job = {"model": str(model), "lora": str(lora) if lora else None, "sequences": sequences,
           "prompts": prompts, "new_tokens": new}  # fmt: skip
    stdout = run_in_venv(
        "MOETUNE_LLAMACPP_PYTHON",
        "llama.cpp is not installed here (make setup-llamacpp, then set "
        "MOETUNE_LLAMACPP_PYTHON to that venv's python)",
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


def gguf_baseline(out: Path, source: Source, sequences: list[list[int]]) -> OwnError:
    """merged.gguf in llama.cpp against merged-hf in transformers: llama.cpp's own error on
    the trained weights is the check's floor (its error grows with the weights' share: on a
    random base alone it is near zero, too tight for the adapter's path)."""
    if not (out / "merged.gguf").is_file() or not (out / "merged-hf").is_dir():
        raise ConsumerUnavailable(
            "no merged.gguf and merged-hf beside the LoRA (set MOETUNE_LLAMA_CPP so the "
            "export converts the merged model): no floor for llama.cpp's own error"
        )
    served = run_llamacpp(out / "merged.gguf", None, sequences, [], 0).logits
    return OwnError(served, merged_consumer(out / "merged-hf", source, sequences, [], 0).logits)


register_consumer(
    "gguf", "llama.cpp (base.gguf + adapter.gguf)", gguf_consumer, baseline=gguf_baseline
)
