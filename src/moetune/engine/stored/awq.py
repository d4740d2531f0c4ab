"""AWQ as AutoAWQ writes it (quant_method awq, version gemm; Qwen's -AWQ repos).

Per Linear: `qweight` int32 [in, out/8] and `qzeros` int32 [groups, out/8], eight 4-bit codes
a word in AWQ's interleaved order (nibble k holds column ORDER[k] of its eight), `scales`
[groups, out] (fp16). W[o, i] = (code[i, o] − zero[i // group, o]) × scale[i // group, o] –
AutoAWQ's `dequantize_gemm`. Per-expert gate and up are concatenated along the stored (input)
rows, so a stack holds `parts` projections one after another.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import QuantError, register
from moetune.engine.stored.formats import Buffers, StoredFormat, divides, group_size
from moetune.engine.stored.words import pack_words, parts_of, unpack_words

ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of a word holds column ORDER[k]
_UNDO = torch.tensor(ORDER).argsort()  # column c is nibble _UNDO[c]


def _columns(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] -> codes [..., 8n] in column order."""
    nibbles = unpack_words(words, 4).unflatten(-1, (-1, 8))
    return nibbles[..., _UNDO].flatten(-2)


def _words(codes: torch.Tensor) -> torch.Tensor:
    return pack_words(codes.unflatten(-1, (-1, 8))[..., list(ORDER)].flatten(-2), 4)


@register
class AWQ(StoredFormat):
    name = method = "awq"
    label = "AWQ (quant_method awq, GEMM)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "qweight": ("qweight", "_qweight"),
        "qzeros": ("qzeros", "_qzeros"),
        "scales": ("scales", "_scales"),
    }
    scales = ("scales",)

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        if qcfg.get("quant_method") != "awq":
            return False
        version, bits = str(qcfg.get("version", "gemm")).lower(), qcfg.get("bits", 4)
        if version != "gemm" or bits != 4 or qcfg.get("zero_point", True) is False:
            raise QuantError(f"AWQ {version} with {bits!r}-bit codes (zero_point "
                             f"{qcfg.get('zero_point', True)}) is not read",
                             "use a 4-bit AWQ GEMM checkpoint, or its bf16 release")  # fmt: skip
        return True

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        return 0.5 + 2.5 / cls.options(qcfg)["group"]

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        return {"group": group_size(qcfg.get("group_size", 128), "AWQ")}

    @classmethod
    def config(cls, group: int = 32, **options: Any) -> dict[str, Any]:
        return {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemm",
                "zero_point": True}  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        parts = parts_of(buffers["qweight"].shape[1], inp, "awq qweight")
        part = divides(out, parts, "awq projections")
        divides(part, 8, "awq packed columns")
        groups = buffers["scales"].shape[1]
        divides(inp, parts_of(groups, parts, "awq scales"), "awq groups")
        return {
            "qweight": (parts * inp, part // 8),
            "qzeros": (groups, part // 8),
            "scales": (groups, part),
        }

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        out, inp = out_in
        qweight, scales = buffers["qweight"], buffers["scales"]
        e, parts = qweight.shape[0], qweight.shape[1] // inp
        groups = scales.shape[1] // parts
        codes = _columns(qweight).reshape(e, parts, groups, inp // groups, -1)
        zeros = _columns(buffers["qzeros"]).reshape(e, parts, groups, 1, -1)
        scale = scales.reshape(e, parts, groups, 1, -1).to(torch.float32)
        # int codes × fp16 scales are exact in fp32: the float64 formula, rounded once
        w = (codes - zeros).to(torch.float32) * scale  # [E, parts, groups, group, part]
        return w.reshape(e, parts, inp, -1).transpose(-1, -2).reshape(e, out, inp).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False, group: int = 32,
                 dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:  # fmt: skip
        """Round to nearest with zero points (the planner's trace, re-exports)."""
        e, out, inp = w.shape
        g = w.float().transpose(1, 2).reshape(e, divides(inp, group, "awq groups"), group, out)
        lo, hi = g.amin(2).clamp(max=0), g.amax(2).clamp(min=0)
        scale = ((hi - lo) / 15).clamp_min(1e-8).to(dtype)  # [E, groups, out]
        zero = torch.round(-lo / scale.float()).clamp(0, 15)
        codes = torch.round(g / scale.float().unsqueeze(2) + zero.unsqueeze(2)).clamp(0, 15)
        if out % 8:
            raise QuantError(f"awq: {out} output columns are not whole words of 8",
                             "use a width divisible by 8")  # fmt: skip
        return {
            "qweight": _words(codes.reshape(e, inp, out).to(torch.int64)),
            "qzeros": _words(zero.to(torch.int64)),
            "scales": scale,
        }
