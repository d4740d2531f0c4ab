"""Issue 48 (fifth hardening pass), export: `export --format mlx` over a base published
quantised (block FP8) converts the base as moetune dequantises it – mlx-lm alone refuses the
scales as unknown parameters (exit 3 before) – and mlx-lm then serves what peft computes on
that dequantised base."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from export_fixtures import make_adapter, make_base
from moetune.cli import app
from moetune.engine.stored.write import write_stored

pytest.importorskip("mlx_lm", reason="mlx-lm is not installed (pip install 'moetune[mlx]')")
pytestmark = pytest.mark.filterwarnings("ignore")
TINY = {"hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_experts": 4, "mlp_only_layers": [], "head_dim": 16, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 64}  # fmt: skip
TOKENS = [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def test_an_fp8_base_exports_to_mlx_as_its_dequantised_weights(tmp_path: Path) -> None:
    from moetune.export.merged import load_base
    from moetune.export.mlx import _relative, mlx_logits, peft_logits

    float_base = make_base(tmp_path, "qwen3_moe-dense0", **TINY)
    adapter = make_adapter(float_base, tmp_path / "adapter", 0.05)
    fp8 = write_stored(float_base, tmp_path / "fp8", "fp8", block=(16, 32))
    out = tmp_path / "out"
    args = ["export", str(adapter), "--base", str(fp8), "--format", "mlx", "--out", str(out)]
    result = CliRunner().invoke(app, [*args, "--no-check"])
    assert result.exit_code == 0, result.output  # was: exit 3, "parameters not in model"
    assert not (out / ".float-base").exists() and (out / "model" / "config.json").is_file()
    assert "quantization_config" not in (out / "model" / "config.json").read_text()
    dequantised = tmp_path / "dequantised"  # what training read: moetune's reader
    load_base(str(fp8), torch.float32).save_pretrained(str(dequantised))
    served = mlx_logits(out / "model", out / "adapters", TOKENS)
    trained = peft_logits(dequantised, adapter, TOKENS)
    assert _relative(served, trained) < 1e-4
    fp8_gap = _relative(peft_logits(float_base, adapter, TOKENS), trained)
    assert fp8_gap > 1e-4  # the FP8 rounding shows: the mlx model is not the float base
