"""Integer codes packed into int32 words, lowest bits first (compressed-tensors, GPTQ, AWQ)."""

from __future__ import annotations

import math

import torch

from moetune.engine.quant.stacks import QuantError
from moetune.engine.stored.formats import divides


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., n] -> int32 codes [..., n·32/bits], code k of a word in bits k·b.. (k+1)·b."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # the mask undoes sign fill
    return codes.flatten(-2)


def pack_words(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes [..., m] -> int32 [..., ceil(m·bits/32)] (padded with zero codes)."""
    per = 32 // bits
    padded = torch.nn.functional.pad(codes.to(torch.int64), (0, -codes.shape[-1] % per))
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    words = (padded.unflatten(-1, (-1, per)) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def bits_of(words: int, values: int, where: str, choices: tuple[int, ...] = (4, 8)) -> int:
    """The code width that packs `values` codes into `words` int32 words."""
    for bits in choices:
        if math.ceil(values * bits / 32) == words:
            return bits
    raise QuantError(f"{where}: {words} int32 words hold none of {list(choices)}-bit codes "
                     f"of {values} values",
                     "use the config.json published with these weights")  # fmt: skip


def parts_of(size: int, whole: int, where: str) -> int:
    """How many projections (gate, up) were concatenated: `size` = parts × `whole`."""
    if whole <= 0 or size % whole or size == 0:
        raise QuantError(f"{where}: {size} rows are not whole parts of {whole}",
                         "use the config.json published with these weights")  # fmt: skip
    return size // whole


def check_groups(g_idx: torch.Tensor, groups: int, where: str) -> None:
    """Refuse a g_idx naming a group that has no scale (real buffers; meta ones hold none)."""
    if g_idx.is_meta:
        return
    if bool((g_idx < 0).any()) or bool((g_idx >= groups).any()):
        raise QuantError(f"{where}: g_idx names groups outside 0..{groups - 1}",
                         "re-download the checkpoint: its g_idx is corrupt")  # fmt: skip


Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def round_groups(w: torch.Tensor, group: int, bits: int, dtype: torch.dtype, where: str,
                 zero_points: bool = False) -> Codes:  # fmt: skip
    """Round to nearest, as the publishers' writers do: w [E, out, in] in groups of `group`
    columns (0: the whole row) -> (unsigned codes [E, out, in] int64, scale [E, out, groups]
    in `dtype`, signed zero points [E, out, groups] float32 – 0 where `zero_points` is off)."""
    e, out, inp = w.shape
    group = group or inp
    g = w.float().reshape(e, out, divides(inp, group, where), group)
    top = (1 << (bits - 1)) - 1
    if zero_points:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = ((hi - lo) / (2 * top + 1)).clamp_min(1e-8).to(dtype)
        zero = (torch.round(-lo / scale.float()) - top - 1).clamp(-top - 1, top)
    else:
        scale = (g.abs().amax(-1) / (top + 0.5)).clamp_min(1e-8).to(dtype)
        zero = torch.zeros_like(scale, dtype=torch.float32)
    codes = torch.round(g / scale.float().unsqueeze(-1) + zero.unsqueeze(-1))
    codes = codes.clamp(-top - 1, top).reshape(e, out, inp).to(torch.int64) + top + 1
    return codes, scale, zero
