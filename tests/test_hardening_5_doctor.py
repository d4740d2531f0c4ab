"""Issue 48 (fifth hardening pass), `doctor --calibrate`: a probe dir it cannot write, a host
file it cannot write, a 0-byte host file and a probe dir in RAM (tmpfs: a disk probe there
measures memory) are each one line, exit 2, before a minute of measuring – and the probe
file is gone on every way out."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

import moetune.lint.calibrate as calibrate
from moetune.cli import app

runner = CliRunner()


@pytest.fixture
def host_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "config" / "host.json"
    monkeypatch.setenv("MOETUNE_HOST_FILE", str(path))
    monkeypatch.setattr(calibrate, "SECONDS", 0.01)
    return path


def _unwritable(tmp_path: Path) -> Path:
    """A dir no file can be made in: chmod 555, or (root passes permission bits) sysfs."""
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        return ro
    for candidate in (Path("/sys/kernel"), Path("/sys")):
        if candidate.is_dir() and calibrate.unwritable(candidate) is not None:
            return candidate
    pytest.skip("no dir here refuses root's writes")


def _calibrate(*extra: str) -> tuple[int, str, dict]:
    result = runner.invoke(app, ["doctor", "--calibrate", "--probe-mib", "1", *extra])
    as_json = runner.invoke(app, ["doctor", "--calibrate", "--probe-mib", "1", *extra, "--json"])
    assert result.exit_code == as_json.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.output
    return result.exit_code, result.stderr, json.loads(as_json.stdout)["error"]


def test_a_probe_dir_that_cannot_be_written_is_named(host_file, tmp_path):
    ro = _unwritable(tmp_path)
    _, line, error = _calibrate("--path", str(ro))  # was: exit 3 (PermissionError)
    assert "the disk probe cannot write its file there" in error["cause"] and str(ro) in line
    assert not host_file.exists()


def test_a_host_file_that_cannot_be_written_is_refused_before_measuring(
    tmp_path, monkeypatch, host_file
):
    target = _unwritable(tmp_path) / "moetune" / "host.json"
    monkeypatch.setenv("MOETUNE_HOST_FILE", str(target))

    def measured(*_, **__):
        raise AssertionError("measured before the host file was checked")

    monkeypatch.setattr(calibrate, "calibrate", measured)
    disk = tmp_path / "disk"
    disk.mkdir()
    _, _, error = _calibrate("--path", str(disk))  # was: a minute of measuring, then exit 3
    assert f"host file {target} cannot be written" in error["cause"]
    assert list(disk.iterdir()) == []


def test_a_zero_byte_host_file_is_named_as_empty_and_kept(host_file, tmp_path):
    host_file.parent.mkdir(parents=True)
    host_file.touch()
    disk = tmp_path / "disk"
    disk.mkdir()
    _, _, error = _calibrate("--path", str(disk))
    assert "(it is empty)" in error["cause"] and "remove it (it holds nothing)" in error["fix"]
    assert host_file.read_bytes() == b""


def _ram_dir() -> Path:
    shm = Path("/dev/shm")
    if not shm.is_dir() or calibrate.file_system(shm) not in calibrate.RAM_FILE_SYSTEMS:
        pytest.skip("no tmpfs at /dev/shm here")
    return shm


def test_a_probe_on_a_ram_file_system_is_refused_naming_it(host_file, tmp_path):
    shm = _ram_dir()
    before = set(shm.iterdir())
    _, _, error = _calibrate("--path", str(shm))  # was: "disk read 0.21 GB/s" of RAM
    assert "is on tmpfs, which lives in RAM" in error["cause"] and "--path" in error["fix"]
    probe = shm / f"moetune-test-{os.getpid()}"
    probe.write_bytes(b"\0" * 4096)
    try:
        _, _, error = _calibrate("--file", str(probe))
        assert "--file" in error["cause"] and "tmpfs" in error["cause"]
    finally:
        probe.unlink()
    assert set(shm.iterdir()) == before and not host_file.exists()
    assert calibrate.file_system(tmp_path) not in (None, "")  # the disk's own type is read


def test_a_probe_write_that_fails_midway_is_one_line_and_leaves_no_file(
    host_file, tmp_path, monkeypatch
):
    def full(fd: int, nbytes: int) -> None:
        os.write(fd, b"\0" * 4096)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(calibrate, "_fill", full)
    disk = tmp_path / "disk"
    disk.mkdir()
    _, _, error = _calibrate("--path", str(disk))
    assert "writing the disk probe failed (No space left on device)" in error["cause"]
    assert list(disk.iterdir()) == [] and not host_file.exists()


def test_doctor_names_a_hugging_face_cache_it_cannot_write(tmp_path, monkeypatch):
    cache = _unwritable(tmp_path) / ".cache" / "huggingface"
    monkeypatch.setenv("HF_HOME", str(cache))
    result = runner.invoke(app, ["doctor", "--json"])
    problems = json.loads(result.stdout)["problems"]
    said = [p for p in problems if f"cache {cache} cannot be written" in p["message"]]
    assert said and "HF_HOME" in said[0]["fix"]  # was: "free disk … 0.0 GiB", nothing more
