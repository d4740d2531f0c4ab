"""MXFP4 as gpt-oss publishes its experts (quant_method mxfp4)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import register
from moetune.engine.stored.e2m1 import pack_e2m1, unpack_e2m1
from moetune.engine.stored.formats import (
    Buffers,
    StoredFormat,
    divides,
)


@register
class MXFP4(StoredFormat):
    """gpt-oss experts: `<proj>_blocks` uint8 [E, out, in/32, 16] (e2m1 pairs, low nibble
    first) and `<proj>_scales` uint8 [E, out, in/32] (e8m0: 2^(s - 127)); fused keys only."""

    name = method = "mxfp4"
    label = "MXFP4 (quant_method mxfp4)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "blocks": ("weight_blocks", "_blocks"),
        "scales": ("weight_scales", "_scales"),
    }
    scales = ("scales",)
    experts_only = True
    BLOCK = 32

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        return qcfg.get("quant_method") == "mxfp4"

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        return 0.5 + 1 / cls.BLOCK

    @classmethod
    def config(cls, **options: Any) -> dict[str, Any]:
        keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                "lm_head"]  # fmt: skip
        return {"quant_method": "mxfp4", "modules_to_not_convert": keep}

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        groups = divides(inp, cls.BLOCK, "mxfp4 blocks of 32")
        return {"blocks": (out, groups, cls.BLOCK // 2), "scales": (out, groups)}

    @classmethod
    def scale_values(cls, name: str, scale: torch.Tensor) -> torch.Tensor:
        values = (scale.to(torch.float32) - 127).exp2()
        return values.masked_fill(scale == 0xFF, float("nan"))  # e8m0's one NaN code

    @classmethod
    def scale_dtype_ok(cls, scale: torch.Tensor) -> bool:
        return scale.dtype == torch.uint8  # e8m0 exponents, one byte each

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        values = unpack_e2m1(buffers["blocks"])  # [E, out, in/32, 32]
        exp = buffers["scales"].to(torch.int32) - 127
        return torch.ldexp(values, exp.unsqueeze(-1)).to(dtype).flatten(-2)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False) -> dict[str, torch.Tensor]:
        e, out, inp = w.shape
        groups = w.float().reshape(e, out, divides(inp, cls.BLOCK, "mxfp4 blocks"), cls.BLOCK)
        amax = groups.abs().amax(-1).clamp_min(2.0**-126)
        exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # largest e2m1 is 6
        packed = pack_e2m1(groups / exp.exp2().unsqueeze(-1))
        return {"blocks": packed, "scales": (exp + 127).to(torch.uint8)}
