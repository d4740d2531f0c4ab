"""INT4 as compressed-tensors packs it (pack-quantized; Kimi-K2-Thinking)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import register
from moetune.engine.stored.formats import (
    Buffers,
    StoredFormat,
    divides,
)


@register
class Int4Packed(StoredFormat):
    """compressed-tensors `pack-quantized` symmetric int4 (Kimi-K2-Thinking): `weight_packed`
    int32 [out, in/8] (eight codes a word, lowest nibble first, stored + 8) and `weight_scale`
    [out, in/group] in the model's float dtype; W = (code - 8) × scale, in the scale's dtype."""

    name = method = "int4"
    label = "INT4 (compressed-tensors pack-quantized, symmetric)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "packed": ("weight_packed", "_packed"),
        "scale": ("weight_scale", "_scale"),
    }
    scales = ("scale",)

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        if qcfg.get("quant_method") != "compressed-tensors":
            return False
        weights = [g.get("weights") or {} for g in (qcfg.get("config_groups") or {}).values()]
        return qcfg.get("format") == "pack-quantized" and bool(weights) and all(
            w.get("num_bits") == 4 and w.get("type", "int") == "int" and w.get("symmetric", True)
            for w in weights)  # fmt: skip

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        return 0.5 + 2 / cls.options(qcfg)["group"]

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        groups = [(g.get("weights") or {}).get("group_size") or 128
                  for g in (qcfg.get("config_groups") or {}).values()]  # fmt: skip
        return {"group": min(groups or [128])}

    @classmethod
    def config(cls, group: int = 32, **options: Any) -> dict[str, Any]:
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "group_size": group}  # fmt: skip
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
                "ignore": ["lm_head"]}  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        groups = buffers["scale"].shape[-1]
        divides(inp, groups, "int4 scale groups")
        return {"packed": (out, math.ceil(inp / 8)), "scale": (out, groups)}

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        packed, scale = buffers["packed"], buffers["scale"]
        nibbles = packed.contiguous().view(torch.uint8)  # little-endian words: low nibble first
        codes = torch.stack((nibbles & 0xF, nibbles >> 4), dim=-1).flatten(-2)
        codes = codes[..., : out_in[1]].view(torch.int8) - 8
        e, out, inp = codes.shape
        group = inp // scale.shape[-1]
        q = codes.to(scale.dtype).view(e, out, -1, group) * scale.unsqueeze(-1)
        return q.reshape(e, out, inp).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False, group: int = 32,
                 dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:  # fmt: skip
        e, out, inp = w.shape
        groups = w.float().reshape(e, out, divides(inp, group, "int4 groups"), group)
        scale = (groups.abs().amax(-1) / 7.5).clamp_min(1e-8).to(dtype)
        codes = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
        unsigned = (codes.reshape(e, out, inp) + 8).to(torch.uint8)
        unsigned = torch.nn.functional.pad(unsigned, (0, -inp % 8))
        packed = (unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)).contiguous()
        return {"packed": packed.view(torch.int32), "scale": scale}
