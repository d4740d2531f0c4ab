"""The routing measurement before the first step never changes training: over every frozen
base kind (float, moetune's int8 / NF4 experts, a stored FP8 base, a bitsandbytes 4-bit /
8-bit pre-quantised base) the first step's gradients equal a run with routing off, and each
module gets its own mode back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

from moetune.engine.stored.write import write_stored
from moetune.train.routing.modes import measuring, stores_integers
from test_train_helpers import (
    reverse_rows,
    run_config,
    save_tiny_model,
    train_capturing,
    write_jsonl,
)

pytestmark = pytest.mark.filterwarnings("ignore")
# 64 wide: bitsandbytes' 4-bit blocks (64) fit a row, so its CPU inference repack can happen
WIDE = {"hidden_size": 64, "head_dim": 16, "moe_intermediate_size": 64, "intermediate_size": 64}


def bnb_base(float_dir: Path, out: Path, bits: int) -> Path:
    """`float_dir` quantised on load by transformers' own bitsandbytes integration and saved
    with save_pretrained (how the "-bnb-4bit" repos are made), with its tokenizer."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes makes the pre-quantised base")
    import shutil

    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32) if bits == 4 else \
        BitsAndBytesConfig(load_in_8bit=True)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        float_dir, quantization_config=quant, device_map="cpu"
    )
    model.save_pretrained(out)
    for extra in float_dir.glob("*token*"):
        shutil.copy2(extra, out / extra.name)
    return out


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("routing_modes")
    float_dir = save_tiny_model(root / "float", **WIDE)
    return {"float": float_dir, "data": write_jsonl(root / "d.jsonl", reverse_rows(8))}


def _base(wide: dict[str, Path], kind: str) -> Path:
    root = wide["float"].parent
    if kind == "fp8":
        return write_stored(wide["float"], root / kind, "fp8", block=(16, 16))
    if kind.startswith("bnb"):
        return bnb_base(wide["float"], root / kind, int(kind[-1]))
    return wide["float"]


class _FirstGradients(TrainerCallback):
    """Every trainable parameter's gradient at the first optimizer step (after backward)."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == 0:
            self.grads = {n: p.grad.detach().double().clone()
                          for n, p in kw["model"].named_parameters()
                          if p.requires_grad and p.grad is not None}  # fmt: skip


def first_gradients(cfg: Any) -> dict[str, torch.Tensor]:
    from moetune.train import trainer as trainer_mod

    callback, real = _FirstGradients(), trainer_mod.build_trainer

    def with_callback(*args: Any, **kwargs: Any) -> Any:
        trainer, routing = real(*args, **kwargs)
        trainer.add_callback(callback)
        return trainer, routing

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer_mod, "build_trainer", with_callback)
        train_capturing(cfg)
    return callback.grads


KINDS = {  # kind -> model.* overrides
    "bf16": {},
    "int8": {"experts_dtype": "int8"},
    "nf4": {"experts_dtype": "nf4"},
    "fp8": {"dtype": "float32"},
    "bnb4": {"dtype": "float32"},
    "bnb8": {"dtype": "float32"},
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_measuring_the_base_leaves_the_first_gradient_as_it_was(
    wide: dict[str, Path], tmp_path: Path, kind: str
) -> None:
    base = _base(wide, kind)
    grads = []
    for every in (0, 1):
        cfg = run_config(base, wide["data"], tmp_path / f"run{every}", max_steps=1, save_steps=1,
                         batch_size=4, routing_every=every,
                         lora__targets=["attention", "experts"])  # fmt: skip
        for key, value in KINDS[kind].items():
            setattr(cfg.model, key, value)
        grads.append(first_gradients(cfg))
    off, on = grads
    assert off and sorted(off) == sorted(on)
    assert any("self_attn" in n for n in off) and any("experts" in n for n in off)
    for name, ref in off.items():
        assert float((on[name] - ref).norm()) <= 1e-6 * float(ref.norm()) + 1e-30, name
    upstream = [g for n, g in off.items() if "layers.0." in n and "lora_B" in n]
    assert upstream and all(float(g.norm()) > 0 for g in upstream)  # gradient reached layer 0


class _Kernel(nn.Module):
    """A module holding integer weights, recording the mode of each forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("weight", torch.zeros(4, 4, dtype=torch.uint8))
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.training)
        return x


def test_measuring_runs_kernels_in_train_mode_and_restores_every_flag() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), _Kernel(), nn.BatchNorm1d(4))
    model.train()
    model[3].eval()  # a module the trainer keeps in eval: a blanket train() would flip it
    before = [m.training for m in model.modules()]
    x = torch.ones(3, 4, requires_grad=True)
    with measuring(model):
        assert [m.training for m in model.modules()] == [False, False, False, True, False]
        y = model(x)
    assert not y.requires_grad and torch.equal(y, model[3](model[0](x)).detach())  # no dropout
    assert model[2].seen == [True]
    assert [m.training for m in model.modules()] == before
    model.eval()
    with measuring(model):
        model(x)
    assert model[2].seen == [True, True] and not any(m.training for m in model.modules())


def test_stores_integers_reads_weights_not_counters() -> None:
    assert stores_integers(_Kernel()) and not stores_integers(nn.Linear(2, 2))
    assert not stores_integers(nn.BatchNorm1d(2))  # num_batches_tracked: a 0-dim int64
