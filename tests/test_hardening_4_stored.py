"""Issue 48 (fourth hardening pass), stored-format metadata of the wrong shape or type:
refused in one line naming the tensor or the field, before a wrong number is trained on."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from moetune.cli import app
from moetune.demo.base import SHIPPED_DIR
from moetune.engine.quant.stacks import QuantError
from moetune.engine.stored.fp8 import BlockFP8
from moetune.engine.stored.mxfp4 import MXFP4
from moetune.engine.stored.nvfp4 import NVFP4


def _w(e: int, out: int, inp: int) -> torch.Tensor:
    return torch.randn(e, out, inp, generator=torch.Generator().manual_seed(0)) * 0.05


def _refused(fmt, bufs, out_in, says: str) -> None:
    with pytest.raises(QuantError) as info:
        fmt.check(bufs, out_in, "model.layers.0.mlp.experts.down_proj")
    assert says in info.value.cause and "experts.down_proj" in info.value.cause
    assert "\n" not in str(info.value) and info.value.fix


def test_scales_of_an_integer_dtype_are_refused_not_read_as_numbers():
    fp8 = BlockFP8.configured(block=(16, 16))
    bufs = fp8.quantize(_w(2, 32, 32))
    fp8.check(bufs, (32, 32), "ok")
    as_int = dict(bufs, scale_inv=torch.ones_like(bufs["scale_inv"], dtype=torch.int32))
    _refused(fp8, as_int, (32, 32), "scales 'scale_inv' are int32, not the format's scale type")
    fp8.check(dict(bufs, scale_inv=torch.full_like(bufs["scale_inv"], 127, dtype=torch.uint8)),
              (32, 32), "ue8m0 bytes are fp8's own")  # fmt: skip
    nv = NVFP4.quantize(_w(1, 16, 32))
    as_int = dict(nv, scale=nv["scale"].view(torch.uint8))  # e4m3 bytes read as integers
    _refused(NVFP4, as_int, (16, 32), "scales 'scale' are uint8")
    mx = MXFP4.quantize(_w(1, 8, 64))
    _refused(MXFP4, dict(mx, scales=mx["scales"].float()), (8, 64), "are float32")


def test_negative_scales_and_e8m0_nan_are_refused():
    fp8 = BlockFP8.configured(block=(16, 16))
    bufs = fp8.quantize(_w(2, 32, 32))
    neg = dict(bufs, scale_inv=bufs["scale_inv"].clone())
    neg["scale_inv"][1, 0, 0] *= -1  # was: trained on the expert with its sign flipped
    _refused(fp8, neg, (32, 32), "hold NaN, Inf or zero (or negative) values")
    mx = MXFP4.quantize(_w(1, 8, 64))
    mx["scales"][0, 3, 1] = 0xFF  # e8m0's NaN code
    _refused(MXFP4, mx, (8, 64), "hold NaN, Inf or zero")
    mx["scales"][0, 3, 1] = 0xFE  # 2^127: large, but a number
    MXFP4.check(mx, (8, 64), "ok")


@pytest.mark.parametrize(
    ("qcfg", "says"),
    [
        ({"quant_method": "fp8", "weight_block_size": 128}, "is not two positive integer sizes"),
        ({"quant_method": "fp8", "weight_block_size": "64"}, "is not two positive integer sizes"),
        ({}, "quantization_config is empty"),
        ("fp8", "quantization_config is a str, not a mapping"),
    ],
)
@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_quantization_config_of_the_wrong_shape_is_one_line(tmp_path: Path, qcfg, says, command):
    base = tmp_path / "base"
    base.mkdir()
    config = json.loads((SHIPPED_DIR / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
    shutil.copy(SHIPPED_DIR / "tokenizer.json", base)
    result = CliRunner().invoke(app, [command, str(base)])
    assert result.exit_code == 2, result.output  # was: exit 3 or, for "64", a 6x4 block
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "fix:" in lines[0]
