"""Expert stacks as a checkpoint stores them: FP8, MXFP4, NVFP4, INT4 (docs/knowledge.md §14).

Each published format is a `Quantizer` in engine/quant/stacks.py's registry, beside int8 / NF4, with
the trait `stored`: its buffers are the checkpoint's own tensors, read as they are
(engine/stored/load.py), never made from a float stack. Buffers keep a leading expert dim
and a canonical [out, in] order, so `QuantizedStack` slices one expert and dequantises it
alone (the split-LoRA forward and backward); per-expert checkpoint tensors of the projections
fused into one stack (gate + up) are concatenated along the output rows, scale grids with
them. A block or group size is read off the buffers' shapes (weight rows / scale rows), so a
stack needs no side table – and a size that does not divide is refused.

Dequantisation matches each format's reference bit for bit (tests/test_engine_stored.py):
transformers' `Fp8Dequantize` and `_convert_moe_packed_tensors`, ModelOpt's NVFP4 formula,
compressed-tensors' int4 unpacking. `quantize` writes the same layout from float weights
(tiny published-layout checkpoints, the benchmarks); round to nearest as the publishers do.
"""

from __future__ import annotations

import json
import math
from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import QUANTIZERS, QuantError, Quantizer, register
from moetune.model.hf_config import quant_config_of
from moetune.model.sources import resolve_config

Buffers = dict[str, torch.Tensor]
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class StoredFormat(Quantizer):
    """A published checkpoint format of expert (and other Linear) weights.

    `keys`: buffer name -> (suffix of a per-expert / per-Linear key after the projection,
    suffix appended to a fused stack's key). `scales`: the buffers that hold scales (checked
    finite and non-zero). `bytes_per_param` is what the planner asks; it never names a format.
    """

    stored = True
    experts_only: ClassVar[bool] = False  # publishers leave the other Linears in float
    label: ClassVar[str]  # how a person names it: "block FP8 (e4m3, 128x128 scales)"
    keys: ClassVar[dict[str, tuple[str, str]]]
    scales: ClassVar[tuple[str, ...]]

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        """Whether a config.json `quantization_config` is stored in this format."""
        raise NotImplementedError

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        raise NotImplementedError

    @classmethod
    def config(cls, **options: Any) -> dict[str, Any]:
        """The `quantization_config` a publisher writes for this format (tiny checkpoints)."""
        raise NotImplementedError

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        """The `quantize` / `config` options that reproduce a checkpoint's blocks or groups."""
        return {}

    @classmethod
    def weight_suffix(cls) -> str:
        """The per-Linear key suffix of the packed weight (first of `keys`)."""
        return next(iter(cls.keys.values()))[0]

    @classmethod
    def check(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int], where: str) -> None:
        """Refuse mis-shaped buffers and (real ones) NaN / Inf / zero scales, naming the tensor."""
        for name, shape in cls.shapes(buffers, out_in).items():
            got = tuple(buffers[name].shape[1:])
            if got != shape:
                raise QuantError(
                    f"{where}: {cls.name} tensor {name!r} is {list(got)}, expected {list(shape)} "
                    f"for a [{out_in[0]}, {out_in[1]}] weight",
                    "use the config.json published with these weights (or re-download them)",
                )
        for name in cls.scales:
            if buffers[name].is_meta:
                continue
            values = cls.scale_values(name, buffers[name])
            if not bool(torch.isfinite(values).all()) or bool((values == 0).any()):
                raise QuantError(f"{where}: {cls.name} scales {name!r} hold NaN, Inf or zero",
                                 "re-download the checkpoint: its scales are corrupt")  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        """Each buffer's per-expert shape for an [out, in] weight (block sizes from the buffers)."""
        raise NotImplementedError

    @classmethod
    def scale_values(cls, name: str, scale: torch.Tensor) -> torch.Tensor:
        return scale.float()


# what publishers leave in float beside a quantised checkpoint's Linears (key fragments)
PUBLISHED_FLOAT = ("embed_tokens", "lm_head", ".gate.", ".router.", "norm")


def published_quantised(key: str) -> bool:
    """Whether publishers quantise the Linear weight at `key` (a state-dict key or a module
    path): not the embeddings, lm_head, norms or the router."""
    return not any(k in f"{key}." for k in PUBLISHED_FLOAT)


def stored_formats() -> list[type[StoredFormat]]:
    return [q for _, q in QUANTIZERS.items() if q.stored]  # type: ignore[misc]


def stored_format(qcfg: dict[str, Any] | None) -> type[StoredFormat] | None:
    """The format a checkpoint's `quantization_config` stores its weights in (None: float).
    Decided once per process for each quantization_config (the plan, the rules and the
    loader all ask), a QuantError included."""
    if not qcfg:
        return None
    key = json.dumps(qcfg, sort_keys=True, default=str)
    if key not in _FORMATS:
        try:
            _FORMATS[key] = decide_format(qcfg)
        except QuantError as exc:
            _FORMATS[key] = exc
    found = _FORMATS[key]
    if isinstance(found, QuantError):
        raise QuantError(found.cause, found.fix)
    return found


_FORMATS: dict[str, type[StoredFormat] | QuantError | None] = {}


def decide_format(qcfg: dict[str, Any]) -> type[StoredFormat] | None:
    """The decision itself (stored_format keeps it for the process)."""
    for fmt in stored_formats():
        if fmt.reads(qcfg):
            return fmt
    if transformers_trains(qcfg):
        return None  # bitsandbytes, GPTQ …: transformers' own quantizer trains it as before
    raise QuantError(f"moetune cannot read checkpoints quantised as {describe(qcfg)}",
                     f"use one stored as {', '.join(f.label for f in stored_formats())}, "
                     "or its bf16 release")  # fmt: skip


def base_format(model_id: str) -> tuple[type[StoredFormat], dict[str, Any]] | None:
    """(format, quantization_config) a base is published in – a local dir, a bundled or a hub
    id, by its config.json – or None for a float one; QuantError for one moetune cannot read."""
    _, raw = resolve_config(model_id)
    qcfg = quant_config_of(raw)
    fmt = stored_format(qcfg)
    return None if fmt is None else (fmt, qcfg)


def transformers_trains(qcfg: dict[str, Any]) -> bool:
    """Whether the installed transformers' own quantizer for `qcfg` trains (its
    `is_trainable`, on this machine's libraries); any failure to tell counts as no."""
    # lazy: heavy to import (transformers)
    from transformers.quantizers.auto import AutoHfQuantizer

    try:
        return bool(AutoHfQuantizer.from_config(dict(qcfg), pre_quantized=True).is_trainable)
    except Exception:  # a missing library, an unknown method: it cannot train here
        return False


def describe(qcfg: dict[str, Any]) -> str:
    parts = [qcfg.get("quant_method"), qcfg.get("quant_algo"), qcfg.get("format")]
    return " / ".join(str(p) for p in parts if p) or "an unnamed quant_method"


def _divides(size: int, parts: int, what: str) -> int:
    """size / parts, refused where it is not whole."""
    if parts <= 0 or size % parts:
        raise QuantError(f"{what}: a block of {size}/{parts} does not divide the weight",
                         "use the config.json published with these weights")  # fmt: skip
    return size // parts


def _e2m1(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1, dtype=torch.float32, device=device)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> float32 [..., 2n]: two e2m1 codes a byte, the low nibble first."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = _e2m1(u8.device)
    return torch.stack((lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]), dim=-1).flatten(-2)


def _pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """float [..., 2n] (already e2m1-scaled) -> uint8 [..., n], nearest code, low nibble first."""
    lut = _e2m1(values.device)[:8]
    codes = (values.abs().unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    codes |= (values < 0).to(torch.uint8) << 3
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def _blockwise(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[E, out, in] -> [E, out/rows, rows, in/cols, cols]."""
    e, out, inp = w.shape
    return w.reshape(
        e, _divides(out, rows, "block rows"), rows, _divides(inp, cols, "block cols"), cols
    )


# ---------------------------------------------------------------- block FP8


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
        _divides(out, rows, "fp8 scale rows")
        _divides(inp, cols, "fp8 scale columns")
        return {"weight": (out, inp // 2 if packed else inp), "scale_inv": (rows, cols)}

    @classmethod
    def scale_values(cls, name: str, scale: torch.Tensor) -> torch.Tensor:
        return _fp8_scales(scale)

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        weight, scale = buffers["weight"], buffers["scale_inv"]
        q = _unpack_e2m1(weight) if weight.dtype == torch.int8 else weight.to(torch.float32)
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


# ---------------------------------------------------------------- MXFP4


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
        groups = _divides(inp, cls.BLOCK, "mxfp4 blocks of 32")
        return {"blocks": (out, groups, cls.BLOCK // 2), "scales": (out, groups)}

    @classmethod
    def scale_values(cls, name: str, scale: torch.Tensor) -> torch.Tensor:
        return (scale.to(torch.float32) - 127).exp2()

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        values = _unpack_e2m1(buffers["blocks"])  # [E, out, in/32, 32]
        exp = buffers["scales"].to(torch.int32) - 127
        return torch.ldexp(values, exp.unsqueeze(-1)).to(dtype).flatten(-2)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False) -> dict[str, torch.Tensor]:
        e, out, inp = w.shape
        groups = w.float().reshape(e, out, _divides(inp, cls.BLOCK, "mxfp4 blocks"), cls.BLOCK)
        amax = groups.abs().amax(-1).clamp_min(2.0**-126)
        exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)  # largest e2m1 is 6
        packed = _pack_e2m1(groups / exp.exp2().unsqueeze(-1))
        return {"blocks": packed, "scales": (exp + 127).to(torch.uint8)}


# ---------------------------------------------------------------- NVFP4 (ModelOpt)


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
        _divides(out, parts, "nvfp4 second-level scales")
        groups = _divides(inp, cls.BLOCK, "nvfp4 blocks of 16")
        return {"weight": (out, inp // 2), "scale": (out, groups), "scale_2": (parts,)}

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        values = _unpack_e2m1(buffers["weight"])  # [E, out, in]
        e, out, inp = values.shape
        second = buffers["scale_2"].to(torch.float32)
        rows = second.repeat_interleave(out // second.shape[1], dim=1)  # [E, out]
        block = buffers["scale"].to(torch.float32) * rows.unsqueeze(-1)
        deq = values.view(e, out, inp // cls.BLOCK, cls.BLOCK) * block.unsqueeze(-1)
        return deq.reshape(e, out, inp).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False) -> dict[str, torch.Tensor]:
        e, out, inp = w.shape
        groups = w.float().reshape(e, out, _divides(inp, cls.BLOCK, "nvfp4 blocks"), cls.BLOCK)
        second = (w.float().abs().reshape(e, -1).amax(-1) / (6.0 * FP8_MAX)).clamp_min(1e-12)
        block = groups.abs().amax(-1) / 6.0 / second.view(e, 1, 1)
        scale = block.clamp_min(2.0**-9).to(torch.float8_e4m3fn)
        unit = groups / (scale.float() * second.view(e, 1, 1)).unsqueeze(-1)
        packed = _pack_e2m1(unit.reshape(e, out, inp))
        return {"weight": packed, "scale": scale, "scale_2": second.unsqueeze(-1)}


# ---------------------------------------------------------------- INT4 (compressed-tensors)


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
        _divides(inp, groups, "int4 scale groups")
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
        groups = w.float().reshape(e, out, _divides(inp, group, "int4 groups"), group)
        scale = (groups.abs().amax(-1) / 7.5).clamp_min(1e-8).to(dtype)
        codes = torch.round(groups / scale.float().unsqueeze(-1)).clamp(-8, 7).to(torch.int8)
        unsigned = (codes.reshape(e, out, inp) + 8).to(torch.uint8)
        unsigned = torch.nn.functional.pad(unsigned, (0, -inp % 8))
        packed = (unsigned[..., 0::2] | (unsigned[..., 1::2] << 4)).contiguous()
        return {"packed": packed.view(torch.int32), "scale": scale}
