"""NVFP4A16 as compressed-tensors packs it (`nvfp4-pack-quantized`, what llm-compressor's
NVFP4A16 scheme writes): ModelOpt's layout under other names and a divided second level."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import QuantError, register
from moetune.engine.stored.nvfp4 import NVFP4

_FIX = "use a checkpoint stored as NVFP4A16 (weights only, groups of 16), or its bf16 release"


@register
class NVFP4CompressedTensors(NVFP4):
    """`weight_packed` uint8 [out, in/2] (e2m1 pairs, low nibble first), `weight_scale`
    float8_e4m3fn [out, in/16], `weight_global_scale` fp32 [1]; W = e2m1 × (weight_scale /
    global_scale) in fp32 – compressed-tensors' `decompress`, which returns bf16."""

    name = method = "nvfp4-ct"
    label = "NVFP4A16 (compressed-tensors nvfp4-pack-quantized)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "weight": ("weight_packed", "_packed"), "scale": ("weight_scale", "_scale"),
        "scale_2": ("weight_global_scale", "_global_scale")}  # fmt: skip

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        if qcfg.get("quant_method") != "compressed-tensors":
            return False
        groups = list((qcfg.get("config_groups") or {}).values())
        formats = {g.get("format") or qcfg.get("format") for g in groups}
        if "nvfp4-pack-quantized" not in formats:
            return False
        for g in groups:
            w = g.get("weights") or {}
            if len(formats) > 1 or g.get("input_activations") or w.get("group_size") != 16 \
                    or w.get("type") != "float" or w.get("num_bits") != 4:  # fmt: skip
                raise QuantError("compressed-tensors NVFP4 other than NVFP4A16 (weights only, "
                                 "e2m1 in groups of 16, one format) is not read", _FIX)  # fmt: skip
        return True

    @classmethod
    def config(cls, **options: Any) -> dict[str, Any]:
        weights = {"num_bits": 4, "type": "float", "symmetric": True,
                   "strategy": "tensor_group", "group_size": cls.BLOCK}  # fmt: skip
        return {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
                "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
                "ignore": ["lm_head"]}  # fmt: skip

    @staticmethod
    def _block_scales(scale: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
        # compressed-tensors divides by its global scale (its reciprocal would round otherwise)
        return scale / second

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False) -> dict[str, torch.Tensor]:
        bufs = super().quantize(w)  # ModelOpt's second level is the reciprocal of the global
        return {**bufs, "scale_2": 1.0 / bufs["scale_2"]}
