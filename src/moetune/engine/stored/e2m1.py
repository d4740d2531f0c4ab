"""FP4 e2m1 codes, two a byte (low nibble first): shared by MXFP4 and NVFP4."""

from __future__ import annotations

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_codes(device: torch.device) -> torch.Tensor:
    return torch.tensor(E2M1, dtype=torch.float32, device=device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> float32 [..., 2n]: two e2m1 codes a byte, the low nibble first."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = e2m1_codes(u8.device)
    return torch.stack((lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]), dim=-1).flatten(-2)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """float [..., 2n] (already e2m1-scaled) -> uint8 [..., n], nearest code, low nibble first."""
    lut = e2m1_codes(values.device)[:8]
    codes = (values.abs().unsqueeze(-1) - lut).abs().argmin(-1).to(torch.uint8)
    codes |= (values < 0).to(torch.uint8) << 3
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
