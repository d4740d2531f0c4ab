"""FP8 as compressed-tensors stores it (`float-quantized`: RedHatAI's "-FP8-dynamic" repos, what
llm-compressor's FP8 / FP8_DYNAMIC / FP8_BLOCK schemes write): float8_e4m3fn `weight` and a
`weight_scale` a tensor, a row or a block (docs/knowledge.md §14).

Dequantised as compressed-tensors' `decompress` does: W = weight.to(scale.dtype) × scale, in
the scale's dtype (bf16 as llm-compressor saves); block scales on a ceil-divided grid of the
config's `block_structure`, a partial last block as DeepSeek's. The exact fp32 product (a
4-bit by at most 24-bit significand) rounded once to the scale's dtype is that result bit
for bit. The activation scheme – dynamic, or static with an `input_scale` beside each weight
– is for FP8 matmuls when serving; it does not change the weights, and training never reads
an `input_scale` (the loader skips it).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import QuantError, register
from moetune.engine.stored.formats import Buffers
from moetune.engine.stored.fp8 import BlockFP8, _block_of
from moetune.engine.stored.fp8_scaled import ScaledFP8
from moetune.engine.stored.int4 import ct_groups

_FIX = (
    "use a checkpoint stored as FP8 float-quantized (tensor, channel or block), or its bf16 release"
)


def ct_fp8_scheme(qcfg: dict[str, Any]) -> dict[str, Any] | None:
    """The one weight scheme of a compressed-tensors float-quantized config (None: another
    format); QuantError for a float-quantized scheme moetune does not read."""
    groups = ct_groups(qcfg, "float-quantized", _FIX)
    if groups is None:
        return None
    w = groups[0].get("weights") or {}
    strategy = w.get("strategy") or "tensor"  # compressed-tensors' own default
    refused = [
        (w.get("type") != "float", f"type {w.get('type')}"),
        (w.get("num_bits") != 8, f"{w.get('num_bits')}-bit floats"),
        (strategy not in ("tensor", "channel", "block"), f"strategy {strategy}"),
        (strategy == "block" and not w.get("block_structure"), "block without block_structure"),
        (bool(w.get("dynamic")), "dynamic weight scales (no stored scale)"),
        (not w.get("symmetric", True), "weight zero points"),
    ]
    for bad, what in refused:
        if bad:
            raise QuantError(f"compressed-tensors float-quantized with {what} is not read", _FIX)
    return {**w, "strategy": strategy}


def _rounded(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 product rounded to the scale's dtype first, as compressed-tensors multiplies."""
    return w.to(scale.dtype).to(dtype)


def _config(weights: dict[str, Any]) -> dict[str, Any]:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, **weights}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True,
            "strategy": "token"}  # fmt: skip
    group = {"weights": weights, "input_activations": acts, "targets": ["Linear"]}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"]}  # fmt: skip


@register
class ScaledFP8CompressedTensors(ScaledFP8):
    """Strategy tensor (a 0-dim or [1] `weight_scale`) or channel ([out, 1]); the scale's shape
    says which, as ScaledFP8 reads it."""

    name = method = "fp8-ct"
    label = "FP8 (compressed-tensors float-quantized, tensor / channel scales)"

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        w = ct_fp8_scheme(qcfg)
        return w is not None and w["strategy"] in ("tensor", "channel")

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        return 1 + 4 / 1024  # at most an fp32 scale a row; real rows are >= 1024 wide

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        return {"per": (ct_fp8_scheme(qcfg) or {}).get("strategy", "tensor")}

    @classmethod
    def config(cls, per: str = "tensor", **options: Any) -> dict[str, Any]:
        return _config({"strategy": per})

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        w = super().dequantize(buffers, out_in, torch.float32)
        return _rounded(w, buffers["scale"], dtype)


@register
class BlockFP8CompressedTensors(BlockFP8):
    """Strategy block: `weight_scale` [ceil(out/br), ceil(in/bc)] for `block_structure`
    [br, bc] – BlockFP8's grid under compressed-tensors' key and multiply."""

    name = method = "fp8-ct-block"
    label = "FP8 (compressed-tensors float-quantized, block scales)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "weight": ("weight", ""),
        "scale_inv": ("weight_scale", "_scale"),
    }
    block_field = "config_groups weights' block_structure"

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        w = ct_fp8_scheme(qcfg)
        return w is not None and w["strategy"] == "block"

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        rows, cols = cls.options(qcfg)["block"]
        return 1 + 4 / (rows * cols)

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        return {"block": _block_of((ct_fp8_scheme(qcfg) or {}).get("block_structure"))}

    @classmethod
    def config(cls, block: tuple[int, int] | None = None, **options: Any) -> dict[str, Any]:
        return _config({"strategy": "block", "block_structure": list(block or cls.block)})

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        if buffers["weight"].dtype != torch.float8_e4m3fn:  # BlockFP8 reads int8 as FP4 pairs
            raise QuantError(f"compressed-tensors FP8 weights are {buffers['weight'].dtype}, "
                             "not float8_e4m3fn", _FIX)  # fmt: skip
        return super().shapes(buffers, out_in)

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        w = super().dequantize(buffers, out_in, torch.float32)
        return _rounded(w, buffers["scale_inv"], dtype)
