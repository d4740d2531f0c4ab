"""The engine as a transformers experts implementation, from a user's own script.

The script (a subprocess) imports nothing of moetune but `moetune.register_experts()`, loads
the demo base with `experts_implementation="moetune_lora"`, wraps it with plain peft
(`target_parameters` on the experts) and trains; its loss, gradients and adapter must equal
moetune's own path (`apply_split_lora`) on the same base, and the adapter must load with
plain `PeftModel.from_pretrained` on a base that never saw moetune's engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from moetune.demo.base import SHIPPED_DIR
from moetune.engine import apply_split_lora, is_split

pytestmark = pytest.mark.filterwarnings("ignore")

LORA = {
    "r": 4,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "o_proj"],
    "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
}
STEPS = 2

# Shared by the script and by moetune's own run below: B random (peft starts it at 0, which
# would hide a misread factor), the same batch, plain SGD steps.
COMMON = """
def randomize_b(model):
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)


def batch():
    return torch.randint(3, 48, (2, 16), generator=torch.Generator().manual_seed(2))


def train(model, steps):
    ids = batch()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    first = None
    for _ in range(steps):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if first is None:
            first = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()
                                   if p.requires_grad})
        opt.step()
    return first
"""

HEADER = """
import json, sys
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import moetune
"""

BODY = """
moetune.register_experts()
base, out, lora, steps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(
    base, experts_implementation="moetune_lora", dtype=torch.float32
)
model = get_peft_model(model, LoraConfig(**lora))
randomize_b(model)
loss, grads = train(model, steps)
torch.save(grads, f"{out}/grads.pt")
model.save_pretrained(f"{out}/adapter")
wrappers = [type(m) for m in model.modules() if hasattr(m, "parameter_name")]
split = [t for t in wrappers if t.__module__.startswith("moetune.")]
with open(f"{out}/result.json", "w") as f:
    json.dump({"loss": loss, "wrappers": len(wrappers), "split": len(split)}, f)
"""

namespace: dict[str, Any] = {"torch": torch}
exec(COMMON, namespace)  # the same helpers here, so both sides train alike


@pytest.fixture(scope="module")
def script_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("script")
    script = out / "user_script.py"
    script.write_text(HEADER + COMMON + BODY)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [sys.executable, str(script), str(SHIPPED_DIR), str(out), json.dumps(LORA), str(STEPS)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _moetune_path() -> tuple[Any, tuple[float, dict[str, torch.Tensor]]]:
    """moetune's own engine on the same base: peft on the stock forward, then apply_split_lora."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32)
        model = get_peft_model(model, LoraConfig(**LORA))
    apply_split_lora(model)
    namespace["randomize_b"](model)
    return model, namespace["train"](model, STEPS)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_script_trains_split_lora_equal_to_moetunes_own(script_run: Path) -> None:
    result = json.loads((script_run / "result.json").read_text())
    # 3 MoE layers × (gate_up, down), every one on the split path without apply_split_lora
    assert result["wrappers"] == 6 and result["split"] == 6
    model, (loss, grads) = _moetune_path()
    assert is_split(model)
    assert abs(result["loss"] - loss) <= 1e-6 * abs(loss)
    theirs = torch.load(script_run / "grads.pt")
    assert theirs.keys() == grads.keys() and len(grads) == 6 * 2 + 3 * 2 * 2  # experts + q/o
    assert max(_rel(theirs[n], grads[n]) for n in grads) <= 1e-6
    ours = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    saved = load_file(script_run / "adapter" / "adapter_model.safetensors")
    assert len(saved) == len(ours)
    by_key = {k.replace("base_model.model.", ""): v for k, v in saved.items()}
    for name, tensor in ours.items():
        key = name.replace("base_model.model.", "").replace(".default", "")
        assert _rel(by_key[key], tensor) <= 1e-6, name


def test_script_adapter_loads_with_plain_peft(script_run: Path) -> None:
    """No moetune_lora on this side: peft's own ParamWrapper path gives the same logits."""
    model, _ = _moetune_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        base = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32)
        plain = PeftModel.from_pretrained(base, script_run / "adapter")
    assert not is_split(plain)
    ids = namespace["batch"]()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        got = plain(input_ids=ids).logits
    assert _rel(got, expected) <= 1e-6


def test_import_moetune_stays_light() -> None:
    """register_experts() is a call, so `import moetune` alone loads no torch."""
    code = (
        "import sys, moetune; print(sorted({'torch', 'transformers', 'peft'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.stdout.strip() == "[]", done.stderr
