"""Integer checkpoints as their publishers write them: compressed-tensors pack-quantized (INT4 /
INT8; symmetric, zero points, group and channel, actorder group's g_idx), GPTQ (v1 and v2
zeros, desc_act) and AWQ (GEMM). compressed-tensors fixtures are made by its own compressor
and compared with its own `decompress` bit for bit; GPTQ / AWQ fixtures are packed here by the
documented layout and compared with the reference kernels' formula in float64, rounded once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import moetune.engine  # noqa: F401  (registers the formats)
from moetune.engine.quant.stacks import QuantError, QuantizedStack
from moetune.engine.stored.awq import AWQ
from moetune.engine.stored.formats import stored_format
from moetune.engine.stored.gptq import GPTQ, GPTQv2
from moetune.engine.stored.int4 import (
    Int4Packed,
    Int4PackedGIdx,
    Int4PackedZeroPoint,
    Int4PackedZeroPointGIdx,
)

DTYPES = [torch.float32, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _w(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=_gen(seed)) * 0.05


# ---- compressed-tensors: fixtures and references from its own compressor ----


def _ct(
    w: torch.Tensor, bits: int, group: int | None, symmetric: bool, perm: torch.Tensor | None = None
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A Linear's tensors as compressed-tensors saves them, and its own decompression.
    `perm` (actorder group, as llm-compressor < 0.14 wrote it): groups are formed in the
    permuted column order, codes stay in the natural order, `weight_g_idx` maps them."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.pack_quantized.helpers import (
        pack_to_int32,
        unpack_from_int32,
    )
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=bits, strategy=strategy, group_size=group,
                            symmetric=symmetric)  # fmt: skip
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = BaseCompressor.load_from_registry("pack-quantized")
    src = w if perm is None else w[:, perm]
    g = src.float().reshape(src.shape[0], -1, group or src.shape[1])
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), args)
    state = {"weight": src, "weight_scale": scale.to(w.dtype), "weight_zero_point": zero}
    sd = comp.compress(state, scheme)
    ref = comp.decompress(sd, scheme)["weight"]
    if perm is not None:
        back = perm.argsort()
        codes = unpack_from_int32(sd["weight_packed"], bits, w.shape)[:, back]
        sd["weight_packed"] = pack_to_int32(codes, bits)
        sd["weight_g_idx"] = (back // group).to(torch.int32)
        ref = ref[:, back]
    return sd, ref


_CT_BUFS = {"weight_packed": "packed", "weight_scale": "scale", "weight_zero_point": "zero",
            "weight_g_idx": "g_idx"}  # fmt: skip


def _bufs(*linears: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-projection tensors concatenated along their rows as the loader reads them, E = 1."""
    names = [n for n in linears[0] if n in _CT_BUFS]
    return {_CT_BUFS[n]: torch.cat([sd[n] for sd in linears])[None] for n in names}


CT_CASES = [  # (format, bits, group, symmetric, actorder group)
    (Int4Packed, 4, 16, True, False),
    (Int4Packed, 8, 16, True, False),
    (Int4Packed, 4, None, True, False),
    (Int4PackedZeroPoint, 4, 16, False, False),
    (Int4PackedZeroPoint, 8, None, False, False),
    (Int4PackedGIdx, 4, 16, True, True),
    (Int4PackedZeroPointGIdx, 4, 16, False, True),
    (Int4PackedZeroPointGIdx, 8, 32, False, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("fmt", "bits", "group", "sym", "act"), CT_CASES)
def test_compressed_tensors_equals_its_decompress(fmt: type, bits: int, group: int | None,
                                                  sym: bool, act: bool,
                                                  dtype: torch.dtype) -> None:  # fmt: skip
    perm = torch.randperm(64, generator=_gen(3)) if act else None
    sd, ref = _ct(_w(24, 64).to(dtype), bits, group, sym, perm)
    bufs = _bufs(sd)
    fmt.check(bufs, (24, 64), "t")
    mine = fmt.dequantize(bufs, (24, 64), dtype)[0]
    assert mine.dtype == ref.dtype == dtype and torch.equal(mine, ref)
    assert float((mine.float() - _w(24, 64).float()).norm() / _w(24, 64).norm()) < 0.2


@pytest.mark.parametrize(("fmt", "bits", "group", "sym", "act"), CT_CASES[3:])
def test_compressed_tensors_fused_gate_up(fmt: type, bits: int, group: int | None, sym: bool,
                                          act: bool) -> None:  # fmt: skip
    """gate and up stored per expert, read as one stack: each keeps its own g_idx and zeros."""
    perms = [torch.randperm(64, generator=_gen(s)) if act else None for s in (4, 5)]
    (gate, r1), (up, r2) = (_ct(_w(16, 64, s), bits, group, sym, p)
                            for s, p in ((1, perms[0]), (2, perms[1])))  # fmt: skip
    bufs = _bufs(gate, up)
    fmt.check(bufs, (32, 64), "t")
    assert torch.equal(fmt.dequantize(bufs, (32, 64), torch.float32)[0], torch.cat([r1, r2]))


def test_ignoring_g_idx_would_be_wrong() -> None:
    """The actorder-group fixture differs from the same codes read in natural order."""
    sd, ref = _ct(_w(24, 64), 4, 16, True, torch.randperm(64, generator=_gen(3)))
    plain = Int4Packed.dequantize(_bufs({k: v for k, v in sd.items() if k != "weight_g_idx"}),
                                  (24, 64), torch.float32)[0]  # fmt: skip
    assert float((plain - ref).norm() / ref.norm()) > 0.1


def _ct_cfg(**weights: object) -> dict[str, object]:
    w = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}
    return {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"weights": {**w, **weights}, "targets": ["Linear"]}},
    }


def _reader(qcfg: dict[str, object]) -> type:
    """The registered format that reads `qcfg` (stored_format holds it to its num_bits)."""
    found: Any = stored_format(qcfg)
    said = qcfg["config_groups"]["group_0"]["weights"]["num_bits"]  # type: ignore[index]
    assert found is not None and found.bits == said
    return next(c for c in found.__mro__ if "bits" not in vars(c) or c.bits is None)


def test_compressed_tensors_schemes_pick_their_format_or_are_refused() -> None:
    assert _reader(_ct_cfg()) is Int4Packed
    assert _reader(_ct_cfg(num_bits=8, strategy="channel", group_size=None)) is Int4Packed
    assert _reader(_ct_cfg(symmetric=False)) is Int4PackedZeroPoint
    assert _reader(_ct_cfg(actorder="group")) is Int4PackedGIdx
    assert _reader(_ct_cfg(actorder="weight")) is Int4Packed  # no g_idx in the file
    assert _reader(_ct_cfg(symmetric=False, actorder="group")) is Int4PackedZeroPointGIdx
    for bad, said in [
        ({"strategy": "tensor"}, "strategy tensor"),
        ({"num_bits": 2}, "2-bit"),
        ({"type": "float"}, "type float"),
        ({"actorder": "dynamic"}, "actorder"),
    ]:
        with pytest.raises(QuantError, match=said):
            stored_format(_ct_cfg(**bad))
    mixed = _ct_cfg()
    mixed["config_groups"]["group_1"] = {"format": "float-quantized", "weights": {}}  # type: ignore[index]
    with pytest.raises(QuantError, match="mixed formats"):
        stored_format(mixed)
    w4a8 = _ct_cfg()
    w4a8["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8}  # type: ignore[index]
    with pytest.raises(QuantError, match="activations"):
        stored_format(w4a8)


@pytest.mark.parametrize(
    "fmt", [Int4Packed, Int4PackedZeroPoint, Int4PackedGIdx, GPTQ, GPTQv2, AWQ]
)
def test_quantize_round_trips_per_expert(fmt: type) -> None:
    """moetune's own writer (re-exports, the planner's trace): close, one expert alone."""
    w = torch.stack([_w(32, 64, s) for s in range(3)])
    stack = QuantizedStack((3, 32, 64), False, torch.float32, fmt.name, fmt.quantize(w))
    whole = stack.dequantize(torch.float32)
    assert float((whole - w).norm() / w.norm()) < 0.2
    assert torch.equal(stack.expert(1, torch.float32), whole[1])


# ---- GPTQ / AWQ: the documented layouts, packed here; references in float64 ----


def _nibbles_packed(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [rows, n] -> int32 [rows, n·bits/32]: word w holds codes w·k..w·k+k-1
    (k = 32/bits), code j of a word in bits j·b..(j+1)·b - 1."""
    k = 32 // bits
    out = torch.zeros(codes.shape[0], codes.shape[1] // k, dtype=torch.int64)
    for j in range(k):
        out |= codes[:, j::k].to(torch.int64) << (j * bits)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def gptq_linear(out: int, inp: int, group: int, bits: int, v2: bool, desc_act: bool,
                sym: bool, seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:  # fmt: skip
    """One GPTQ Linear (qweight, qzeros, scales, g_idx) and its float64 weight [out, in]."""
    g = _gen(seed)
    top = 1 << bits
    groups = inp // group
    codes = torch.randint(0, top, (inp, out), generator=g)
    zeros = (torch.full((groups, out), top // 2) if sym
             else torch.randint(1, top - 1, (groups, out), generator=g))  # fmt: skip
    scales = (torch.rand(groups, out, generator=g) * 0.01 + 1e-3).to(torch.float16)
    order = torch.randperm(inp, generator=g) if desc_act else torch.arange(inp)
    g_idx = torch.empty(inp, dtype=torch.int32)
    g_idx[order] = (torch.arange(inp) // group).to(torch.int32)
    stored_zeros = zeros - (0 if v2 else 1)  # v1 keeps each zero minus one
    tensors = {
        "qweight": _nibbles_packed(codes.T, bits).T.contiguous(),
        "qzeros": _nibbles_packed(stored_zeros, bits),
        "scales": scales,
        "g_idx": g_idx,
    }
    gi = g_idx.long()
    w = scales.double()[gi] * (codes - zeros[gi]).double()  # [in, out]: the kernels' formula
    return tensors, w.T


GPTQ_CASES = [(4, False, False, True), (4, True, True, True), (4, False, True, False),
              (8, True, True, False), (8, False, False, True)]  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("bits", "v2", "desc_act", "sym"), GPTQ_CASES)
def test_gptq_equals_the_kernel_formula(bits: int, v2: bool, desc_act: bool, sym: bool,
                                        dtype: torch.dtype) -> None:  # fmt: skip
    fmt = GPTQv2 if v2 else GPTQ
    parts = [gptq_linear(16, 64, 16, bits, v2, desc_act, sym, s) for s in (1, 2)]
    bufs = {k: torch.cat([p[0][k] for p in parts])[None] for k in parts[0][0]}
    fmt.check(bufs, (32, 64), "t")
    ref = torch.cat([p[1] for p in parts]).to(dtype)
    assert torch.equal(fmt.dequantize(bufs, (32, 64), dtype)[0], ref)
    one = {k: v[None] for k, v in parts[0][0].items()}
    assert torch.equal(fmt.dequantize(one, (16, 64), dtype)[0], parts[0][1].to(dtype))


def awq_linear(
    out: int, inp: int, group: int, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    g = _gen(seed)
    groups = inp // group
    codes = torch.randint(0, 16, (inp, out), generator=g)
    zeros = torch.randint(0, 16, (groups, out), generator=g)
    scales = (torch.rand(groups, out, generator=g) * 0.01 + 1e-3).to(torch.float16)
    order = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's pack order
    tensors = {
        "qweight": _nibbles_packed_awq(codes, order),
        "qzeros": _nibbles_packed_awq(zeros, order),
        "scales": scales,
    }
    rows = torch.arange(inp) // group
    w = (codes - zeros[rows]).double() * scales.double()[rows]  # dequantize_gemm, in float64
    return tensors, w.T


def _nibbles_packed_awq(codes: torch.Tensor, order: list[int]) -> torch.Tensor:
    """AutoAWQ's packing: word c holds columns c·8 + order[j] in nibble j."""
    out = torch.zeros(codes.shape[0], codes.shape[1] // 8, dtype=torch.int64)
    for col in range(codes.shape[1] // 8):
        for j in range(8):
            out[:, col] |= codes[:, col * 8 + order[j]].to(torch.int64) << (j * 4)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_awq_equals_dequantize_gemm(dtype: torch.dtype) -> None:
    parts = [awq_linear(16, 64, 32, s) for s in (1, 2)]
    bufs = {k: torch.cat([p[0][k] for p in parts])[None] for k in parts[0][0]}
    AWQ.check(bufs, (32, 64), "t")
    ref = torch.cat([p[1] for p in parts]).to(dtype)
    assert torch.equal(AWQ.dequantize(bufs, (32, 64), dtype)[0], ref)


def test_gptq_awq_configs_pick_their_format_or_are_refused() -> None:
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True}
    assert stored_format(gptq) is GPTQ
    assert stored_format({**gptq, "checkpoint_format": "gptq_v2"}) is GPTQv2
    assert GPTQ.bytes_per_param(gptq) == 0.5 + 2.5 / 128
    with pytest.raises(QuantError, match="3-bit"):
        stored_format({**gptq, "bits": 3})
    with pytest.raises(QuantError, match="marlin"):
        stored_format({**gptq, "checkpoint_format": "marlin"})
    awq = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "version": "gemm",
        "zero_point": True,
    }
    assert stored_format(awq) is AWQ and AWQ.bytes_per_param(awq) == 0.5 + 2.5 / 128
    with pytest.raises(QuantError, match="gemv"):
        stored_format({**awq, "version": "GEMV"})


def test_corrupt_g_idx_and_shapes_are_refused() -> None:
    tensors, _ = gptq_linear(16, 64, 16, 4, False, True, True, 1)
    bad = {k: v[None].clone() for k, v in tensors.items()}
    bad["g_idx"][0, 0] = 9
    with pytest.raises(QuantError, match="g_idx names groups outside"):
        GPTQ.check(bad, (16, 64), "t")
    with pytest.raises(QuantError, match=r"qzeros|expected"):
        GPTQ.check({k: v[None] for k, v in tensors.items()}, (24, 64), "t")


# ---- NVFP4A16 through compressed-tensors ----


def test_compressed_tensors_nvfp4a16_equals_its_decompress() -> None:
    """Its own compressor writes gate and up (each with its global scale); read as one stack,
    equal to its own `decompress` (which returns bf16) bit for bit."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from moetune.engine.stored.ct_nvfp4 import NVFP4CompressedTensors as Fmt

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    comp = BaseCompressor.load_from_registry("nvfp4-pack-quantized")
    parts, refs = [], []
    for seed, gain in ((1, 1.0), (2, 7.0)):
        w = (_w(16, 64, seed) * gain).to(torch.bfloat16)
        glob = generate_gparam(w.float().amin(), w.float().amax())
        g = w.float().reshape(16, 4, 16)
        scale, _ = calculate_qparams(g.amin(-1), g.amax(-1), args, global_scale=glob)
        sd = comp.compress({"weight": w, "weight_scale": scale, "weight_global_scale": glob},
                           scheme)  # fmt: skip
        parts.append(sd)
        refs.append(comp.decompress(sd, scheme)["weight"])
    names = {"weight_packed": "weight", "weight_scale": "scale", "weight_global_scale": "scale_2"}
    bufs = {b: torch.cat([p[k].reshape(p[k].shape[0], -1) if p[k].ndim else p[k][None]
                          for p in parts])[None] for k, b in names.items()}  # fmt: skip
    bufs["scale_2"] = bufs["scale_2"].reshape(1, 2)
    Fmt.check(bufs, (32, 64), "t")
    mine = Fmt.dequantize(bufs, (32, 64), torch.bfloat16)[0]
    assert refs[0].dtype == torch.bfloat16 and torch.equal(mine, torch.cat(refs))
    nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
             "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float",
                                                 "group_size": 16}}}}  # fmt: skip
    assert stored_format(nvfp4) is Fmt
    nvfp4["config_groups"]["g"]["input_activations"] = {"num_bits": 4}  # type: ignore[index]
    with pytest.raises(QuantError, match="NVFP4A16"):
        stored_format(nvfp4)


@pytest.mark.parametrize(
    ("weights", "fmt"),
    [
        ({"num_bits": 4, "symmetric": False, "strategy": "group", "group_size": 16},
         Int4PackedZeroPoint),
        ({"num_bits": 8, "symmetric": True, "strategy": "channel"}, Int4Packed),
    ],
)  # fmt: skip
def test_a_model_compressed_as_llm_compressor_saves(weights: dict[str, object], fmt: type,
                                                    tmp_path: object) -> None:  # fmt: skip
    """The whole-model path llm-compressor saves through (apply_quantization_config, its
    ModelCompressor's compress_model and update_config): the config.json it writes picks the
    format, the state dict it holds is read equal to its own decompress_model."""
    import json
    from pathlib import Path

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    model = torch.nn.Sequential()
    model.add_module("proj", torch.nn.Linear(64, 24, bias=False))
    model.add_module("lm_head", torch.nn.Linear(24, 8, bias=False))
    model.to(torch.bfloat16)
    group = {"targets": ["Linear"], "weights": {"type": "int", **weights}}
    cfg = {"config_groups": {"group_0": group}, "ignore": ["lm_head"]}
    apply_quantization_config(model, QuantizationConfig.model_validate(cfg))
    proj = model.proj
    g = proj.weight.float().reshape(24, -1, int(weights.get("group_size") or 64))  # type: ignore[call-overload]
    scale, zero = calculate_qparams(g.amin(-1), g.amax(-1), proj.quantization_scheme.weights)
    proj.weight_scale.data.copy_(scale.reshape(proj.weight_scale.shape))
    if hasattr(proj, "weight_zero_point"):
        proj.weight_zero_point.data.copy_(zero.reshape(proj.weight_zero_point.shape))
    mc = ModelCompressor.from_pretrained_model(model, "pack-quantized")
    mc.compress_model(model)
    out = Path(str(tmp_path))
    (out / "config.json").write_text("{}")
    mc.update_config(str(out))
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert _reader(qcfg) is fmt
    sd = {k.removeprefix("proj."): v for k, v in model.state_dict().items() if "proj." in k}
    bufs = _bufs(sd)
    fmt.check(bufs, (24, 64), "proj")
    mine = fmt.dequantize(bufs, (24, 64), torch.bfloat16)[0]
    mc.decompress_model(model)
    assert torch.equal(mine, model.proj.weight.detach())
