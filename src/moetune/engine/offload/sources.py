"""Where an offloaded expert stack waits between uses, and what it is materialised into.

A `Source` (host RAM, float or quantised; a file, float or quantised) `prepare`s its stack
on a device: the empty tensors to fill and the file pieces (engine/direct_io.py) that fill
them – a host stack is copied at once. On a CPU the tensors come from `HostBuffers`, which
hands the same host memory out again once nothing holds it.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, Union

import torch

from moetune.engine.direct_io import Piece
from moetune.engine.quant.stacks import QuantizedStack
from moetune.engine.stack_files import Segment, pieces_of, write_tensors

Empty = Callable[..., torch.Tensor]  # torch.empty's signature: (shape, *, dtype, device)
Weight = Union[torch.Tensor, QuantizedStack]  # noqa: UP007 (a runtime alias)


class Source(Protocol):
    """Where one stack waits. `prepare` gives the stack to fill on a device and the file
    pieces that fill it (none for a stack held in host RAM: it is copied at once)."""

    @property
    def nbytes(self) -> int:
        """Bytes moved to the device per fetch (the stored form: quantised if it is)."""
        ...

    def prepare(self, device: torch.device, dtype: torch.dtype,
                empty: Empty = torch.empty) -> tuple[Weight, list[Piece]]: ...  # fmt: skip


@dataclass
class HostFloat:
    tensor: torch.Tensor  # host RAM, the stored dtype

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def prepare(self, device: torch.device, dtype: torch.dtype,
                empty: Empty = torch.empty) -> tuple[Weight, list[Piece]]:  # fmt: skip
        if device.type == "cpu":  # one pass, widening as it copies (its own copy: counted)
            return empty(self.tensor.shape, dtype=dtype).copy_(self.tensor), []
        return self.tensor.to(device, non_blocking=True).to(dtype), []


@dataclass
class FileFloat:
    segments: list[Segment]  # filling the stack expert by expert
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def prepare(self, device: torch.device, dtype: torch.dtype,
                empty: Empty = torch.empty) -> tuple[Weight, list[Piece]]:  # fmt: skip
        out = empty(self.shape, dtype=dtype, device=device)  # the read widens into it
        return out, pieces_of(self.segments, out)


@dataclass
class HostQuant:
    stack: QuantizedStack  # buffers in host RAM

    @property
    def nbytes(self) -> int:
        return self.stack.nbytes

    def prepare(self, device: torch.device, dtype: torch.dtype,
                empty: Empty = torch.empty) -> tuple[Weight, list[Piece]]:  # fmt: skip
        bufs = {n: b.to(device, non_blocking=True) for n, b in self.stack.named_buffers()}
        bufs = {n: b.clone() if b is self.stack.get_buffer(n) else b for n, b in bufs.items()}
        return _quant_like(self.stack, bufs, dtype), []


@dataclass
class FileQuant:
    like: QuantizedStack  # shape, layout and backend; its buffers are meta
    segments: dict[str, Segment]  # buffer name -> where the scratch file holds it

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments.values())

    def prepare(self, device: torch.device, dtype: torch.dtype,
                empty: Empty = torch.empty) -> tuple[Weight, list[Piece]]:  # fmt: skip
        bufs = {n: empty(s.shape, dtype=s.dtype, device=device)
                for n, s in self.segments.items()}  # fmt: skip
        pieces = [p for n, s in self.segments.items() for p in pieces_of([s], bufs[n])]
        return _quant_like(self.like, bufs, dtype), pieces


def _quant_like(
    like: QuantizedStack, bufs: dict[str, torch.Tensor], dtype: torch.dtype
) -> QuantizedStack:
    return QuantizedStack(like.shape, like.transposed, dtype, like.backend, bufs)


def host_source(weight: Weight, pin: bool) -> Source:
    """A stack copied into host RAM (pinned for CUDA copies)."""
    if isinstance(weight, QuantizedStack):
        bufs = {n: _host_copy(b, pin) for n, b in weight.named_buffers()}
        return HostQuant(_quant_like(weight, bufs, weight.dtype))
    return HostFloat(_host_copy(weight, pin))


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
    out.copy_(t.detach())
    return out


def spill_source(weight: Weight, scratch: Path) -> Source:
    """A stack written to a scratch file (quantised stacks, or weights with no base file)."""
    if isinstance(weight, QuantizedStack):
        segments = write_tensors(scratch, dict(weight.named_buffers()))
        meta = {n: torch.empty_like(b, device="meta") for n, b in weight.named_buffers()}
        return FileQuant(_quant_like(weight, meta, weight.dtype), segments)
    (seg,) = write_tensors(scratch, {"w": weight}).values()
    return FileFloat([seg], tuple(weight.shape))


class HostBuffers:
    """Host memory for the stacks a CPU store materialises, reused once nothing holds it.

    Fresh tensors of hundreds of MB cost their page faults on every fetch (the kernel zeroes
    each page): widening a stack into fresh memory ran at half the rate of widening into
    memory already touched. A buffer is handed out again only when no tensor refers to its
    storage any more (a view or a tensor saved for backward keeps it taken), and one is made
    only when every buffer of that size is taken – so the buffers never outnumber the stacks
    that were alive at once, and the peak is the store's own."""

    def __init__(self) -> None:
        self._storages: list[torch.UntypedStorage] = []
        self._lock = threading.Lock()

    def empty(self, shape: Any, *, dtype: torch.dtype, device: Any = None) -> torch.Tensor:
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            storage = next((s for s in self._storages if s.nbytes() == nbytes and _free(s)), None)
            if storage is None:
                storage = torch.UntypedStorage(nbytes)
                self._storages.append(storage)
            strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
            return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), strides)

    def clear(self) -> None:
        """Forget every buffer: those no tensor holds are freed now, the others with them."""
        with self._lock:
            self._storages.clear()


def _free(storage: torch.UntypedStorage) -> bool:
    """Only the pool's own reference is left (private API: without it, nothing is reused)."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return count is not None and count(storage._cdata) == 1
