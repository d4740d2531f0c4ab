"""Block FP8 as DeepSeek, Qwen, GLM, MiniMax and Kimi publish it (quant_method fp8)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import register
from moetune.engine.stored.e2m1 import unpack_e2m1
from moetune.engine.stored.formats import (
    FP8_MAX,
    Buffers,
    StoredFormat,
    divides,
)


def _blockwise(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, out, in] -> [E, out/rows, rows, in/cols, cols]."""
    e, out, inp = w.shape
    return w.reshape(
        e, divides(out, rows, "block rows"), rows, divides(inp, cols, "block cols"), cols
    )


@register
class BlockFP8(StoredFormat):
    """DeepSeek / Qwen / GLM / MiniMax / Kimi block FP8: float8_e4m3fn weights and an fp32
    `weight_scale_inv` per block (128x128 as published); W = weight × scale_inv. DeepSeek-V4's
    FP4 experts ride the same keys: int8 bytes of two e2m1 codes and ue8m0 scales per 32."""

    name = method = "fp8"
    label = "block FP8 (quant_method fp8)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "weight": ("weight", ""),
        "scale_inv": ("weight_scale_inv", "_scale_inv"),
    }
    scales = ("scale_inv",)

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        return qcfg.get("quant_method") == "fp8"

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        rows, cols = qcfg.get("weight_block_size") or (128, 128)
        return 1 + 4 / (rows * cols)

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        return {"block": tuple(qcfg.get("weight_block_size") or (128, 128))}

    @classmethod
    def config(cls, block: tuple[int, int] = (128, 128), **options: Any) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block)}  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        packed = buffers["weight"].dtype == torch.int8  # two e2m1 codes a byte
        rows, cols = buffers["scale_inv"].shape[1:]
        divides(out, rows, "fp8 scale rows")
        divides(inp, cols, "fp8 scale columns")
        return {"weight": (out, inp // 2 if packed else inp), "scale_inv": (rows, cols)}

    @classmethod
    def scale_values(cls, name: str, scale: torch.Tensor) -> torch.Tensor:
        return _fp8_scales(scale)

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        weight, scale = buffers["weight"], buffers["scale_inv"]
        q = unpack_e2m1(weight) if weight.dtype == torch.int8 else weight.to(torch.float32)
        e, (rows, cols) = q.shape[0], scale.shape[1:]
        blocks = _blockwise(q, q.shape[1] // rows, q.shape[2] // cols)
        s = _fp8_scales(scale).reshape(e, rows, 1, cols, 1)
        return (blocks * s).to(dtype).reshape(q.shape)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False,
                 block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:  # fmt: skip
        rows, cols = block
        blocks = _blockwise(w.float(), rows, cols)
        amax = blocks.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-12)
        scale = amax / FP8_MAX
        q = (blocks / scale).to(torch.float8_e4m3fn).reshape(w.shape)
        return {"weight": q, "scale_inv": scale.reshape(w.shape[0], *scale.shape[1:4:2])}


def _fp8_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 / bf16 scales as they are; ue8m0 (uint8 bytes or float8_e8m0fnu): 2^(s - 127)."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)
