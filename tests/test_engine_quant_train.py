"""Split LoRA on quantised experts: the engine, training, and the planner's trace.

The engine must equal the float split path on a dequantised copy of the same model, and
a step must never allocate a float expert stack; training with model.experts_dtype
int8/nf4 must reach every target, leave a plain peft adapter for the float base, and
record the quantisation; the planner must count the quantised bytes.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model

from moetune.engine import apply_split_lora
from moetune.engine.quant.stacks import peft_targets, quantize_experts_, stacks_of
from moetune.model.tiny import tiny_config
from test_engine_experts_lora import _Largest, _randomize_b
from test_engine_quant import _dequantized_copy as _dequantized
from test_train_helpers import (
    one_thread,
    reverse_rows,
    run_config,
    save_tiny_model,
    write_jsonl,
    write_small_moe_config,
)

pytestmark = pytest.mark.filterwarnings("ignore")
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _quantized_peft(method: str, **over: Any) -> Any:
    """A split-LoRA peft model on quantised experts, B random (peft starts it at 0)."""
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(**{**tiny_config("qwen3_moe-dense0"), **over})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config)
        quantize_experts_(model, method)
        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=EXPERTS)
        with peft_targets(model):
            peft_model = get_peft_model(model, lora)
    _randomize_b(peft_model)
    apply_split_lora(peft_model)
    return peft_model


def _step(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _ids(seq: int = 12, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, 64, (batch, seq), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_split_on_quantised_stacks_equals_float_path(method: str) -> None:
    quant = _quantized_peft(method)
    float_twin = _dequantized(quant)
    assert not any(stacks_of(m) for m in float_twin.modules())
    (loss_ref, grads_ref), (loss, grads) = _step(float_twin, _ids()), _step(quant, _ids())
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys() and any("experts" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_quantised_step_never_allocates_a_float_stack(method: str) -> None:
    over = dict(hidden_size=64, num_hidden_layers=1, num_experts=32, moe_intermediate_size=64,
                mlp_only_layers=[], head_dim=16)  # fmt: skip
    model = _quantized_peft(method, **over)
    stack = 32 * 64 * 64 * 4  # the smaller float stack (down_proj, fp32): 512 KiB
    with _Largest() as largest:
        _step(model, _ids(seq=16, batch=1))
    assert largest.nbytes <= stack / 4, largest.op  # reading the stack would be 2 × stack


# ------------------------------------------------------------------------ training

LOGIT_BOUND = {"int8": 1e-2, "nf4": 0.25}  # relative, as tests/test_engine_quant.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("quant_train")
    return save_tiny_model(root / "model"), write_jsonl(root / "d.jsonl", reverse_rows(16))


def _quant_run(tiny: tuple[Path, Path], out: Path, method: str, engine: str = "moetune") -> Any:
    cfg = run_config(*tiny, out, lora__engine=engine, lora__targets=["attention", "experts"],
                     max_steps=4, save_steps=4)  # fmt: skip
    cfg.model.experts_dtype = method  # type: ignore[assignment]
    cfg.model.experts_double_quant = method == "nf4"
    return cfg


@pytest.mark.parametrize("method", ["int8", "nf4"])
def test_train_on_quantised_experts(tiny: tuple[Path, Path], tmp_path: Path, method: str) -> None:
    from moetune.train import train

    with one_thread():
        result = train(_quant_run(tiny, tmp_path / "run", method), progress=False)
    assert result.coverage == 1.0 and not result.router_changed and result.steps == 4
    quant = json.loads((tmp_path / "run" / "quant.json").read_text())
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["quant"] == quant
    assert (quant["method"], quant["double_quant"]) == (method, method == "nf4")
    assert quant["bytes_after"] < quant["bytes_before"] / (2.5 if method == "int8" else 4)  # fp32
    assert len(quant["layers"]) == 2 and 0 < quant["max_error"] < LOGIT_BOUND[method]
    _adapter_loads_on_float_base(tiny[0], Path(result.adapter_dir), method)


def _adapter_loads_on_float_base(model_dir: Path, adapter: Path, method: str) -> None:
    """Plain peft on the float base vs the same adapter on the quantised base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from moetune.engine.quant.load import load_quantized

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    plain = PeftModel.from_pretrained(base, adapter).eval()
    experts_b = [p for n, p in plain.named_parameters() if "experts" in n and "lora_B" in n]
    assert experts_b and all(p.abs().sum() > 0 for p in experts_b)  # the experts trained
    quant_base, _ = load_quantized(model_dir, method, "cpu", torch.float32, error_experts=0)
    with peft_targets(quant_base):
        quant = PeftModel.from_pretrained(quant_base, adapter).eval()
    apply_split_lora(quant)
    ids = _ids(seq=10).clamp(max=base.config.vocab_size - 1)
    with torch.no_grad():
        ours, theirs = quant(input_ids=ids).logits, plain(input_ids=ids).logits
    assert float((ours - theirs).norm() / theirs.norm()) < LOGIT_BOUND[method]


def test_quantised_experts_need_the_engine(tiny: tuple[Path, Path], tmp_path: Path) -> None:
    from moetune.train import train
    from moetune.train.errors import TrainError

    with pytest.raises(TrainError, match="QUANT-EXPERTS-PEFT") as err:
        train(_quant_run(tiny, tmp_path / "run", "int8", engine="peft"), progress=False)
    assert "lora.engine: moetune" in str(err.value)
    assert not (tmp_path / "run" / "config.yaml").exists()  # stopped in preflight: nothing written


# ------------------------------------------------------------------------ planner


def test_trace_counts_quantised_expert_bytes(tmp_path: Path) -> None:
    from moetune.config import parse_config
    from moetune.model import load_spec
    from moetune.plan.trace.cache import run_trace, trace_key

    write_small_moe_config(tmp_path / "m")
    spec = load_spec(str(tmp_path / "m"))
    expert_bytes = 2 * 16 * 3 * 96 * 64 * 2  # layers × experts × (gate, up, down) × bf16
    frozen, peaks, keys = {}, {}, set()
    for method in ("bf16", "int8", "nf4"):
        cfg = parse_config({
            "model": {"id": str(tmp_path / "m"), "experts_dtype": method},
            "lora": {"engine": "moetune", "targets": ["attention", "experts"]},
            "train": {"seq_len": 64, "gradient_checkpointing": False},
        })  # fmt: skip
        result = run_trace(spec, cfg)
        frozen[method], peaks[method] = result.at_peak["frozen_weights"], result.peak_bytes
        keys.add(trace_key(spec, cfg, "fused"))
    rest = frozen["bf16"] - expert_bytes  # embeddings, attention, norms, routers
    assert 0.45 < (frozen["int8"] - rest) / expert_bytes < 0.55  # int8 + per-row fp32 scales
    assert 0.25 < (frozen["nf4"] - rest) / expert_bytes < 0.32  # 4 bits + fp32 absmax per 64
    assert peaks["nf4"] < peaks["int8"] < peaks["bf16"]
    assert len(keys) == 3  # the cache tells them apart
