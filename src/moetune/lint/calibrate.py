"""`moetune doctor --calibrate`: measure this host once for the plan's CPU card.

Three figures, each the rate a CPU-offloaded step depends on (`plan.offload.cpu_step`):

- matmul GFLOP/s, fp32 and bf16, at an expert matmul's shape (`SHAPE`: a Qwen3-30B-A3B
  expert's hidden × intermediate, 256 rows) on torch's configured threads;
- memcpy GB/s: a `MEMCPY_BYTES` tensor copied into another (bytes copied per second);
- the disk's sequential read rate with O_DIRECT on the file system of `--path`
  (`engine.direct_io.read_rate`, the reader the offload stream uses), over a file given
  with `--file` or a temporary one written there and removed on every way out (SIGTERM
  included: it is raised as `ledger.Terminated` while the calibration runs).

It writes only a host file it could have made: where `plan.host.host_file()` (which
`$MOETUNE_HOST_FILE` may point anywhere) already holds something that is not a host
profile – a user's notes, other JSON, a directory – it refuses before measuring.

Each measure runs for about `SECONDS` (the disk probe: as long as its file takes), so a
calibration takes well under a minute. The result is written to `plan.host.host_file()`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from moetune.errors import ConfigError, os_problem
from moetune.io import unwritable
from moetune.ledger import sigterm_interrupts
from moetune.lint.doctor import hf_cache_dir
from moetune.plan.host import HostProfile, cpu_name, host_file, ram, save_host

SHAPE = (256, 2048, 768)  # rows × hidden → intermediate: one expert's gate/up projection
MEMCPY_BYTES = 256 << 20
SECONDS = 1.0  # per compute measure: long enough to average a shared core's noise
PROBE_BYTES = 1 << 30  # the temporary file's size: past any drive's cache and readahead
WRITE_BLOCK = 64 << 20


def calibrate(
    path: Path | None = None, file: Path | None = None, probe_bytes: int = PROBE_BYTES
) -> HostProfile:
    """Measure this host (the disk on `path`'s file system, or reading `file`)."""
    # lazy: heavy to import (torch)
    import torch

    where = path or default_dir()
    disk, direct = disk_read_gb_per_s(where, file, probe_bytes)
    total, _ = ram()
    return HostProfile(
        cpu=cpu_name(), cores=os.cpu_count() or 1, threads=torch.get_num_threads(),
        ram_bytes=total, measured_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        fp32_gflops=matmul_gflops(torch.float32), bf16_gflops=matmul_gflops(torch.bfloat16),
        memcpy_gb_per_s=memcpy_gb_per_s(), disk_read_gb_per_s=disk, disk_direct=direct,
        disk_path=str((file.parent if file else where).resolve()), source="calibrated",
    )  # fmt: skip


def calibrate_and_save(
    path: Path | None = None, file: Path | None = None, probe_bytes: int = PROBE_BYTES
) -> tuple[HostProfile, Path]:
    target = host_file()
    check_host_target(target)  # before a minute of measuring, not after
    check_probe(path or default_dir(), file)  # and before torch loads
    try:
        with sigterm_interrupts():  # SIGTERM unwinds through the probe file's cleanup
            profile = calibrate(path, file, probe_bytes)
    except KeyboardInterrupt as err:  # Ctrl-C, and SIGTERM as Terminated: say what to rerun
        err.add_note(f"rerun `moetune doctor --calibrate`; {target} was left as it was")
        raise
    return profile, save_host(profile, target)


def check_host_target(path: Path) -> None:
    """ConfigError unless `path` is absent or a host file: a JSON object with HostProfile's
    `cpu` and `measured_at` (other fields may be bad or mistyped: load_host's fix for those
    is to recalibrate); any other file there is the user's and is kept."""
    fix = "point MOETUNE_HOST_FILE at a new path (e.g. ~/.config/moetune/host.json) or move it"
    if path.is_dir() or (path.exists() and not path.is_file()):
        raise ConfigError(f"host file {path} is not a regular file; it is not overwritten", fix)
    if path.exists() and not _is_host_file(path):
        empty = path.stat().st_size == 0
        cause = f"{path} is not a host file moetune wrote{' (it is empty)' if empty else ''}; "
        cause += "--calibrate does not overwrite it"
        raise ConfigError(cause, f"remove it (it holds nothing) or {fix}" if empty else fix)
    if (why := unwritable(path.parent)) is not None:
        raise ConfigError(f"host file {path} cannot be written ({why}); nothing measured", fix)


def check_probe(where: Path, file: Path | None) -> None:
    """ConfigError unless the disk probe can run: `file` a regular file, or `where` a dir
    it can write its probe file in; neither on a RAM file system."""
    if file is not None:
        if not file.is_file():
            raise ConfigError(f"--file {file} is not a file", "name a large file on the disk")
        refuse_ram(file, "--file")
        return
    if not where.is_dir():
        raise ConfigError(f"--path {where} is not a directory", "name the checkpoint's dir")
    refuse_ram(where, "--path")
    if (why := unwritable(where)) is not None:
        raise ConfigError(
            f"--path {where}: the disk probe cannot write its file there ({why})",
            "pass --path on a writable dir of that disk, or --file with a large file on it",
        )


RAM_FILE_SYSTEMS = {"tmpfs", "ramfs", "devtmpfs"}


def file_system(path: Path) -> str | None:
    """The type of the file system `path` is on (Linux /proc/self/mountinfo: the longest
    mount point above it), or None where that cannot be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    target = str(path.resolve())
    best: tuple[int, str | None] = (-1, None)
    for line in lines:
        fields, _, rest = line.partition(" - ")
        point = fields.split(" ")[4].replace("\\040", " ") if fields.count(" ") >= 4 else ""
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best[0] and rest:
            best = (len(point), rest.split(" ")[0])
    return best[1]


def refuse_ram(where: Path, flag: str) -> None:
    """A disk probe on a RAM file system measures RAM: the plan would stream offloaded
    experts at memcpy speed. Refused, naming the file system."""
    kind = file_system(where)
    if kind in RAM_FILE_SYSTEMS:
        raise ConfigError(
            f"{flag} {where} is on {kind}, which lives in RAM: a disk-read probe there "
            "measures memory, not the disk the checkpoints stream from",
            "pass --path on the disk that holds your checkpoints (or --file with a large "
            "file on it)",
        )


def _is_host_file(path: Path) -> bool:
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):  # unreadable, not JSON, not UTF-8
        return False
    return isinstance(data, dict) and {"cpu", "measured_at"} <= set(data)


def default_dir() -> Path:
    """The HF cache (where checkpoints land) when it exists, else the working dir."""
    cache = hf_cache_dir()
    return cache if cache.is_dir() else Path.cwd()


def _rate(run: Callable[[], object], units: float) -> float:
    """`units` per second of `run`, repeated for about SECONDS after one warm-up."""
    run()
    count, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < SECONDS or count < 3:
        run()
        count += 1
    return units * count / elapsed


def matmul_gflops(dtype: object) -> float:
    """GFLOP/s of an expert-shaped matmul in `dtype` on torch's configured threads."""
    import torch  # lazy: heavy to import (torch)

    m, k, n = SHAPE
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)  # type: ignore[call-overload]
    return _rate(lambda: torch.mm(a, b), 2.0 * m * k * n) / 1e9


def memcpy_gb_per_s(nbytes: int = MEMCPY_BYTES) -> float:
    """Decimal GB/s of one large RAM-to-RAM copy (bytes copied per second)."""
    import torch  # lazy: heavy to import (torch)

    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    return _rate(lambda: dst.copy_(src), float(nbytes)) / 1e9


def disk_read_gb_per_s(where: Path, file: Path | None, probe_bytes: int) -> tuple[float, bool]:
    """(GB/s, O_DIRECT used) reading `file`, or a temporary file of `probe_bytes` in
    `where`; the engine's own reader measures it."""
    from moetune.engine.direct_io import read_rate  # lazy: heavy to import (torch)

    if file is not None:
        got = read_rate([file], budget=probe_bytes)
        return got.bytes_per_s / 1e9, got.direct
    with _probe_file(where, probe_bytes) as probe:
        got = read_rate([probe], budget=probe_bytes)
    return got.bytes_per_s / 1e9, got.direct


@contextmanager
def _probe_file(where: Path, nbytes: int) -> Iterator[Path]:
    """A file of `nbytes` in `where`, on the disk (fsynced), removed on the way out."""
    free = shutil.disk_usage(where).free
    if free < 2 * nbytes:
        raise ConfigError(
            f"{where} has {free / 2**30:.1f} GiB free, the disk probe writes "
            f"{nbytes / 2**30:.1f} GiB",
            "pass --path on a disk with room, or --file with a large file to read",
        )
    fd, name = tempfile.mkstemp(prefix=".moetune-calibrate-", dir=where)
    try:
        try:
            _fill(fd, nbytes)
        except OSError as exc:  # the disk filled or failed mid-way: one line, file removed
            raise ConfigError(
                f"--path {where}: writing the disk probe failed ({os_problem(exc)})",
                "pass --path on a disk with room, or --file with a large file to read",
            ) from None
        yield Path(name)
    finally:
        os.close(fd)
        os.unlink(name)


def _fill(fd: int, nbytes: int) -> None:
    """Write `nbytes` of random bytes (a compressing file system must not shrink them)."""
    block = os.urandom(min(WRITE_BLOCK, nbytes))
    left = nbytes
    while left > 0:
        left -= os.write(fd, block[:left])
    os.fsync(fd)
