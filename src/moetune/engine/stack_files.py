"""Where each frozen expert stack lies in a base's safetensors files, and reading it by offset.

A safetensors file is an 8-byte little-endian header length, a JSON header (dtype, shape,
data_offsets of every tensor) and the raw bytes. Stacks are read by offset through
engine/direct_io.py (aligned O_DIRECT reads, several in flight) – never mmap, never through
the page cache – so a base larger than RAM streams through a process whose RSS stays at a
couple of layers.

Checkpoints store experts fused (gpt_oss: `experts.gate_up_proj`) or one tensor per expert
(qwen2_moe-style `experts.{e}.gate_proj.weight`, mixtral-style `experts.{e}.w1.weight`);
transformers fuses the latter while loading. A registered `Layout` maps one fused stack of
the built model to the file segments that fill it, expert by expert, in row-major order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moetune.engine.direct_io import DirectReader, Piece, Span, read_once
from moetune.errors import MoetuneError
from moetune.model.weight_files import checkpoint_files, refuse_twice
from moetune.model.weight_files import read_header as checked_header
from moetune.registry import Registry

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
    "I64": torch.int64, "I32": torch.int32, "I8": torch.int8, "U8": torch.uint8,
    # kept though no weight is stored so: a scale saved as one must be named by its dtype,
    # not go missing from the index ("has no 'scales' tensors")
    "I16": torch.int16, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
    "BOOL": torch.bool, "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,  # published FP8 / FP4 checkpoints (engine/stored/formats.py)
}  # fmt: skip
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class OffloadError(MoetuneError):
    """Frozen expert weights cannot be offloaded as asked."""


@dataclass(frozen=True)
class Segment(Span):
    """One tensor's bytes in a file (offset: absolute, from the file's start)."""

    shape: tuple[int, ...]

    def itemsize_elements(self) -> int:
        """Elements it holds."""
        return self.nbytes // self.dtype.itemsize


def read_header(path: str | Path) -> dict[str, Segment]:
    """Every tensor of one safetensors file, by key (a damaged or vanished file: one line)."""
    header, base = checked_header(Path(path))
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        start, end = info["data_offsets"]
        dtype = _DTYPES.get(info["dtype"])
        if dtype is not None:
            out[key] = Segment(str(path), base + start, end - start, dtype, tuple(info["shape"]))
    return out


def index_dir(model_dir: str | Path) -> dict[str, Segment]:
    """Every tensor of the files that make a model dir's checkpoint (a key in two: refused)."""
    files = checkpoint_files(model_dir)
    if not files:
        raise OffloadError(
            f"train.offload reads the base's safetensors files, but {model_dir} has none",
            "save the base with save_pretrained (safetensors), or set train.offload: none",
        )
    out: dict[str, Segment] = {}
    for f in files:
        segments = read_header(f)
        refuse_twice(out.keys() & segments.keys(), lambda k: Path(out[k].path), f)
        out.update(segments)
    return out


def pieces_of(segments: list[Segment], out: torch.Tensor) -> list[Piece]:
    """The segments filling `out` (contiguous, any dtype or device) back to back."""
    flat, pos, pieces = out.view(-1), 0, []
    for seg in segments:
        n = seg.nbytes // seg.dtype.itemsize
        pieces.append(Piece(seg, flat[pos : pos + n]))
        pos += n
    if pos != out.numel():
        raise OffloadError(f"the checkpoint holds {pos} elements for a {out.numel()}-element "
                           "stack", "check that config.json belongs to these weights")  # fmt: skip
    return pieces


def read_into(
    segments: list[Segment], out: torch.Tensor, reader: DirectReader | None = None
) -> int:
    """Fill `out` with the segments back to back, cast to its dtype on the way; returns the
    bytes read. Never mmap, never the page cache: nothing of the file stays in the process."""
    pieces = pieces_of(segments, out)
    return reader.read(pieces) if reader is not None else read_once(pieces)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, Segment]:
    """Append raw tensors to a scratch file; where each landed (read back with read_into)."""
    out = {}
    with open(path, "ab") as f:
        for name, tensor in tensors.items():
            offset = f.tell()
            data = tensor.detach().contiguous().cpu()
            f.write(data.view(-1).view(torch.uint8).numpy().tobytes())
            out[name] = Segment(str(path), offset, data.nbytes, data.dtype, tuple(data.shape))
    return out


# ---------------------------------------------------------------- layouts

# (index, stack prefix, stack name, experts, per-expert key suffix: "weight" for float
# checkpoints, a stored format's own – "weight_scale_inv" …) -> segments
Layout = Callable[[dict[str, Segment], str, str, int, str], "list[Segment] | None"]
LAYOUTS: Registry[Layout] = Registry("expert checkpoint layout", OffloadError)


@LAYOUTS.register("fused")
def _fused(index: dict[str, Segment], prefix: str, name: str, experts: int,
           suffix: str = "weight") -> list[Segment] | None:  # fmt: skip
    seg = index.get(f"{prefix}.{name}")
    return [seg] if seg is not None else None


def _per_expert(parts: dict[str, tuple[str, ...]], prefixes: Callable[[str], list[str]]) -> Layout:
    """One tensor per expert and projection; `parts`: fused name -> the per-expert names
    concatenated (along the output rows) to make it."""

    def layout(
        index: dict[str, Segment], prefix: str, name: str, experts: int, suffix: str = "weight"
    ) -> list[Segment] | None:
        for base in prefixes(prefix):
            keys = [f"{base}.{e}.{p}.{suffix}" for e in range(experts) for p in parts.get(name, ())]
            if keys and all(k in index for k in keys):
                return [index[k] for k in keys]
        return None

    return layout


LAYOUTS.add("qwen2_moe", _per_expert(
    {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",),
     "up_proj": ("up_proj",)}, lambda p: [p]))  # fmt: skip
LAYOUTS.add("mixtral", _per_expert(
    {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)},
    lambda p: [p, p.replace(".mlp.experts", ".block_sparse_moe.experts")]))  # fmt: skip


def stack_segments(index: dict[str, Segment], prefix: str, name: str,
                   shape: tuple[int, ...]) -> list[Segment]:  # fmt: skip
    """The file segments that fill stack `prefix.name` of `shape`, by the first layout that
    finds them all; a layout whose bytes do not add up to the stack is a mismatch."""
    for layout_name, layout in LAYOUTS.items():
        found = layout(index, prefix, name, shape[0], "weight")
        if found is None:
            continue
        elements = sum(s.nbytes // s.dtype.itemsize for s in found)
        if elements != shape[0] * shape[1] * shape[2] or len({s.dtype for s in found}) != 1:
            raise OffloadError(
                f"{prefix}.{name}: the {layout_name} tensors in the checkpoint do not make a "
                f"{list(shape)} stack", "use the config.json saved with these weights")  # fmt: skip
        return found
    raise OffloadError(
        f"{prefix}.{name} is in none of the expert layouts moetune reads ({', '.join(LAYOUTS)})",
        "set train.offload: none, or register a Layout in engine/stack_files.py",
    )


def expert_part(segments: list[Segment], shape: tuple[int, ...], part: slice) -> list[Segment]:
    """The bytes of experts `part` of a stack of `shape` that `segments` fill expert-major
    (every layout does: a fused tensor, or one tensor per expert and projection), cut where
    the part begins and ends – what expert parallelism reads for one rank, and no more.
    Any stacked buffer with a leading expert dim: a weight, or a stored format's scales."""
    per_expert = math.prod(shape[1:])
    begin, end = part.start * per_expert, part.stop * per_expert  # elements of the stack
    out, pos = [], 0
    for seg in segments:
        size = seg.itemsize_elements()
        lo, hi = max(begin, pos), min(end, pos + size)
        if lo < hi:
            skip, n = (lo - pos) * seg.dtype.itemsize, (hi - lo) * seg.dtype.itemsize
            out.append(Segment(seg.path, seg.offset + skip, n, seg.dtype, (hi - lo,)))
        pos += size
    return out


def experts_segments(
    segments: list[Segment], shape: tuple[int, ...], ids: Sequence[int]
) -> list[Segment]:
    """The bytes of experts `ids` (any ids, in that order) of a stack of `shape`: each run of
    consecutive ids cut as one part (expert_part) – what a rank reads of a balanced
    placement (engine/ep_placement.py), whose experts need not sit side by side."""
    runs: list[list[int]] = []
    for e in ids:
        if runs and e == runs[-1][-1] + 1:
            runs[-1].append(e)
        else:
            runs.append([e])
    return [s for run in runs for s in expert_part(segments, shape, slice(run[0], run[-1] + 1))]


def keys_of(index: dict[str, Segment], segments: Iterable[Segment]) -> set[str]:
    """The keys of `index` whose bytes are among `segments` (what a stream must not read)."""
    taken = {(s.path, s.offset) for s in segments}
    return {key for key, s in index.items() if (s.path, s.offset) in taken}


def dtype_name(dtype: torch.dtype) -> str:
    return _NAMES.get(dtype, str(dtype))
