"""NVFP4 as NVIDIA ModelOpt publishes it (quant_method modelopt, quant_algo NVFP4)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import register
from moetune.engine.stored.e2m1 import pack_e2m1, unpack_e2m1
from moetune.engine.stored.formats import (
    FP8_MAX,
    Buffers,
    StoredFormat,
    divides,
)


@register
class NVFP4(StoredFormat):
    """NVIDIA ModelOpt NVFP4 (Nemotron 3, GLM-5.x NVFP4): `weight` uint8 [out, in/2] (e2m1
    pairs, low nibble first), `weight_scale` float8_e4m3fn [out, in/16] and an fp32
    `weight_scale_2` per Linear; W = e2m1 × (weight_scale × weight_scale_2). Projections fused
    into one stack keep one second-level scale each ([E, parts], over equal row ranges)."""

    name = method = "nvfp4"
    label = "NVFP4 (quant_method modelopt, quant_algo NVFP4)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "weight": ("weight", ""), "scale": ("weight_scale", "_scale"),
            "scale_2": ("weight_scale_2", "_scale_2")}  # fmt: skip
    scales = ("scale", "scale_2")
    BLOCK = 16

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        algo = str(qcfg.get("quant_algo") or "").upper()
        return qcfg.get("quant_method") == "modelopt" and algo == "NVFP4"

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        return 0.5 + 1 / cls.BLOCK

    @classmethod
    def config(cls, **options: Any) -> dict[str, Any]:
        return {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": cls.BLOCK,
                "exclude_modules": ["lm_head"]}  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        parts = buffers["scale_2"].shape[1] if buffers["scale_2"].ndim == 2 else 0
        divides(out, parts, "nvfp4 second-level scales")
        groups = divides(inp, cls.BLOCK, "nvfp4 blocks of 16")
        return {"weight": (out, inp // 2), "scale": (out, groups), "scale_2": (parts,)}

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        values = unpack_e2m1(buffers["weight"])  # [E, out, in]
        e, out, inp = values.shape
        second = buffers["scale_2"].to(torch.float32)
        rows = second.repeat_interleave(out // second.shape[1], dim=1)  # [E, out]
        block = cls._block_scales(buffers["scale"].to(torch.float32), rows.unsqueeze(-1))
        deq = values.view(e, out, inp // cls.BLOCK, cls.BLOCK) * block.unsqueeze(-1)
        return deq.reshape(e, out, inp).to(dtype)

    @staticmethod
    def _block_scales(scale: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        """One block's scale from its two levels: ModelOpt multiplies by the second level."""
        return scale * second

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False) -> dict[str, torch.Tensor]:
        e, out, inp = w.shape
        groups = w.float().reshape(e, out, divides(inp, cls.BLOCK, "nvfp4 blocks"), cls.BLOCK)
        second = (w.float().abs().reshape(e, -1).amax(-1) / (6.0 * FP8_MAX)).clamp_min(1e-12)
        block = groups.abs().amax(-1) / 6.0 / second.view(e, 1, 1)
        scale = block.clamp_min(2.0**-9).to(torch.float8_e4m3fn)
        unit = groups / (scale.float() * second.view(e, 1, 1)).unsqueeze(-1)
        packed = pack_e2m1(unit.reshape(e, out, inp))
        return {"weight": packed, "scale": scale, "scale_2": second.unsqueeze(-1)}
