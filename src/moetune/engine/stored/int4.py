"""INT4 / INT8 as compressed-tensors packs them (`pack-quantized`; Kimi-K2-Thinking, what
llm-compressor writes): symmetric or with zero points, group or channel scales, and
`actorder: group` checkpoints whose `weight_g_idx` maps each input column to its group.

One registered format a tensor set (the loader finds a format's tensors by its `keys`):
`int4` (packed + scale), `int4-zp` (+ zero points), `int4-gidx` (+ g_idx), `int4-zp-gidx`.
A scheme none of them reads (activation quantisation, tensor / block strategy, other widths)
is refused in one line – never read with a tensor ignored.
"""

from __future__ import annotations

import math
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

_FIX = (
    "use a checkpoint stored as INT4 / INT8 pack-quantized (group or channel), or its bf16 release"
)


def ct_scheme(qcfg: dict[str, Any]) -> dict[str, Any] | None:
    """The one weight scheme of a compressed-tensors pack-quantized config (None: another
    format); QuantError for a pack-quantized scheme moetune does not read."""
    groups = ct_groups(qcfg, "pack-quantized", _FIX)
    if groups is None:
        return None
    schemes = [g.get("weights") or {} for g in groups]
    if any(g.get("input_activations") or g.get("output_activations") for g in groups):
        raise QuantError("compressed-tensors: activations quantised too (moetune reads the "
                         "weights and trains in float)", _FIX)  # fmt: skip
    return _checked(schemes[0])


def ct_groups(qcfg: dict[str, Any], fmt: str, fix: str) -> list[dict[str, Any]] | None:
    """The config groups of a compressed-tensors config stored as `fmt` (None: another
    format), refused where some Linears use another format or another weight scheme."""
    if qcfg.get("quant_method") != "compressed-tensors":
        return None
    groups = list((qcfg.get("config_groups") or {}).values())
    formats = {g.get("format") or qcfg.get("format") for g in groups}
    if not groups or fmt not in formats:
        return None
    if len(formats) > 1:  # some Linears in another format: none may be read half-way
        raise QuantError(f"compressed-tensors with mixed formats {sorted(map(str, formats))}",
                         fix)  # fmt: skip
    schemes = [g.get("weights") or {} for g in groups]
    if any(s != schemes[0] for s in schemes):
        raise QuantError("compressed-tensors: config groups with different weight schemes",
                         fix)  # fmt: skip
    return groups


def _checked(w: dict[str, Any]) -> dict[str, Any]:
    # compressed-tensors' own defaults: a group_size alone means strategy group
    strategy = w.get("strategy") or ("group" if w.get("group_size") else "tensor")
    actorder = w.get("actorder")
    refused = [
        (w.get("type", "int") != "int", f"type {w.get('type')}"),
        (w.get("num_bits") not in (4, 8), f"{w.get('num_bits')}-bit codes"),
        (strategy not in ("group", "channel"), f"strategy {strategy}"),
        (strategy == "group" and not w.get("group_size"), "strategy group without group_size"),
        (actorder not in (None, "weight", "group"), f"actorder {actorder}"),
        (bool(w.get("dynamic")), "dynamic weight scales"),
    ]
    for bad, what in refused:
        if bad:
            raise QuantError(f"compressed-tensors pack-quantized with {what} is not read", _FIX)
    return w


@register
class Int4Packed(StoredFormat):
    """`weight_packed` int32 [out, in·bits/32] (codes + 2^(bits-1), lowest bits first) and
    `weight_scale` [out, groups] (channel: one group) in the model's float dtype;
    W[o, i] = (code - zero[o, g(i)]) × scale[o, g(i)], in the scale's dtype – compressed-tensors'
    `dequantize`. g(i) = i // group, or `weight_g_idx[i]` (actorder group)."""

    name = method = "int4"
    label = "INT4 / INT8 (compressed-tensors pack-quantized, symmetric)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "packed": ("weight_packed", "_packed"),
        "scale": ("weight_scale", "_scale"),
    }
    scales = ("scale",)
    zero_points: ClassVar[bool] = False
    g_idx: ClassVar[bool] = False
    bits: ClassVar[int | None] = None  # the config's num_bits (None: as the packed width says)

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        w = ct_scheme(qcfg)
        return w is not None and (not w.get("symmetric", True), w.get("actorder") == "group") == (
            cls.zero_points, cls.g_idx)  # fmt: skip

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        opts = cls.options(qcfg)
        per_group = 2 + (opts["bits"] / 8 if cls.zero_points else 0)
        return opts["bits"] / 8 + (per_group / opts["group"] if opts["group"] else 0)

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        # the scheme as written (ct_scheme refuses what is not read; sizing asks of any)
        w = next(
            iter(g.get("weights") or {} for g in (qcfg.get("config_groups") or {}).values()), {}
        )
        group = w.get("group_size") if w.get("strategy") in (None, "group") else 0
        size = 128 if group is None else group_size(group, "compressed-tensors", channel=(0,))
        return {"group": size, "bits": w.get("num_bits", 4)}

    @classmethod
    def configured(cls, bits: int | None = None, **_: Any) -> type[Int4Packed]:
        return cls if bits is None or bits == cls.bits else _with_bits(cls, bits)

    @classmethod
    def config(cls, group: int = 32, bits: int = 4, **options: Any) -> dict[str, Any]:
        weights = {"num_bits": bits, "type": "int", "symmetric": not cls.zero_points,
                   "strategy": "group" if group else "channel", "group_size": group or None,
                   "actorder": "group" if cls.g_idx else None}  # fmt: skip
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "config_groups": {"group_0": {"weights": weights, "targets": ["Linear"]}},
                "ignore": ["lm_head"]}  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        groups = buffers["scale"].shape[-1]
        bits = cls.packed_bits(buffers["packed"].shape[-1], inp)
        found: dict[str, tuple[int, ...]] = {"packed": (out, math.ceil(inp * bits / 32))}
        found["scale"] = (out, groups)
        if not cls.g_idx:
            divides(inp, groups, f"{cls.name} scale groups")
        else:
            parts = parts_of(buffers["g_idx"].shape[-1], inp, f"{cls.name} g_idx")
            found["g_idx"] = (parts * inp,)
        if cls.zero_points:  # packed along the rows: whole words a projection
            divides(out * bits, 32, f"{cls.name} zero-point words")
            found["zero"] = (out * bits // 32, groups)
        return found

    @classmethod
    def packed_bits(cls, words: int, values: int, where: str = "") -> int:
        """The code width of the packed words, which must be the config's num_bits: a
        config saying 8 over 4-bit words (or the reverse) is a mismatched download, and
        compressed-tensors would unpack it at the config's width – refuse, never pick one."""
        bits = bits_of(words, values, f"{where or cls.name} packed weight")
        if cls.bits is not None and bits != cls.bits:
            raise QuantError(
                f"{where or cls.name} packed weight: {words} int32 words for {values} values hold "
                f"{bits}-bit codes, but quantization_config says num_bits {cls.bits}",
                "use the config.json published with these weights (or re-download them)",
            )
        return bits

    @classmethod
    def check(cls, buffers: Buffers, out_in: tuple[int, int], where: str) -> None:
        cls.packed_bits(buffers["packed"].shape[-1], out_in[1], where)  # named by tensor
        super().check(buffers, out_in, where)
        if cls.g_idx:
            check_groups(buffers["g_idx"], buffers["scale"].shape[-1], where)

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        packed, scale = buffers["packed"], buffers["scale"]
        out, inp = out_in
        bits = cls.packed_bits(packed.shape[-1], inp)
        offset = 1 << (bits - 1)
        codes = unpack_words(packed, bits)[..., :inp] - offset
        idx = _group_index(buffers.get("g_idx"), out_in, scale.shape[-1])
        q = codes.to(scale.dtype)
        if cls.zero_points:
            zero = unpack_words(buffers["zero"].transpose(1, 2), bits).transpose(1, 2) - offset
            q = q - _per_column(zero[:, :out], idx).to(scale.dtype)
        return (q * _per_column(scale, idx)).to(dtype)

    @classmethod
    def quantize(
        cls,
        w: torch.Tensor,
        *,
        double_quant: bool = False,
        group: int = 32,
        bits: int = 4,
        dtype: torch.dtype = torch.bfloat16,
    ) -> dict[str, torch.Tensor]:
        """Round to nearest (per group, or per row where `group` is 0), natural column order."""
        e, _, inp = w.shape
        where = f"{cls.name} groups"
        codes, scale, zero = round_groups(w, group, bits, dtype, where, cls.zero_points)
        top, group = (1 << (bits - 1)) - 1, group or inp
        bufs = {"packed": pack_words(codes, bits), "scale": scale}
        if cls.zero_points:
            rows = (zero.to(torch.int64) + top + 1).transpose(1, 2)
            bufs["zero"] = pack_words(rows, bits).transpose(1, 2).contiguous()
        if cls.g_idx:
            bufs["g_idx"] = (torch.arange(inp) // group).to(torch.int32).expand(e, inp).clone()
        return bufs


_VARIANTS: dict[tuple[type[Int4Packed], int], type[Int4Packed]] = {}


def _with_bits(fmt: type[Int4Packed], bits: int) -> type[Int4Packed]:
    """`fmt` held to the config's num_bits: one class a width, found by name (pickle,
    deepcopy), as fp8's block variants are."""
    if (fmt, bits) not in _VARIANTS:
        name = f"{fmt.__name__}_{bits}bit"
        variant = type(name, (fmt,), {"bits": bits, "__module__": __name__})
        globals()[name] = _VARIANTS[fmt, bits] = variant
    return _VARIANTS[fmt, bits]


def _group_index(g_idx: torch.Tensor | None, out_in: tuple[int, int], groups: int) -> torch.Tensor:
    """Each weight element's scale column: [E or 1, out, in] (g_idx rows per projection)."""
    out, inp = out_in
    if g_idx is None:
        return (torch.arange(inp) // (inp // groups)).expand(1, out, inp)
    e, parts = g_idx.shape[0], g_idx.shape[-1] // inp
    idx = g_idx.long().reshape(e, parts, 1, inp).expand(e, parts, out // parts, inp)
    return idx.reshape(e, out, inp)


def _per_column(values: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """values [E, out, groups] gathered to [E, out, in] by group index."""
    return values.gather(-1, idx.to(values.device).expand(values.shape[0], -1, -1))


@register
class Int4PackedZeroPoint(Int4Packed):
    name = method = "int4-zp"
    label = "INT4 / INT8 (compressed-tensors pack-quantized, asymmetric)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        **Int4Packed.keys, "zero": ("weight_zero_point", "_zero_point")}  # fmt: skip
    zero_points = True


@register
class Int4PackedGIdx(Int4Packed):
    name = method = "int4-gidx"
    label = "INT4 / INT8 (compressed-tensors pack-quantized, actorder group)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        **Int4Packed.keys, "g_idx": ("weight_g_idx", "_g_idx")}  # fmt: skip
    g_idx = True


@register
class Int4PackedZeroPointGIdx(Int4Packed):
    name = method = "int4-zp-gidx"
    label = "INT4 / INT8 (compressed-tensors pack-quantized, asymmetric, actorder group)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        **Int4PackedZeroPoint.keys, "g_idx": ("weight_g_idx", "_g_idx")}  # fmt: skip
    zero_points = g_idx = True
