"""GPTQ as AutoGPTQ / GPTQModel write it (quant_method gptq; Qwen3-30B-A3B-GPTQ-Int4).

Per Linear: `qweight` int32 [in·bits/32, out] (codes packed along the input rows, lowest bits
first), `qzeros` int32 [groups, out·bits/32] (packed along the output columns), `scales`
[groups, out] (fp16) and `g_idx` int32 [in] (input row i uses group g_idx[i]; with desc_act
the order is the activation order, else i // group_size). W[o, i] = scale[g, o] ×
(code[i, o] − zero[g, o]) with g = g_idx[i] – the reference kernels' formula. The original
(`checkpoint_format: gptq`, v1) format stores each zero minus one, so the kernels add one;
`gptq_v2` stores it as is. Per-expert tensors of gate and up are concatenated along the
stored rows, so a stack holds `parts` projections one after another (told by g_idx's length).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import QuantError, register
from moetune.engine.stored.formats import Buffers, StoredFormat, divides, group_size
from moetune.engine.stored.words import (
    bits_of,
    check_groups,
    pack_words,
    parts_of,
    round_groups,
    unpack_words,
)

_FIX = "use a 4- or 8-bit GPTQ checkpoint, or its bf16 release"


def gptq_bits(qcfg: dict[str, Any]) -> int:
    bits = qcfg.get("bits", 4)
    if bits not in (4, 8):
        raise QuantError(f"GPTQ with {bits!r}-bit codes is not read", _FIX)
    return int(bits)


@register
class GPTQ(StoredFormat):
    name = method = "gptq"
    label = "GPTQ (quant_method gptq, v1 zeros)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "qweight": ("qweight", "_qweight"),
        "qzeros": ("qzeros", "_qzeros"),
        "scales": ("scales", "_scales"),
        "g_idx": ("g_idx", "_g_idx"),
    }
    scales = ("scales",)
    zero_offset: ClassVar[int] = 1  # v1: a zero is stored minus one
    checkpoint_format: ClassVar[str] = "gptq"

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        if qcfg.get("quant_method") != "gptq":
            return False
        fmt = qcfg.get("checkpoint_format") or "gptq"
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantError(f"GPTQ checkpoint_format {fmt!r} is not read", _FIX)
        gptq_bits(qcfg)
        return bool(fmt == cls.checkpoint_format)

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        bits, group = gptq_bits(qcfg), cls.options(qcfg)["group"]
        return bits / 8 + ((2 + bits / 8) / group if group else 0)

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        group = group_size(qcfg.get("group_size", 128), "GPTQ", channel=(None, -1))
        return {"group": group, "bits": gptq_bits(qcfg)}

    @classmethod
    def config(cls, group: int = 32, bits: int = 4, **options: Any) -> dict[str, Any]:
        return {
            "quant_method": "gptq",
            "bits": bits,
            "group_size": group or -1,
            "desc_act": False,
            "sym": True,
            "checkpoint_format": cls.checkpoint_format,
        }

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        parts = parts_of(buffers["g_idx"].shape[-1], inp, "gptq g_idx")
        part = divides(out, parts, "gptq projections")
        rows = buffers["qweight"].shape[1] // parts
        bits = bits_of(rows, inp, "gptq qweight")
        groups = buffers["scales"].shape[1]
        divides(part * bits, 32, "gptq qzeros words")
        return {
            "qweight": (parts * rows, part),
            "qzeros": (groups, part * bits // 32),
            "scales": (groups, part),
            "g_idx": (parts * inp,),
        }

    @classmethod
    def check(cls, buffers: Buffers, out_in: tuple[int, int], where: str) -> None:
        super().check(buffers, out_in, where)
        parts = buffers["g_idx"].shape[-1] // out_in[1]
        check_groups(buffers["g_idx"], buffers["scales"].shape[1] // parts, where)

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        out, inp = out_in
        qweight, scales, g_idx = buffers["qweight"], buffers["scales"], buffers["g_idx"]
        e, parts = qweight.shape[0], g_idx.shape[-1] // inp
        bits = bits_of(qweight.shape[1] // parts, inp, "gptq qweight")
        # [E, parts·rows, part] -> codes [E, parts, in, part]
        words = qweight.reshape(e, parts, -1, out // parts).transpose(-1, -2)
        codes = unpack_words(words, bits)[..., :inp].transpose(-1, -2)
        groups = scales.shape[1] // parts
        zeros = unpack_words(buffers["qzeros"], bits) + cls.zero_offset
        zeros, scale = (t.reshape(e, parts, groups, -1) for t in (zeros, scales))
        idx = g_idx.long().reshape(e, parts, inp, 1).expand(-1, -1, -1, out // parts)
        # int codes × fp16 / bf16 scales are exact in fp32: the float64 formula, rounded once
        q = (codes - zeros.gather(2, idx)).to(torch.float32)
        w = q * scale.gather(2, idx).to(torch.float32)
        return w.transpose(-1, -2).reshape(e, out, inp).to(dtype)

    @classmethod
    def quantize(
        cls,
        w: torch.Tensor,
        *,
        double_quant: bool = False,
        group: int = 32,
        bits: int = 4,
        dtype: torch.dtype = torch.float16,
    ) -> dict[str, torch.Tensor]:
        """Round to nearest, symmetric, natural order (the planner's trace, re-exports)."""
        e, out, inp = w.shape
        codes, scale, _ = round_groups(w, group, bits, dtype, "gptq groups")
        codes = codes.transpose(1, 2)  # [E, in, out]: GPTQ packs along the input rows
        top, group = (1 << (bits - 1)) - 1, group or inp
        zero = torch.full((e, scale.shape[-1], out), top + 1 - cls.zero_offset)
        return {
            "qweight": pack_words(codes.transpose(1, 2), bits).transpose(1, 2).contiguous(),
            "qzeros": pack_words(zero, bits),
            "scales": scale.transpose(1, 2).contiguous(),
            "g_idx": (torch.arange(inp) // group).to(torch.int32).expand(e, inp).clone(),
        }


@register
class GPTQv2(GPTQ):
    name = method = "gptq-v2"
    label = "GPTQ (quant_method gptq, checkpoint_format gptq_v2)"
    zero_offset = 0
    checkpoint_format = "gptq_v2"
