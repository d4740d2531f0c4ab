"""A bitsandbytes pre-quantised base (the "-bnb-4bit" repos): made by transformers' own
quantise-on-load + save_pretrained, trained with the adapter on the experts over the very
weights bitsandbytes' `dequantize_4bit` reads from the files, planned at the bytes it holds;
with bitsandbytes missing, refused in one line naming the install (lint, plan's spec, train)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from moetune.config import RunConfig
from moetune.engine.stored import formats
from moetune.lint import RULES, LintContext
from moetune.model import load_spec
from moetune.plan.analytic import frozen_bytes
from moetune.plan.step import Step, bnb_linear_bytes
from moetune.plan.stored import stored_summary
from test_train_helpers import (
    reverse_rows,
    run_config,
    save_tiny_model,
    train_capturing,
    write_jsonl,
)
from test_train_routing_modes import WIDE, bnb_base

pytestmark = pytest.mark.filterwarnings("ignore")
BNB4 = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": True}  # fmt: skip


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bnb_base")
    float_dir = save_tiny_model(root / "float", **WIDE)
    return {"float": float_dir, "data": write_jsonl(root / "d.jsonl", reverse_rows(8))}


def _expert_b(adapter_dir: str) -> list[torch.Tensor]:
    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    return [t for k, t in adapter.items() if "experts" in k and "lora_B" in k]


def test_trains_over_the_weights_bitsandbytes_reads(wide: dict[str, Path], tmp_path: Path) -> None:
    base = bnb_base(wide["float"], tmp_path / "bnb4", 4)  # skips without bitsandbytes
    from bitsandbytes.functional import QuantState, dequantize_4bit

    cfg = run_config(base, wide["data"], tmp_path / "run", max_steps=2, save_steps=2,
                     lora__targets=["attention", "experts"])  # fmt: skip
    cfg.model.dtype = "float32"
    result, trainer = train_capturing(cfg)
    assert result.coverage == 1.0 and result.steps == 2
    experts_b = _expert_b(result.adapter_dir)
    assert experts_b and all(float(b.abs().sum()) > 0 for b in experts_b)  # experts trained
    stored = load_file(str(base / "model.safetensors"))
    name = "model.layers.1.self_attn.q_proj"
    state = {k.removeprefix(f"{name}.weight."): v for k, v in stored.items()
             if k.startswith(f"{name}.weight.")}  # fmt: skip
    reference = dequantize_4bit(stored[f"{name}.weight"], QuantState.from_dict(state, "cpu"))
    layer = trainer.model.get_submodule(f"base_model.model.{name}").base_layer
    eye = torch.eye(layer.in_features)
    with torch.no_grad():  # the Linear the run trains over, read through its own forward
        trained_over = layer(eye).T
    assert trained_over.shape == reference.shape
    assert torch.equal(trained_over, reference.float())
    _merged_is_dequantised_plus_delta(result.adapter_dir, tmp_path, wide["data"], name, reference)


def _merged_is_dequantised_plus_delta(adapter_dir: str, tmp_path: Path, items: Path, name: str,
                                      reference: torch.Tensor) -> None:  # fmt: skip
    """export merged writes bitsandbytes' own dequantised weight + the adapter's ΔW (fp64
    reference), unquantised, and its served == trained check passes."""
    from typer.testing import CliRunner

    from moetune.cli import app

    out = tmp_path / "merged"
    args = ["export", str(tmp_path / "run"), "--format", "merged", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--items", str(items)])
    assert result.exit_code == 0, result.output
    adapter = load_file(str(Path(adapter_dir) / "adapter_model.safetensors"))
    config = json.loads((Path(adapter_dir) / "adapter_config.json").read_text())
    lora = f"base_model.model.{name}.lora_{{}}.weight"
    a, b = adapter[lora.format("A")].double(), adapter[lora.format("B")].double()
    expected = reference.double() + config["lora_alpha"] / config["r"] * (b @ a)
    merged = load_file(str(out / "model.safetensors"))
    assert f"{name}.weight.absmax" not in merged
    got = merged[f"{name}.weight"].double()
    assert float((got - expected).norm() / expected.norm()) < 1e-6
    assert float((b @ a).norm()) > 0  # the delta is there to merge


def test_plan_holds_the_linears_as_stored(wide: dict[str, Path], tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    base = bnb_base(wide["float"], tmp_path / "bnb4", 4)
    spec = load_spec(str(base))
    cfg = RunConfig.model_validate({"model": {"id": str(base), "dtype": "float32"},
                                    "lora": {"rank": 4}})  # fmt: skip
    step = Step.from_config(cfg, spec)
    assert step.stored_linear_bytes == bnb_linear_bytes(spec) == 0.5 + 1 / 64 + 4 / (64 * 256)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    # the NF4 code (16) and the nested 8-bit map (256) are per-Linear constants, left out
    held = sum(t.nbytes for k, t in model.state_dict().items()
               if not k.endswith(("quant_map", "bitsandbytes__nf4")))  # fmt: skip
    planned = frozen_bytes(spec, step)
    # partial absmax blocks of 256 at these widths: at most 1 % apart
    assert abs(planned - held) <= 0.01 * held, (planned, held)
    as_float = frozen_bytes(spec, Step.from_config(cfg, load_spec(str(wide["float"]))))
    assert planned < as_float - 0.4 * spec.components.attention * 4  # not sized as float
    summary = stored_summary(spec, cfg)
    assert summary is not None and "bitsandbytes 4-bit" in summary["text"]


@pytest.fixture
def without_bnb(monkeypatch: pytest.MonkeyPatch) -> None:
    """bitsandbytes as missing, to transformers' quantizer (and a fresh format decision)."""
    import transformers.quantizers.quantizer_bnb_4bit as bnb4

    monkeypatch.setattr(bnb4, "is_bitsandbytes_available", lambda: False)
    monkeypatch.setattr(formats, "_FORMATS", {})


def _declared_bnb(wide: dict[str, Path], out: Path) -> Path:
    """The float base with a bitsandbytes quantization_config (refused before any weight)."""
    shutil.copytree(wide["float"], out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": BNB4}))
    return out


def test_missing_library_refused_by_lint(wide: dict[str, Path], tmp_path: Path,
                                         without_bnb: None) -> None:  # fmt: skip
    base = _declared_bnb(wide, tmp_path / "declared")
    cfg = RunConfig.model_validate({"model": {"id": str(base)}, "lora": {"rank": 4}})
    ctx = LintContext(config=cfg, spec=load_spec(str(base)), env={}, versions={})
    finding = RULES.get("QUANT-BASE-LIBRARY").check(ctx)
    assert finding is not None and finding.severity == "error"
    assert "pip install" in finding.message and "bitsandbytes" in finding.message
    assert "\n" not in finding.message and finding.field == "model.id"


def test_missing_library_refused_by_train(wide: dict[str, Path], tmp_path: Path,
                                          without_bnb: None) -> None:  # fmt: skip
    from typer.testing import CliRunner

    from moetune.cli import app

    base = _declared_bnb(wide, tmp_path / "declared")
    cfg = run_config(base, wide["data"], tmp_path / "run", max_steps=1)
    (tmp_path / "run.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])
    assert result.exit_code == 2, result.output
    assert "pip install -U bitsandbytes" in result.output and "Traceback" not in result.output
    assert not list((tmp_path / "run").rglob("adapter_model.safetensors"))


def test_lint_silent_with_the_library_or_a_float_base(
    wide: dict[str, Path], tmp_path: Path
) -> None:
    check: Any = RULES.get("QUANT-BASE-LIBRARY").check
    for base in (wide["float"], bnb_base(wide["float"], tmp_path / "bnb8", 8)):
        cfg = RunConfig.model_validate({"model": {"id": str(base)}, "lora": {"rank": 4}})
        ctx = LintContext(config=cfg, spec=load_spec(str(base)), env={}, versions={})
        assert check(ctx) is None
    assert formats.missing_library(BNB4) is None


def per_expert_bnb(base: Path, out: Path) -> Path:
    """`base` (a bnb 4-bit save) with every expert's Linear 4-bit too, as transformers 4 saved
    MoE bases: bitsandbytes' own quantize_4bit and its QuantState.as_dict keys."""
    import bitsandbytes.functional as bnbf
    from safetensors.torch import save_file

    shutil.copytree(base, out)
    tensors = load_file(str(base / "model.safetensors"))
    for key in [k for k in tensors if ".mlp.experts." in k and k.endswith("_proj.weight")]:
        packed, state = bnbf.quantize_4bit(tensors[key].float().contiguous(), quant_type="nf4",
                                           compress_statistics=True)  # fmt: skip
        tensors[key] = packed
        tensors |= {f"{key}.{k}": v for k, v in state.as_dict(packed=True).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_experts_quantised_one_linear_each_refused(wide: dict[str, Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from moetune.cli import app

    base = per_expert_bnb(bnb_base(wide["float"], tmp_path / "bnb4", 4), tmp_path / "old")
    cfg = run_config(base, wide["data"], tmp_path / "run", max_steps=1)
    (tmp_path / "run.yaml").write_text(json.dumps(cfg.model_dump(mode="json")))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "run.yaml")])
    assert result.exit_code == 2, result.output
    assert "one Linear each" in result.output and "Traceback" not in result.output
    assert "mlp.experts." in result.output and "bf16 release" in result.output


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_offload_refused_before_loading(
    wide: dict[str, Path], tmp_path: Path, offload: str
) -> None:
    pytest.importorskip("bitsandbytes", reason="without it the base is refused for that first")
    from moetune.train import train
    from moetune.train.errors import TrainError

    base = _declared_bnb(wide, tmp_path / "declared")  # the packed bytes are never read
    cfg = run_config(base, wide["data"], tmp_path / "run", max_steps=1, offload=offload,
                     lora__targets=["attention", "experts"])  # fmt: skip
    with pytest.raises(TrainError, match=r"train\.offload does not read a bitsandbytes"):
        train(cfg, progress=False)
    assert not (tmp_path / "run").exists()
