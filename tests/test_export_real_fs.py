"""`moetune export` against a real refusal of the filesystem, not a monkeypatched one: an
`--out` the user may not write (as root, which chmod alone does not stop: the CLI runs
without CAP_DAC_OVERRIDE, or as nobody), a read-only mount, and a full disk (a tmpfs
smaller than the merged checkpoint). Each is exit 2 with one line and its fix, nothing
left at `--out` or beside it, the adapter untouched. Skipped, with the reason, where this
machine cannot deny a write or mount a filesystem."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from export_fixtures import make_run
from moetune.cli import app

pytestmark = pytest.mark.filterwarnings("ignore")

# Ways to run a command that the kernel refuses a write into a folder with mode 0555:
# a plain user already is refused; root is refused once its capabilities to override file
# modes are gone (it stays uid 0, so it still reads root's 0700 home and venv), or as nobody.
OVERRIDES = "-dac_override,-dac_read_search,-fowner"
NO_OVERRIDE = ["setpriv", "--inh-caps=-all", f"--bounding-set={OVERRIDES}"]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
PROBE = "import moetune, sys; open(sys.argv[1]).read(); open(sys.argv[2] + '/probe', 'w')"


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_run(tmp_path_factory.mktemp("realfs"), "qwen3_moe-dense0")


def _env() -> dict[str, str]:
    src = str(Path(__file__).resolve().parents[1] / "src")
    return {**os.environ, "PYTHONPATH": src, "HF_HUB_OFFLINE": "1"}


def _denier(run: Path, denied: Path) -> list[str]:
    """The first wrapper under which the kernel refuses a write into `denied` while the run
    stays readable; skips the test where there is none."""
    tried = []
    for wrapper in [NO_OVERRIDE, NOBODY] if os.geteuid() == 0 else [[]]:
        if wrapper and shutil.which(wrapper[0]) is None:
            continue
        cmd = [*wrapper, sys.executable, "-c", PROBE, str(run / "config.yaml"), str(denied)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
        if done.returncode and "PermissionError" in done.stderr and "probe" in done.stderr:
            return wrapper
        (denied / "probe").unlink(missing_ok=True)
        said = done.stderr.strip()[-80:] or "allowed"
        tried.append(f"{' '.join(wrapper[:2]) or 'as is'}: {said}")
    pytest.skip(f"no way to deny a write to this user here ({'; '.join(tried)})")


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _one_line_refusal(code: int, stderr: str, said: str) -> None:
    """Exit 2 and the error as one line (after any progress bars of the work before it)."""
    assert code == 2, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and said in errors[0] and "fix:" in errors[0], stderr
    assert stderr.strip().endswith(errors[0]), stderr
    assert "Traceback" not in stderr and "unexpected" not in stderr


@pytest.mark.parametrize("where", ["in", "under"])
def test_an_out_the_user_may_not_write_is_refused_and_nothing_is_written(
    made: Path, tmp_path: Path, where: str
) -> None:
    denied = tmp_path / "denied"
    denied.mkdir(mode=0o555)
    denied.chmod(0o555)
    wrapper = _denier(made, denied)
    before = _digest(made / "adapter")
    out = denied / "m" if where == "in" else denied / "missing" / "m"
    cmd = [*wrapper, sys.executable, "-m", "moetune", "export", str(made), "--format",
           "merged", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(), check=False)
    _one_line_refusal(done.returncode, done.stderr, f"--out {out} cannot be written")
    assert "Permission denied" in done.stderr and "pass an --out in a folder" in done.stderr
    assert list(denied.iterdir()) == [] and not list(tmp_path.glob(".moetune-export*"))
    assert _digest(made / "adapter") == before
    denied.chmod(0o755)


@pytest.fixture
def mounted(tmp_path: Path) -> Iterator[list[str]]:
    """The mount points a test made with `_mount`, unmounted afterwards."""
    points: list[str] = []
    yield points
    for point in reversed(points):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)


def _mount(points: list[str], point: Path, *args: str) -> None:
    point.mkdir(exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here")
    done = subprocess.run(["mount", *args, str(point)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"mount is not permitted here: {done.stderr.strip()[-100:]}")
    points.append(str(point))


def test_a_read_only_filesystem_is_refused_in_one_line(
    made: Path, tmp_path: Path, mounted: list[str]
) -> None:
    ro = tmp_path / "ro"
    _mount(mounted, ro, "-t", "tmpfs", "-o", "size=1m,ro", "tmpfs")
    out = ro / "m"
    got = CliRunner().invoke(app, ["export", str(made), "--format", "merged", "--out", str(out)])
    _one_line_refusal(got.exit_code, got.stderr, f"--out {out} cannot be written")
    assert "Read-only file system" in got.stderr and list(ro.iterdir()) == []


def test_a_real_full_disk_is_one_line_and_leaves_nothing(
    made: Path, tmp_path: Path, mounted: list[str]
) -> None:
    disk = tmp_path / "disk"
    _mount(mounted, disk, "-t", "tmpfs", "-o", "size=32k", "tmpfs")
    before = _digest(made / "adapter")
    out = disk / "m"
    got = CliRunner().invoke(app, ["export", str(made), "--format", "merged", "--out", str(out)])
    _one_line_refusal(got.exit_code, got.stderr, f"disk full while writing the export to {out}")
    assert "nothing was left behind" in got.stderr and "free space, or pass an --out" in got.stderr
    assert list(disk.iterdir()) == []  # no --out, no temp dir, no lock file
    assert shutil.disk_usage(disk).used == 0
    assert _digest(made / "adapter") == before
    # the same export where there is room: the checkpoint really is bigger than the disk
    roomy = tmp_path / "roomy"
    got = CliRunner().invoke(
        app, ["export", str(made), "--format", "merged", "--no-check", "--out", str(roomy)]
    )
    assert got.exit_code == 0, got.stderr
    assert sum(p.stat().st_size for p in roomy.iterdir()) > 32 * 1024
