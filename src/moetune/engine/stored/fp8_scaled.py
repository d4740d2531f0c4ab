"""FP8 with one scale a tensor or a row: AutoFP8 / llm-compressor's early per-tensor
checkpoints (quant_method fp8 with no weight_block_size, activation_scheme static) and
fbgemm_fp8's per-channel ones."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import register
from moetune.engine.stored.formats import FP8_MAX, Buffers, StoredFormat, divides


@register
class ScaledFP8(StoredFormat):
    """float8_e4m3fn `weight` [out, in] and an fp32 `weight_scale`: a 0-dim (or [1]) scalar per
    Linear (AutoFP8, per-tensor) or [out, 1] (fbgemm_fp8, per-channel); W = weight × scale in
    fp32 (transformers' `_dequantize_fp8_weight` with no block, vLLM's per-tensor path). A
    static `input_scale` beside it is for FP8 activations when serving: unused to train.
    Projections fused into one stack keep a per-tensor scale each ([E, parts], equal row
    ranges), as NVFP4's second level."""

    name = method = "fp8_scaled"
    label = "per-tensor / per-channel FP8 (AutoFP8 fp8 without weight_block_size, fbgemm_fp8)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "weight": ("weight", ""),
        "scale": ("weight_scale", "_scale"),
    }
    scales = ("scale",)

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        method = qcfg.get("quant_method")
        return method == "fbgemm_fp8" or (method == "fp8" and not qcfg.get("weight_block_size"))

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        return 1 + 4 / 1024  # an fp32 scale a row at most; rows of real models are >= 1024 wide

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        return {"per": "channel" if qcfg.get("quant_method") == "fbgemm_fp8" else "tensor"}

    @classmethod
    def config(cls, per: str = "tensor", **options: Any) -> dict[str, Any]:
        if per == "channel":
            return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                    "modules_to_not_convert": ["lm_head"]}  # fmt: skip
        return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"]}

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        scale = buffers["scale"]
        if scale.ndim == 2:  # per tensor: one scalar a fused projection
            divides(out, scale.shape[1], "fp8 per-tensor scales")
            return {"weight": (out, inp), "scale": (scale.shape[1],)}
        return {"weight": (out, inp), "scale": (out, 1)}

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        q, scale = buffers["weight"].to(torch.float32), buffers["scale"].to(torch.float32)
        if scale.ndim == 2:  # [E, parts] -> [E, out, 1]
            scale = scale.repeat_interleave(q.shape[1] // scale.shape[1], dim=1).unsqueeze(-1)
        return (q * scale).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False,
                 per: str = "tensor") -> dict[str, torch.Tensor]:  # fmt: skip
        """Round to nearest with amax / 448 a scale, over the whole tensor or each row."""
        e = w.shape[0]
        amax = w.float().abs().amax(dim=-1, keepdim=True)  # [E, out, 1]
        if per == "tensor":
            amax = amax.reshape(e, -1).amax(dim=-1).reshape(e, 1, 1)
        scale = amax.clamp_min(1e-12) / FP8_MAX
        q = (w.float() / scale).to(torch.float8_e4m3fn)
        return {"weight": q, "scale": scale.reshape(e, 1) if per == "tensor" else scale}
