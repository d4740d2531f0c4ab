"""The int8 and NF4 quantizers of engine/quant/stacks.py's registry (frozen experts stored narrow).

int8: one absmax scale per output row, codes in [-127, 127]. NF4: QLoRA's NormalFloat-4
levels, one absmax per block of NF4_BLOCK inputs (double quantisation: those absmax values
themselves in 8 bits per DQ_BLOCK). Both dequantise one expert at a time into a reused
buffer; engine/__init__.py imports this module, which registers them.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from moetune.engine.quant.stacks import _TINY, Quantizer, register

# QLoRA's NormalFloat-4 (Dettmers et al. 2023; bitsandbytes `create_normal_map`): normal
# quantiles at 8 points in [0.5, 0.9677] above zero and 7 below, plus an exact 0,
# scaled to [-1, 1]. The test rebuilds them from `torch.special.ndtri`.
NF4_LEVELS = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
])  # fmt: skip
NF4_BLOCK = 64  # absmax block, elements
DQ_BLOCK = 256  # double quantisation: absmax values per 8-bit block


@register
class Int8(Quantizer):
    """Symmetric int8 with one fp32 scale per output row of each expert."""

    name = method = "int8"

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool) -> dict[str, torch.Tensor]:
        scales = w.abs().amax(dim=-1) / 127
        codes = torch.round(w / scales.clamp_min(_TINY).unsqueeze(-1)).clamp_(-127, 127)
        return {"codes": codes.to(torch.int8), "scales": scales}

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        return (buffers["codes"].float() * buffers["scales"].unsqueeze(-1)).to(dtype)

    @classmethod
    def factored(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                 out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        return out.copy_(buffers["codes"]), buffers["scales"]  # |code| ≤ 127: exact in bf16


@register
class NF4(Quantizer):
    """NormalFloat-4, absmax per block of 64 along each expert's row-major [out, in].

    Blocks follow the input dim (they wrap rows only when `in` is not a multiple of 64,
    as in tiny test models); an expert's last block is zero-padded. Two codes per byte,
    first in the high nibble. Double quantisation stores the absmax values as int8
    around their per-expert mean, one fp32 scale per 256 (QLoRA uses an 8-bit float).
    """

    name = method = "nf4"
    double_quant = True

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool) -> dict[str, torch.Tensor]:
        blocks = _blocks(w.reshape(w.shape[0], -1), NF4_BLOCK)
        absmax = blocks.abs().amax(dim=-1)
        unit = blocks / absmax.clamp_min(_TINY).unsqueeze(-1)
        codes = torch.bucketize(unit, _midpoints(unit.device), out_int32=True)
        packed = pack_nibbles(codes.view(w.shape[0], -1).to(torch.uint8))
        return {"codes": packed, **(_dq_absmax(absmax) if double_quant else {"absmax": absmax})}

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        packed = buffers["codes"]
        levels = _pair_levels(packed.device).index_select(0, packed.flatten().int())
        absmax = buffers["absmax"] if "absmax" in buffers else _dq_restore(buffers)
        values = levels.view(*absmax.shape, NF4_BLOCK) * absmax.unsqueeze(-1)
        out, inp = out_in
        return values.view(packed.shape[0], -1)[:, : out * inp].reshape(-1, out, inp).to(dtype)

    @classmethod
    def dequantize_into(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                        out: torch.Tensor) -> torch.Tensor:  # fmt: skip
        packed = buffers["codes"]
        if (out_in[0] * out_in[1]) % NF4_BLOCK:  # padded last block: no view of `out` fits
            return cls.dequantize(buffers, out_in, out.dtype)
        absmax = buffers["absmax"] if "absmax" in buffers else _dq_restore(buffers)
        blocks = out.view(*absmax.shape, NF4_BLOCK)
        codes = _scratch(packed.numel(), torch.int32, packed.device).copy_(packed.flatten())
        fp32 = out.dtype == torch.float32  # then the levels go straight into `out`
        levels = out if fp32 else _scratch(2 * packed.numel(), torch.float32, packed.device)
        # a byte's two fp32 levels as one int64 word: a 1-D gather, ~2x a [256, 2] one
        words = _pair_levels(packed.device).view(torch.int64).flatten()
        torch.index_select(words, 0, codes, out=levels.view(-1, 2).view(torch.int64).flatten())
        if fp32:
            return blocks.mul_(absmax.unsqueeze(-1)).view(out.shape)
        # the fp32 product, rounded once to out's dtype
        torch.mul(levels.view(*absmax.shape, NF4_BLOCK), absmax.unsqueeze(-1), out=blocks)
        return out


def _scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A transient of one expert's size. Fresh each call, not cached: a cached one would
    outlive the step the planner traces (and, made under the trace's fake tensors, be fake);
    the CLI's huge pages keep its first-touch faults cheap (cli/common.py)."""
    return torch.empty(numel, dtype=dtype, device=device)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 [..., 2n] -> bytes [..., n], the first code in the high nibble."""
    return (codes[..., 0::2] << 4) | codes[..., 1::2]


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed >> 4, packed & 0xF), dim=-1).flatten(-2)


def _blocks(flat: torch.Tensor, size: int) -> torch.Tensor:
    """[E, n] -> [E, ceil(n/size), size], zero-padded at each row's end."""
    return F.pad(flat, (0, -flat.shape[1] % size)).view(flat.shape[0], -1, size)


@cache
def _levels(device: torch.device) -> torch.Tensor:
    return NF4_LEVELS.to(device)


# byte -> its two levels [256, 2] (high nibble first): one gather per byte, no unpack.
_BYTE = torch.arange(256)
NF4_PAIR_LEVELS = torch.stack((NF4_LEVELS[_BYTE >> 4], NF4_LEVELS[_BYTE & 0xF]), dim=1)


def _pair_levels(device: torch.device) -> torch.Tensor:
    """A copy per call (2 KiB): the planner's trace sees the same transient the step makes,
    where a cached one made inside the first step stays alive in it (byte-exact plans)."""
    return NF4_PAIR_LEVELS.to(device, copy=True)


@cache
def _midpoints(device: torch.device) -> torch.Tensor:
    return (_levels(device)[1:] + _levels(device)[:-1]) / 2  # bucketize -> nearest level


def _dq_absmax(absmax: torch.Tensor) -> dict[str, torch.Tensor]:
    """absmax [E, n] -> int8 around the per-expert mean, one scale per 256 (Int8's rows)."""
    offset = absmax.mean(dim=-1)
    q = Int8.quantize(_blocks(absmax - offset.unsqueeze(-1), DQ_BLOCK), double_quant=False)
    codes = q["codes"].flatten(1)[:, : absmax.shape[1]]
    return {"absmax_codes": codes, "absmax_scales": q["scales"], "absmax_offset": offset}


def _dq_restore(buffers: dict[str, torch.Tensor]) -> torch.Tensor:
    codes, scales = buffers["absmax_codes"], buffers["absmax_scales"]
    values = Int8.dequantize(
        {"codes": _blocks(codes, DQ_BLOCK), "scales": scales}, (0, 0), torch.float32
    )
    return values.flatten(1)[:, : codes.shape[1]] + buffers["absmax_offset"].unsqueeze(-1)
