"""Probes of the serving traps (lint/rules/serve.py). vLLM and llama.cpp live in their own
venvs / checkouts: their probes run there when pointed at (MOETUNE_VLLM_PYTHON, the
python of a venv with vllm; MOETUNE_LLAMA_CPP, a llama.cpp checkout) and are unavailable
otherwise. The peft probe runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, cast

from moetune.lint.probes.tiny import _quiet, tiny_model
from moetune.lint.registry import ProbeOutcome, ProbeUnavailable

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
VIEWS = ("transpose", "set_", "view", "alias", "detach", "permute", "expand", "slice")
VLLM_SNIPPET = """
import json
from vllm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM
from vllm.model_executor.models.gpt_oss import GptOssForCausalLM
print(json.dumps({"qwen3_moe": bool(getattr(Qwen3MoeForCausalLM, "is_3d_moe_weight", False)),
                  "gpt_oss": bool(getattr(GptOssForCausalLM, "is_3d_moe_weight", False))}))
"""


def vllm_2d_wrapper() -> ProbeOutcome:
    """vLLM serves qwen3_moe with the 2-D MoE LoRA wrapper (is_3d_moe_weight False) and
    gpt-oss with the 3-D one: peft's fused adapter is refused for the first."""
    python = os.environ.get("MOETUNE_VLLM_PYTHON")
    if not python or not Path(python).is_file():
        raise ProbeUnavailable("vLLM lives in its own venv: set MOETUNE_VLLM_PYTHON to its python")
    done = subprocess.run([python, "-c", VLLM_SNIPPET], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ProbeUnavailable(
            f"vllm did not import: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
        )
    flags = json.loads(done.stdout.strip().splitlines()[-1])
    present = flags["qwen3_moe"] is False and flags["gpt_oss"] is True
    return ProbeOutcome(present, f"is_3d_moe_weight: {flags}")


def tiny_run(root: Path, model_type: str = "qwen3_moe") -> tuple[Path, Path]:
    """A tiny random base and a peft adapter on attention + its expert stacks (B ≠ 0)."""
    # lazy: heavy to import (torch, peft)
    import torch
    from peft import LoraConfig, get_peft_model

    model: Any = tiny_model(model_type, device="cpu", dtype=torch.float32)
    model.save_pretrained(str(root / "base"))
    with _quiet():
        config = LoraConfig(r=2, target_modules=["q_proj"], target_parameters=EXPERT_PARAMS)
        wrapped = get_peft_model(model, config)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_()
    wrapped.save_pretrained(str(root / "adapter"))
    return root / "base", root / "adapter"


def stock_gguf_converter() -> ProbeOutcome:
    """llama.cpp's convert_lora_to_gguf.py on a peft expert adapter: `Unprocessed experts`."""
    root = os.environ.get("MOETUNE_LLAMA_CPP")
    script = Path(root) / "convert_lora_to_gguf.py" if root else None
    if script is None or not script.is_file():
        raise ProbeUnavailable(
            "set MOETUNE_LLAMA_CPP to a llama.cpp checkout (convert_lora_to_gguf.py)"
        )
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter = tiny_run(Path(tmp))
        cmd = [
            sys.executable,
            str(script),
            str(adapter),
            "--base",
            str(base),
            "--outfile",
            f"{tmp}/a.gguf",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    text = done.stdout + done.stderr
    lines = [line for line in text.splitlines() if "Unprocessed experts" in line]
    if lines:
        return ProbeOutcome(True, lines[-1][:200])
    return ProbeOutcome(False, f"exit {done.returncode}: {text.strip()[-200:]}")


def unmerged_expert_stack() -> ProbeOutcome:
    """peft's unmerged ParamWrapper materialises W + s·B@A for the whole expert stack on
    every forward, whatever the routing: a tensor of the stack's full shape appears."""
    # lazy: heavy to import (torch)
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    with tempfile.TemporaryDirectory() as tmp:
        base, adapter = tiny_run(Path(tmp))
        # lazy: heavy to import (peft, transformers)
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        with _quiet():
            model = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(str(base)), str(adapter)
            )
    decoder: Any = cast(Any, model).base_model.model.model
    experts = decoder.layers[0].mlp.experts.get_base_layer()
    stack = tuple(experts.gate_up_proj.shape)
    seen: list[Any] = []

    class Shapes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = func(*args, **(kwargs or {}))
            fresh = not any(v in str(func) for v in VIEWS)  # a view materialises nothing
            if fresh and isinstance(out, torch.Tensor) and tuple(out.shape) == stack:
                seen.append(str(func))
            return out

    with torch.no_grad(), Shapes():
        model(input_ids=torch.tensor([[3, 4]]))  # 2 tokens: top-2 of 4 experts at most twice
    ops = ", ".join(sorted(set(seen)))[:120]
    evidence = f"{len(seen)} full-stack {list(stack)} tensors in one 2-token forward ({ops})"
    return ProbeOutcome(bool(seen), evidence)
