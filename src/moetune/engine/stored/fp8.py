"""Block FP8 as DeepSeek, Qwen, GLM, MiniMax and Kimi publish it (quant_method fp8)."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from moetune.engine.quant.stacks import QuantError, register
from moetune.engine.stored.e2m1 import unpack_e2m1
from moetune.engine.stored.formats import (
    FP8_MAX,
    Buffers,
    StoredFormat,
    divides,
)


@register
class BlockFP8(StoredFormat):
    """DeepSeek / Qwen / GLM / MiniMax / Kimi block FP8: float8_e4m3fn weights and an fp32
    `weight_scale_inv` per block; W[i, j] = weight[i, j] × scale_inv[i // br, j // bc] with
    (br, bc) config.json's `weight_block_size` (128x128 as published) and a ceil-divided grid,
    so a last block may be partial (DeepSeek's `kv_a_proj_with_mqa`: 576 rows = 4½ blocks) –
    the block is never the weight over the grid (576/5, or 192/2 = 96 where it divides by
    accident). DeepSeek-V4's FP4 experts ride the same keys: int8 bytes of two e2m1 codes and
    ue8m0 scales per 32 (a grid that divides: their block is read off it)."""

    name = method = "fp8"
    label = "block FP8 (quant_method fp8)"
    keys: ClassVar[dict[str, tuple[str, str]]] = {
        "weight": ("weight", ""),
        "scale_inv": ("weight_scale_inv", "_scale_inv"),
    }
    scales = ("scale_inv",)
    block: ClassVar[tuple[int, int]] = (128, 128)  # config.json's weight_block_size
    block_field: ClassVar[str] = "weight_block_size"  # where quantization_config names it

    @classmethod
    def reads(cls, qcfg: dict[str, Any]) -> bool:
        return qcfg.get("quant_method") == "fp8" and bool(qcfg.get("weight_block_size"))

    @classmethod
    def bytes_per_param(cls, qcfg: dict[str, Any]) -> float:
        rows, cols = cls.options(qcfg)["block"]
        return 1 + 4 / (rows * cols)

    @classmethod
    def options(cls, qcfg: dict[str, Any]) -> dict[str, Any]:
        return {"block": _block_of(qcfg.get("weight_block_size") or (128, 128))}

    @classmethod
    def configured(cls, block: tuple[int, int] | None = None, **_: Any) -> type[BlockFP8]:
        return cls if block is None else _with_block(cls, _block_of(block))

    @classmethod
    def config(cls, block: tuple[int, int] | None = None, **options: Any) -> dict[str, Any]:
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(block or cls.block)}  # fmt: skip

    @classmethod
    def shapes(cls, buffers: Buffers, out_in: tuple[int, int]) -> dict[str, tuple[int, ...]]:
        out, inp = out_in
        if buffers["weight"].dtype == torch.int8:  # two e2m1 codes a byte, a dividing grid
            rows, cols = buffers["scale_inv"].shape[1:]
            divides(out, rows, "fp4 scale rows")
            divides(inp, cols, "fp4 scale columns")
            return {"weight": (out, inp // 2), "scale_inv": (rows, cols)}
        br, bc = cls.block
        return {"weight": (out, inp), "scale_inv": (-(-out // br), -(-inp // bc))}

    @classmethod
    def check(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int], where: str) -> None:
        got = tuple(buffers["scale_inv"].shape[1:])
        want = cls.shapes(buffers, out_in)["scale_inv"]
        if buffers["weight"].dtype != torch.int8 and got != want:
            raise QuantError(
                f"{where}: fp8 scale grid {list(got)} is not ceil([{out_in[0]}, {out_in[1]}] / "
                f"{list(cls.block)}) = {list(want)} for {cls.block_field} {list(cls.block)}",
                f"set quantization_config's {cls.block_field} in config.json to the block the "
                "weights were quantised with (or use the config.json published with them)",
            )
        super().check(buffers, out_in, where)

    @classmethod
    def scale_values(cls, name: str, scale: torch.Tensor) -> torch.Tensor:
        return _fp8_scales(scale)

    @classmethod
    def scale_dtype_ok(cls, scale: torch.Tensor) -> bool:
        return scale.is_floating_point() or scale.dtype == torch.uint8  # uint8: ue8m0 bytes

    @classmethod
    def dequantize(cls, buffers: dict[str, torch.Tensor], out_in: tuple[int, int],
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        weight, scale = buffers["weight"], buffers["scale_inv"]
        packed = weight.dtype == torch.int8
        q = (
            unpack_e2m1(weight) if packed else weight.to(torch.float32, copy=True)
        )  # scaled in place
        _, out, inp = q.shape
        # V4's FP4 experts: the grid divides, the block is read off it
        block = (out // scale.shape[1], inp // scale.shape[2]) if packed else cls.block
        return _scale_(q, _fp8_scales(scale), block).to(dtype)

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = False,
                 block: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
        """Round to nearest per block, amax / 448 a scale, partial last blocks as published."""
        (br, bc), (e, out, inp) = block or cls.block, w.shape
        rows, cols = -(-out // br), -(-inp // bc)
        padded = w.float().new_zeros(e, rows * br, cols * bc)
        padded[:, :out, :inp] = w.float()  # zeros never raise a block's amax
        amax = padded.view(e, rows, br, cols, bc).abs().amax(dim=(2, 4)).clamp_min(1e-12)
        scale = amax / FP8_MAX
        q = (w.float() / _per_element(scale, (br, bc), (out, inp))).to(torch.float8_e4m3fn)
        return {"weight": q, "scale_inv": scale}


def _per_element(
    scale: torch.Tensor, block: tuple[int, int], out_in: tuple[int, int]
) -> torch.Tensor:
    """[E, rows, cols] block scales -> [E, out, in], element (i, j) scale[i // br, j // bc]."""
    (br, bc), (out, inp) = block, out_in
    rows = scale.repeat_interleave(br, dim=1)[:, :out]
    return rows.repeat_interleave(bc, dim=2)[:, :, :inp]


def _scale_(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q [E, out, in] (a fresh fp32 tensor) times its block scales in place: the scales are
    expanded over rows only (a tensor in/128 wide) and broadcast over the whole column blocks,
    then the partial last one – no second weight-sized tensor for a whole stack."""
    (br, bc), out, inp = block, q.shape[1], q.shape[2]
    rows = scale.repeat_interleave(br, dim=1)[:, :out]  # [E, out, cols]
    full, rem = divmod(inp, bc)
    q[..., : full * bc].unflatten(-1, (full, bc)).mul_(rows[..., :full, None])
    if rem:
        q[..., full * bc :].mul_(rows[..., full:])
    return q


def _block_of(block: Any) -> tuple[int, int]:
    """Two positive integer sizes; a number, a string ("64" would read as 6 x 4) or a bool
    is refused, never guessed."""
    whole = isinstance(block, list | tuple) and len(block) == 2
    if whole and all(isinstance(b, int) and not isinstance(b, bool) for b in block):
        rows, cols = block
    else:
        rows = cols = 0
    if rows <= 0 or cols <= 0:
        raise QuantError(f"fp8 weight_block_size {block!r} is not two positive integer sizes",
                         "use the config.json published with these weights")  # fmt: skip
    return rows, cols


_VARIANTS: dict[tuple[type[BlockFP8], tuple[int, int]], type[BlockFP8]] = {}


def _with_block(fmt: type[BlockFP8], block: tuple[int, int]) -> type[BlockFP8]:
    """`fmt` (BlockFP8 or a subclass reading other keys) with another block size: one class a
    size (a stack names it as its backend, so every reader of its buffers – the forward,
    offload, the export – agrees)."""
    if block == fmt.block:
        return fmt
    if (fmt, block) not in _VARIANTS:
        name = f"{fmt.__name__}_{block[0]}x{block[1]}"
        variant = type(name, (fmt,), {"block": block, "__module__": __name__})
        globals()[name] = _VARIANTS[fmt, block] = variant  # found by name: pickle, deepcopy
    return _VARIANTS[fmt, block]


def _fp8_scales(scale: torch.Tensor) -> torch.Tensor:
    """fp32 / bf16 scales as they are; ue8m0 (uint8 bytes or float8_e8m0fnu): 2^(s - 127)."""
    if scale.dtype == torch.uint8:
        return (scale.to(torch.float32) - 127.0).exp2()
    return scale.to(torch.float32)
