"""Published quantised formats: moetune's dequantisation equals each reference bit for bit
(transformers' fp8 / mxfp4 paths, ModelOpt's NVFP4, compressed-tensors' int4), on weights
written in each published layout; bad buffers are refused in one line."""

from __future__ import annotations

import warnings

import pytest
import torch

from moetune.engine.quant.stacks import QuantError, QuantizedStack
from moetune.engine.stored.formats import (
    describe,
    stored_format,
    stored_formats,
)
from moetune.engine.stored.fp8 import BlockFP8
from moetune.engine.stored.int4 import Int4Packed
from moetune.engine.stored.mxfp4 import MXFP4
from moetune.engine.stored.nvfp4 import NVFP4

DTYPES = [torch.float32, torch.bfloat16]


def _w(e: int, out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(e, out, inp, generator=torch.Generator().manual_seed(seed)) * 0.05


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_equals_transformers_dequantize(dtype: torch.dtype) -> None:
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    bufs = BlockFP8.quantize(_w(3, 64, 96), block=(32, 32))
    assert bufs["weight"].dtype == torch.float8_e4m3fn and bufs["scale_inv"].shape == (3, 2, 3)
    pairs = zip(bufs["weight"], bufs["scale_inv"], strict=True)
    ref = torch.stack(
        [Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dtype) for w, s in pairs]
    )
    mine = BlockFP8.configured(block=(32, 32)).dequantize(bufs, (64, 96), dtype)
    assert mine.dtype == dtype and torch.equal(mine, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_packed_fp4_ue8m0_equals_transformers(dtype: torch.dtype) -> None:
    """DeepSeek-V4's FP4 experts: int8 bytes of two e2m1 codes, ue8m0 bytes per 32."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(1)
    weight = torch.randint(-128, 128, (2, 16, 32), generator=g, dtype=torch.int8)
    scale = torch.randint(110, 135, (2, 16, 2), generator=g, dtype=torch.uint8)
    ref = torch.stack([Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=dtype)
                       for w, s in zip(weight, scale, strict=True)])  # fmt: skip
    mine = BlockFP8.dequantize({"weight": weight, "scale_inv": scale}, (16, 64), dtype)
    assert torch.equal(mine, ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_equals_transformers_convert(dtype: torch.dtype) -> None:
    from transformers.integrations.mxfp4 import _convert_moe_packed_tensors

    bufs = MXFP4.quantize(_w(4, 48, 64))
    assert bufs["blocks"].shape == (4, 48, 2, 16) and bufs["scales"].shape == (4, 48, 2)
    ref = _convert_moe_packed_tensors(bufs["blocks"], bufs["scales"], dtype=dtype)  # [E, in, out]
    assert torch.equal(MXFP4.dequantize(bufs, (48, 64), dtype), ref.transpose(1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_equals_modelopt(dtype: torch.dtype) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    bufs = NVFP4.quantize(_w(2, 32, 64))
    for e in range(2):
        q = NVFP4QTensor(torch.Size((32, 64)), dtype, bufs["weight"][e])
        ref = q.dequantize(dtype, scale=bufs["scale"][e], double_scale=bufs["scale_2"][e, 0],
                           block_sizes={-1: 16})  # fmt: skip
        one = {k: v[e : e + 1] for k, v in bufs.items()}
        assert torch.equal(NVFP4.dequantize(one, (32, 64), dtype)[0], ref)


def test_nvfp4_fused_parts_keep_their_own_second_scale() -> None:
    gate, up = NVFP4.quantize(_w(1, 16, 32, 1)), NVFP4.quantize(_w(1, 16, 32, 2) * 7)
    fused = {k: torch.cat([gate[k], up[k]], dim=1) for k in gate}
    assert fused["scale_2"].shape == (1, 2)
    whole = NVFP4.dequantize(fused, (32, 32), torch.float32)
    assert torch.equal(whole[:, :16], NVFP4.dequantize(gate, (16, 32), torch.float32))
    assert torch.equal(whole[:, 16:], NVFP4.dequantize(up, (16, 32), torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_equals_compressed_tensors(dtype: torch.dtype) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    bufs = Int4Packed.quantize(_w(2, 24, 64), group=32)
    args = QuantizationArgs(num_bits=4, group_size=32, strategy="group", symmetric=True)
    for e in range(2):
        codes = unpack_from_int32(bufs["packed"][e], 4, torch.Size((24, 64)))
        ref = dequantize(codes, bufs["scale"][e], args=args, dtype=dtype)
        one = {k: v[e : e + 1] for k, v in bufs.items()}
        assert torch.equal(Int4Packed.dequantize(one, (24, 64), dtype)[0], ref)


@pytest.mark.parametrize("fmt", [BlockFP8, MXFP4, NVFP4, Int4Packed])
def test_round_trip_is_close_and_one_expert_alone(fmt: type) -> None:
    w = _w(3, 32, 64)
    opts = {"block": (16, 32)} if fmt is BlockFP8 else {}
    stack = QuantizedStack((3, 32, 64), False, torch.float32, fmt.configured(**opts),
                           fmt.quantize(w, **opts))  # fmt: skip
    whole = stack.dequantize(torch.float32)
    rel = float((whole - w).norm() / w.norm())
    assert rel < (0.05 if fmt is BlockFP8 else 0.2)
    assert torch.equal(stack.expert(1, torch.float32), whole[1])


def test_formats_from_quantization_config() -> None:
    assert stored_format(None) is None
    assert stored_format({"quant_method": "fp8", "weight_block_size": [128, 128]}) is BlockFP8
    assert stored_format({"quant_method": "mxfp4"}) is MXFP4
    assert stored_format({"quant_method": "modelopt", "quant_algo": "NVFP4"}) is NVFP4
    ct = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "config_groups": {"g": {"weights": {"num_bits": 4, "group_size": 32}}}}  # fmt: skip
    found = stored_format(ct)  # held to the config's num_bits
    assert found is not None and issubclass(found, Int4Packed) and found.bits == 4
    names = {"fp8", "fp8_scaled", "mxfp4", "nvfp4", "nvfp4-ct", "int4", "int4-zp", "int4-gidx"}
    names |= {"int4-zp-gidx"}
    assert {f.name for f in stored_formats()} >= names | {"gptq", "gptq-v2", "awq"}
    with pytest.raises(QuantError) as err:  # transformers' quantizer cannot train it either
        stored_format({"quant_method": "higgs"})
    assert "higgs" in str(err.value) and "MXFP4" in err.value.fix
    bnb = {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}
    assert stored_format(bnb) is None  # a pre-quantised QLoRA base: transformers' path, as ever
    assert describe({"quant_method": "modelopt", "quant_algo": "FP8"}) == "modelopt / FP8"


def test_bytes_per_param() -> None:
    assert BlockFP8.bytes_per_param({"weight_block_size": [128, 128]}) == 1 + 4 / 16384
    assert MXFP4.bytes_per_param({}) == 0.5 + 1 / 32
    assert NVFP4.bytes_per_param({}) == 0.5 + 1 / 16
    ct = {"config_groups": {"g": {"weights": {"group_size": 32}}}}
    assert Int4Packed.bytes_per_param(ct) == 0.5 + 2 / 32


def test_check_refuses_bad_scales_and_shapes() -> None:
    fp8 = BlockFP8.configured(block=(16, 16))
    bufs = fp8.quantize(_w(2, 32, 32))
    fp8.check(bufs, (32, 32), "layer 0")
    for bad in (float("nan"), float("inf"), 0.0):
        broken = dict(bufs, scale_inv=bufs["scale_inv"].clone())
        broken["scale_inv"][1, 0, 0] = bad
        with pytest.raises(QuantError, match="NaN, Inf or zero"):
            fp8.check(broken, (32, 32), "layer 0")
    with pytest.raises(QuantError, match=r"grid \[3, 2\] is not ceil") as err:
        fp8.check(dict(bufs, scale_inv=torch.ones(2, 3, 2)), (32, 32), "layer 0")
    assert "weight_block_size" in err.value.fix
    with pytest.raises(QuantError, match="expected"):
        fp8.check(dict(bufs, weight=bufs["weight"][:, :, :16]), (32, 32), "layer 0")
    with pytest.raises(QuantError, match="does not divide"):
        MXFP4.check(MXFP4.quantize(_w(1, 8, 64)), (8, 48), "layer 0")


def test_stored_linear_exact_input_gradient_and_lora_through_peft() -> None:
    """A StoredLinear equals nn.Linear over its dequantised weight in output and input
    gradient, keeps no float weight, and takes LoRA through peft as an nn.Linear."""
    from peft import LoraConfig, get_peft_model

    from moetune.engine.stored.linear import StoredLinear, dequantize_linears_

    w = _w(1, 32, 64)
    stack = QuantizedStack((1, 32, 64), False, torch.float32, BlockFP8.configured(block=(16, 32)),
                           BlockFP8.quantize(w, block=(16, 32)))  # fmt: skip
    bias = torch.randn(32)
    stored = StoredLinear(stack, bias)
    plain = torch.nn.Linear(64, 32)
    plain.weight.data, plain.bias.data = stack.expert(0, torch.float32), bias.clone()
    x1 = torch.randn(5, 64, dtype=torch.float64).float().requires_grad_(True)
    x2 = x1.detach().clone().requires_grad_(True)
    stored(x1).square().sum().backward()
    plain(x2).square().sum().backward()
    assert torch.equal(stored(x1), plain(x2)) and torch.equal(x1.grad, x2.grad)
    assert stored.weight.untyped_storage().nbytes() <= 4  # a stand-in, not a float weight
    assert "weight" not in stored.state_dict() and "stored.weight" in stored.state_dict()
    assert stored.to(torch.bfloat16).weight.untyped_storage().nbytes() <= 2  # still a stand-in

    model = torch.nn.Sequential()
    model.add_module("proj", StoredLinear(stack, None))
    peft_model = get_peft_model(model, LoraConfig(r=2, target_modules=["proj"]))
    assert type(peft_model.base_model.model.proj.base_layer) is StoredLinear
    assert dequantize_linears_(model) == 1  # back to a plain Linear, under peft's wrapper too
    assert type(peft_model.base_model.model.proj.base_layer) is torch.nn.Linear
