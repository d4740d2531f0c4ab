"""engine/direct_io: aligned reads in flight fill (and widen into) the tensors the header says."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moetune.engine.direct_io import (
    ALIGN,
    DirectReader,
    Piece,
    ReadError,
    Span,
    plan_reads,
    read_rate,
)
from moetune.engine.stack_files import read_header, read_into
from moetune.model.weight_files import WeightFileError


@pytest.fixture
def shard(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A safetensors file whose tensors sit at unaligned offsets (an odd-sized header)."""
    gen = torch.Generator().manual_seed(0)
    tensors = {f"experts.{e}.w": torch.randn(37, 53, generator=gen).to(torch.bfloat16)
               for e in range(9)}  # fmt: skip
    tensors["odd"] = torch.arange(7, dtype=torch.int8)
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"pad": "x" * 13})
    return path, tensors


def _pieces(n: int, size: int) -> list[Piece]:
    return [Piece(Span("f", 100 + i * size, size, torch.bfloat16), None) for i in range(n)]


def test_reads_are_aligned_bounded_and_cover_every_byte() -> None:
    pieces = _pieces(10, 3000)  # 30 kB back to back from an unaligned offset
    reads = plan_reads(pieces, chunk=8192)
    assert all(r.start % ALIGN == 0 for r in reads)
    assert all(r.end - r.start <= 8192 for r in reads)
    covered = sorted((r.start + at, r.start + at + n) for r in reads for at, n, _, _ in r.parts)
    assert covered[0][0] == 100 and covered[-1][1] == 100 + 30_000
    assert all(a[1] == b[0] for a, b in itertools.pairwise(covered))  # no hole
    assert all(n % 2 == 0 for r in reads for _, n, _, _ in r.parts)  # whole bf16 elements
    assert len(reads) == 4  # bytes 100..30100 in 8 KiB windows, not one read per piece


def test_distant_pieces_are_separate_reads() -> None:
    far = [Piece(Span("f", 0, 4096, torch.uint8), None),
           Piece(Span("f", 64 << 20, 4096, torch.uint8), None),
           Piece(Span("g", 0, 4096, torch.uint8), None)]  # fmt: skip
    assert [(r.path, r.start) for r in plan_reads(far)] == [("f", 0), ("f", 64 << 20), ("g", 0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_read_into_widens_exactly(shard: tuple[Path, dict[str, torch.Tensor]],
                                  dtype: torch.dtype) -> None:  # fmt: skip
    path, tensors = shard
    header = read_header(path)
    segs = [header[f"experts.{e}.w"] for e in range(9)]
    out = torch.empty(9, 37, 53, dtype=dtype)
    read = read_into(segs, out, DirectReader(depth=3, chunk=ALIGN * 2))
    ref = torch.stack([tensors[f"experts.{e}.w"] for e in range(9)]).to(dtype)
    assert read == 9 * 37 * 53 * 2 and torch.equal(out, ref)


def test_a_file_shorter_than_its_header_is_refused(
    shard: tuple[Path, dict[str, torch.Tensor]],
) -> None:
    path, _ = shard
    seg = read_header(path)["experts.8.w"]
    path.write_bytes(path.read_bytes()[: seg.offset + 10])  # cut inside the last expert
    with pytest.raises(ReadError, match="before its header says"):
        read_into([seg], torch.empty(37, 53, dtype=torch.bfloat16))


def test_read_rate_reads_the_budget(shard: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = shard
    rate = read_rate([path], budget=ALIGN * 4, depth=2, chunk=ALIGN)
    assert rate.nbytes == min(ALIGN * 4, path.stat().st_size // ALIGN * ALIGN)
    assert rate.bytes_per_s > 0


def test_host_buffers_are_reused_only_when_nothing_holds_them() -> None:
    from moetune.engine.offload.sources import HostBuffers

    pool = HostBuffers()
    a = pool.empty((4, 8), dtype=torch.float32)
    first, view = a.data_ptr(), a[1]
    del a
    b = pool.empty((4, 8), dtype=torch.float32)
    assert b.data_ptr() != first  # a view of the first buffer still holds it
    del view
    c = pool.empty((2, 16), dtype=torch.float32)  # the same bytes, another shape
    assert c.data_ptr() == first and c.shape == (2, 16) and c.is_contiguous()
    d = pool.empty((3,), dtype=torch.float32)  # no free buffer of that size: a new one
    assert d.data_ptr() not in (first, b.data_ptr())
    pool.clear()  # the end of training: nothing kept for later
    assert pool.empty((4, 8), dtype=torch.float32).data_ptr() not in (b.data_ptr(), c.data_ptr())


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts /proc/self/fd")
def test_reading_leaves_no_file_open(shard: tuple[Path, dict[str, torch.Tensor]]) -> None:
    path, _ = shard
    seg = read_header(path)["experts.0.w"]
    before = len(list(Path("/proc/self/fd").iterdir()))
    for _ in range(5):
        read_into([seg], torch.empty(37, 53, dtype=torch.bfloat16))
    read_rate([path], budget=ALIGN)
    assert len(list(Path("/proc/self/fd").iterdir())) == before


def test_a_base_deleted_under_disk_offload_is_one_line_not_exit_3(shard) -> None:
    """Issue 36 item 8: train.offload: disk opens the base's files when it first reads them;
    a base moved or deleted by then was a bare FileNotFoundError (exit 3)."""
    path, _ = shard
    index = read_header(path)
    path.unlink()
    out = torch.empty(37, 53, dtype=torch.bfloat16)
    for reader in (None, DirectReader()):
        with pytest.raises(ReadError, match="went away while in use") as err:
            read_into([index["experts.0.w"]], out, reader)
        assert "keep the base in place" in err.value.fix
    with pytest.raises(WeightFileError, match="not found"):
        read_header(path)  # and the index of a base that is gone: one line as well


def test_a_damaged_header_is_one_line_naming_the_file(shard) -> None:
    """A header cut or overwritten (it was an exit-3 JSONDecodeError under disk offload)."""
    path, _ = shard
    whole = path.read_bytes()
    damaged = {
        "header length": whole[:500],
        "not JSON": whole[:8] + b"\xff" * 40 + whole[48:],
        "past the file's end": whole[:-100],
    }
    for why, damage in damaged.items():
        path.write_bytes(damage)
        with pytest.raises(WeightFileError, match=why):
            read_header(path)
