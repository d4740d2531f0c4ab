"""Reading a base's files at the disk's rate: large aligned reads, several in flight, no page cache.

A disk-offloaded step reads every expert stack of the base from its safetensors files, twice
or three times a step. Read per tensor through the page cache (open, pread, drop the pages,
close – per expert), a 2-core host reached 0.07–0.26 GB/s of a disk that reads 1.3 GB/s: the
time went to system calls, page-cache inserts and drops, and the page faults of a fresh
buffer per fetch. Here a batch of `Piece`s (a tensor's bytes in a file, and the tensor they
fill) is grouped into reads of up to `CHUNK` bytes, aligned to `ALIGN` so the file can be
opened `O_DIRECT` (the kernel DMAs straight into the buffer, nothing enters the page cache),
and `DEPTH` of them run at once on worker threads (os.preadv releases the GIL). Each worker
reads into its own reused staging buffer (pinned when the destination is a CUDA device) and
copies its pieces out with `Tensor.copy_`, which widens bf16 → fp32 (or casts on the device)
in the same pass – the widening runs on the workers, in parallel.

A file system without O_DIRECT (tmpfs, some network mounts, macOS) is read through the page
cache instead, with the pages dropped after each read (`posix_fadvise`), as before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetune.errors import MoetuneError, clip, os_problem

ALIGN = 4096  # bytes: O_DIRECT wants offset, length and address aligned to the logical block
CHUNK = 16 << 20  # bytes per read: past the size where an NVMe or a cloud disk peaks
DEPTH = 4  # reads in flight: enough to keep a queue on the device, few enough for 2 cores
GAP = 1 << 20  # bytes: a hole this small between two pieces is read through, not split


class ReadError(MoetuneError):
    """A base's file could not be read as its header says."""


@dataclass(frozen=True)
class Span:
    """Bytes of a file: `nbytes` at `offset`, holding elements of `dtype`."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype


@dataclass(frozen=True)
class Piece:
    """A span and the flat tensor it fills (any dtype or device: the copy casts)."""

    span: Span
    dst: torch.Tensor | None  # None: read and discarded (measuring the read rate)


@dataclass
class _Read:
    """One aligned read and the parts of pieces it fills: (position in the read, bytes,
    piece, byte offset inside the piece's span)."""

    path: str
    start: int
    end: int = 0  # the last byte wanted (the read itself is rounded up to ALIGN)
    parts: list[tuple[int, int, Piece, int]] = field(default_factory=list)


def _down(n: int) -> int:
    return n - n % ALIGN


def _up(n: int) -> int:
    return _down(n + ALIGN - 1)


def plan_reads(pieces: Iterable[Piece], chunk: int = CHUNK) -> list[_Read]:
    """Pieces in file order, grouped into aligned reads of at most `chunk` bytes."""
    reads: list[_Read] = []
    for piece in sorted(pieces, key=lambda p: (p.span.path, p.span.offset)):
        span, done = piece.span, 0
        size = span.dtype.itemsize
        while done < span.nbytes:
            pos, cur = span.offset + done, reads[-1] if reads else None
            fits = cur is not None and cur.path == span.path and cur.end + GAP >= pos
            take = min(span.nbytes - done, cur.start + chunk - pos) if fits else 0  # type: ignore[union-attr]
            take -= take % size
            if take <= 0:
                cur = _Read(span.path, _down(pos))
                reads.append(cur)
                take = min(span.nbytes - done, cur.start + chunk - pos)
                take -= take % size
            cur.parts.append((pos - cur.start, take, piece, done))  # type: ignore[union-attr]
            cur.end = pos + take  # type: ignore[union-attr]
            done += take
    return reads


class DirectReader:
    """Runs batches of pieces: `DEPTH` aligned reads in flight, O_DIRECT where the file
    system takes it. One per ExpertStore (its workers, staging buffers and open files are
    reused); `close()` (also run when it is collected) shuts the workers and the files."""

    def __init__(self, depth: int = DEPTH, chunk: int = CHUNK, direct: bool = True) -> None:
        self.depth, self.chunk, self.direct = depth, chunk, direct
        self._pool = ThreadPoolExecutor(depth, thread_name_prefix="moetune-read")
        self._local = threading.local()
        self._fds: dict[str, tuple[int, bool]] = {}
        self._fd_lock = threading.Lock()
        self.close = weakref.finalize(self, _close, self._pool, self._fds)

    def read(self, pieces: Sequence[Piece]) -> int:
        """Fill every piece's tensor; returns the bytes of the pieces (what was wanted)."""
        reads = plan_reads(pieces, self.chunk)
        for _ in self._pool.map(self._run, reads):
            pass
        return sum(p.span.nbytes for p in pieces)

    def _run(self, read: _Read) -> None:
        length = _up(read.end) - read.start
        buf = self._staging(length, any(_on_cuda(p) for _, _, p, _ in read.parts))
        got = self._pread(read.path, buf[:length], read.start)
        if got < read.end - read.start:
            short = read.end - read.start - got
            raise ReadError(f"{read.path} ends {short} bytes before its header says",
                            "re-download the base")  # fmt: skip
        streams = {}
        for at, nbytes, piece, inner in read.parts:
            if piece.dst is not None:
                stream = self._stream(piece.dst.device) if _on_cuda(piece) else None
                _copy_part(buf, at, nbytes, piece, inner, stream)
                streams[id(stream)] = stream
        for stream in streams.values():  # the staging buffer is reused by the next read
            if stream is not None:
                stream.synchronize()

    def _staging(self, nbytes: int, pin: bool) -> torch.Tensor:
        """This worker's buffer, at an ALIGN-aligned address, grown to `nbytes` as needed."""
        have = getattr(self._local, "buf", None)
        if have is None or have.numel() < nbytes or (pin and not have.is_pinned()):
            raw = torch.empty(max(nbytes, 1) + ALIGN, dtype=torch.uint8, pin_memory=pin)
            skip = -raw.data_ptr() % ALIGN
            self._local.raw, self._local.buf = raw, raw[skip : skip + max(nbytes, 1)]
        return self._local.buf  # type: ignore[no-any-return]

    def _stream(self, device: torch.device) -> Any:
        """This worker's copy stream on `device` (entering it also makes that device current)."""
        streams = self._local.__dict__.setdefault("streams", {})
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return streams[device]

    def _fd(self, path: str) -> tuple[int, bool]:
        with self._fd_lock:
            if path not in self._fds:
                self._fds[path] = _open(path, self.direct)
            return self._fds[path]

    def _pread(self, path: str, buf: torch.Tensor, offset: int) -> int:
        fd, direct = self._fd(path)
        view = memoryview(buf.numpy())  # type: ignore[arg-type]
        try:
            got = _pread_all(fd, view, offset)
        except OSError:  # O_DIRECT refused at read time: this file goes through the cache
            if not direct:
                raise
            with self._fd_lock:
                self._fds[path] = _open(path, False)
            return self._pread(path, buf, offset)
        if not direct and hasattr(os, "posix_fadvise"):  # keep the page cache out
            os.posix_fadvise(fd, offset, len(view), os.POSIX_FADV_DONTNEED)
        return got


def _open(path: str, direct: bool) -> tuple[int, bool]:
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    if flag:
        try:
            return os.open(path, os.O_RDONLY | flag), True
        except OSError:  # tmpfs and some network file systems refuse O_DIRECT
            pass
    try:
        return os.open(path, os.O_RDONLY), False
    except OSError as exc:  # the base moved or deleted while a run streams from it
        raise ReadError(
            f"{clip(path, 100)}: {os_problem(exc)} – the base's files went away while in use",
            "keep the base in place until the run ends (train.offload reads it), then rerun",
        ) from None


def _pread_all(fd: int, view: memoryview, offset: int) -> int:
    """Read until the view is full or the file ends; the bytes read."""
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _on_cuda(piece: Piece) -> bool:
    return piece.dst is not None and piece.dst.device.type == "cuda"


def _copy_part(buf: torch.Tensor, at: int, nbytes: int, piece: Piece, inner: int,
               stream: Any) -> None:  # fmt: skip
    """Copy (and cast) one part of a piece out of the staging buffer."""
    src = buf[at : at + nbytes]
    size = piece.span.dtype.itemsize
    if at % size:  # a view of another dtype needs its own alignment
        src = src.clone()
    dst = piece.dst[inner // size : (inner + nbytes) // size]  # type: ignore[index]
    if stream is None:
        dst.copy_(src.view(piece.span.dtype))
        return
    with torch.cuda.stream(stream):  # across, then widened on the device (a casting
        moved = src.view(piece.span.dtype).to(dst.device, non_blocking=True)  # H2D copy_
        dst.copy_(moved, non_blocking=True)  # would cast on the host, unpinned and blocking


def _close(pool: ThreadPoolExecutor, fds: dict[str, tuple[int, bool]]) -> None:
    pool.shutdown(wait=False)
    for fd, _ in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)


def read_once(pieces: Sequence[Piece]) -> int:
    """`DirectReader.read` with a reader of its own, closed after: loading reads each file
    once, and an open descriptor would keep a deleted file's space taken."""
    reader = DirectReader()
    try:
        return reader.read(pieces)
    finally:
        reader.close()


# ---------------------------------------------------------------- measuring the disk


@dataclass(frozen=True)
class ReadRate:
    """How fast a file system gave back a file's bytes."""

    bytes_per_s: float
    nbytes: int
    direct: bool  # O_DIRECT (the device's rate) or through the page cache
    depth: int
    chunk: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def read_rate(paths: Sequence[str | Path], budget: int = 1 << 30, depth: int = DEPTH,
              chunk: int = CHUNK) -> ReadRate:  # fmt: skip
    """Sequential read rate over up to `budget` bytes of `paths`, `depth` reads of `chunk`
    bytes in flight, nothing copied out: the rate the offload stream is compared with."""
    pieces, left = [], budget
    for path in paths:
        size = min(os.path.getsize(path), left)
        pieces.append(Piece(Span(str(path), 0, _down(size), torch.uint8), None))
        left -= _down(size)
    reader = DirectReader(depth, chunk)
    try:
        start = time.perf_counter()
        nbytes = reader.read([p for p in pieces if p.span.nbytes])
        seconds = time.perf_counter() - start
        direct = all(reader._fd(str(p))[1] for p in paths)
    finally:
        reader.close()
    return ReadRate(nbytes / max(seconds, 1e-9), nbytes, direct, depth, chunk)
