"""The ssh provider against a real sshd on loopback: commands, copies that resume and verify,
host-key pinning, detached jobs and their termination. The "remote" host is this machine,
so tests inspect remote files directly on disk."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from moetune.config import LaneArgs
from moetune.io import file_digests
from moetune.lane.providers.base import (
    PROVIDERS,
    LaneError,
    PodGone,
    PodSpec,
    SshTarget,
    TransientError,
)
from moetune.lane.providers.ssh import (
    VANISHED_RC,
    SshProvider,
    SshTransport,
    staging_path,
)
from sshd import SKIP_REASON, Sshd, free_port, have_sshd, keygen, start_sshd

pytestmark = pytest.mark.skipif(not have_sshd(), reason=SKIP_REASON)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    sshd = start_sshd(tmp_path_factory.mktemp("sshd"))
    yield sshd
    sshd.stop()


def transport(server: Sshd, tmp_path: Path) -> SshTransport:
    """A transport whose workdir is `tmp_path/remote`, with short retry backoffs."""
    kh = tmp_path / "known_hosts"
    t = SshTransport(server.target, server.identity, kh, str(tmp_path / "remote"))
    t.retry_delays = (0.2, 0.5)
    return t


@pytest.fixture
def provider(server: Sshd, tmp_path: Path) -> SshProvider:
    return SshProvider(server.target, server.identity, tmp_path / "kh", str(tmp_path / "runs"))


def wait_for(check: Callable[[], object], timeout_s: float = 10.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (value := check()) is not None:
            return value
        time.sleep(0.1)
    raise AssertionError("timed out waiting")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- commands ------------------------------------------------------------------------------


def test_exec_keeps_rc_streams_and_quoting(server: Sshd, tmp_path: Path) -> None:
    t = transport(server, tmp_path)
    result = t.exec("echo out; echo err >&2; exit 7")
    assert (result.rc, result.stdout, result.stderr) == (7, "out\n", "err\n")
    args = ["plain", "with space", 'it\'s "quoted"', "new\nline", "$HOME `id` \\ * ;|&"]
    echoed = t.exec("printf '%s\\0' " + shlex.join(args)).stdout
    assert echoed.split("\0")[:-1] == args
    assert t.exec("pwd").stdout.strip() == t.workdir  # runs in the workdir it created
    assert "StrictHostKeyChecking=accept-new" in t.ssh_argv()
    assert str(server.identity) in t.ssh_argv() and "IdentitiesOnly=yes" in t.ssh_argv()
    pinned = ["ssh-keygen", "-F", f"[127.0.0.1]:{server.port}", "-f", str(t.known_hosts)]
    assert subprocess.run(pinned, capture_output=True).returncode == 0  # pinned on first use


def test_connection_faults_are_classified(server: Sshd, tmp_path: Path) -> None:
    with pytest.raises(TransientError, match="timed out"):
        transport(server, tmp_path).exec("sleep 5", timeout_s=0.5)
    nobody = SshTarget("127.0.0.1", free_port())
    t = SshTransport(nobody, server.identity, tmp_path / "kh2", "w")
    with pytest.raises(TransientError, match="connection to"):
        t.exec("true")
    stranger = keygen(tmp_path / "not_authorised")
    t = SshTransport(server.target, stranger, tmp_path / "kh3", "w")
    with pytest.raises(LaneError, match="refused the login") as err:
        t.exec("true")
    assert not isinstance(err.value, TransientError)
    assert stranger.read_text().splitlines()[1] not in str(err.value)  # no key material


def test_changed_host_key_is_refused(tmp_path: Path) -> None:
    own = start_sshd(tmp_path / "own-sshd")
    try:
        t = transport(own, tmp_path)
        assert t.exec("true").rc == 0
        t.copy_in(tmp_path / "known_hosts", "kh")  # rsync found on both ends (cached)
        own.restart_with_new_host_key()
        pinned = f"host key of 127.0.0.1:{own.port} changed since this run pinned it"
        with pytest.raises(LaneError, match=pinned) as err:
            t.exec("true")
        assert not isinstance(err.value, TransientError)  # never retried into acceptance
        assert str(t.known_hosts) in err.value.fix
        with pytest.raises(LaneError, match=pinned):  # rsync's ssh is refused the same way
            t.copy_out("kh", tmp_path / "kh-back")
        assert not (tmp_path / "kh-back").exists()
        fresh_run = transport(own, tmp_path / "next-run")
        assert fresh_run.exec("true").rc == 0  # a new run pins the new key
    finally:
        own.stop()


# -- copies --------------------------------------------------------------------------------


def make_tree(root: Path) -> Path:
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"r": 16}\n')
    (root / "nested" / "with space's.bin").write_bytes(os.urandom(300_000))
    (root / "nested" / "deeper" / "ünïcode.txt").write_text("ok\n")
    (root / "empty").write_bytes(b"")
    (root / ".hidden").write_text("dotfile\n")
    return root


@pytest.mark.parametrize("rsync", [True, False], ids=["rsync", "scp"])
def test_copy_in_then_out_is_byte_identical(server: Sshd, tmp_path: Path, rsync: bool) -> None:
    t = transport(server, tmp_path)
    t.prefer_rsync = rsync
    tree = make_tree(tmp_path / "tree")
    t.copy_in(tree, "stage/data")
    assert file_digests(Path(t.workdir) / "stage" / "data") == file_digests(tree)
    t.copy_out("stage/data", tmp_path / "back" / "data")
    assert file_digests(tmp_path / "back" / "data") == file_digests(tree)
    t.copy_out("stage/data/empty", tmp_path / "one")  # a single file
    assert (tmp_path / "one").read_bytes() == b""
    t.copy_out("stage/data", tmp_path / "back" / "data")  # replaces an existing copy
    assert file_digests(tmp_path / "back" / "data") == file_digests(tree)
    assert not staging_path(tmp_path / "back" / "data").exists()
    with pytest.raises(LaneError, match=r"failed \(rc \d+\).*No such file") as err:
        t.copy_out("stage/missing", tmp_path / "missing")
    assert not isinstance(err.value, TransientError) and not (tmp_path / "missing").exists()


@pytest.mark.parametrize("fault", ["remote changed after copy", "local copy corrupted"])
def test_copy_out_verification_refuses_mismatch(
    server: Sshd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    t = transport(server, tmp_path)
    remote = make_tree(Path(t.workdir) / "adapter")
    victim = remote / "nested" / "with space's.bin"
    local = tmp_path / "banked"
    real_fetch = t._fetch

    def fetch_then_break(full: str, staging: Path) -> None:
        real_fetch(full, staging)
        target = (
            victim
            if fault.startswith("remote")
            else staging / "adapter" / victim.relative_to(remote)
        )
        data = bytearray(target.read_bytes())
        data[1000] ^= 0xFF  # same size, other bytes: only a content hash can tell
        target.write_bytes(bytes(data))

    monkeypatch.setattr(t, "_fetch", fetch_then_break)
    with pytest.raises(LaneError, match="sha256 mismatch") as err:
        t.copy_out("adapter", local)
    assert "with space's.bin" in err.value.cause
    assert not local.exists()  # never a silently corrupt copy
    staged = staging_path(local) / "adapter"
    assert not (staged / victim.relative_to(remote)).exists()  # pruned, fetched afresh next
    assert (staged / "adapter_config.json").exists()  # verified files are kept
    monkeypatch.undo()
    t.copy_out("adapter", local)
    assert file_digests(local) == file_digests(remote)


def _rsync_senders(port: int) -> list[int]:
    """Pids of the server-side rsync processes sending files through our sshd."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ours = any(v.startswith(b"SSH_CONNECTION=") and v.endswith(b" %d" % port) for v in env)
        if ours and argv[0].endswith(b"rsync") and b"--server" in argv and b"--sender" in argv:
            found.append(int(entry.name))
    return found


def _staged_bytes(staging: Path) -> int:
    total = 0
    for f in staging.rglob("*"):
        with contextlib.suppress(OSError):  # rsync renames its temp file when it drops
            total += f.stat().st_size if f.is_file() else 0
    return total


def test_copy_out_resumes_after_drop_and_verifies(
    server: Sshd, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    t = transport(server, tmp_path)
    t.rsync_args = ("--bwlimit=20000",)  # ~20 MB/s, so the drop lands mid-file
    big = Path(t.workdir) / "big.bin"
    big.parent.mkdir(parents=True)
    big.write_bytes(os.urandom(50 * 2**20))
    local = tmp_path / "big.bin"
    killed: list[int] = []
    staged_at_start: list[int] = []
    real_fetch = t._fetch

    def fetch(full: str, staging: Path) -> None:
        staged_at_start.append(_staged_bytes(staging))
        real_fetch(full, staging)

    t._fetch = fetch  # type: ignore[method-assign]

    def drop_once() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not killed:
            if staging_path(local).exists() and _staged_bytes(staging_path(local)) > 10 * 2**20:
                for pid in _rsync_senders(server.port):
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
            time.sleep(0.02)

    dropper = threading.Thread(target=drop_once)
    dropper.start()
    with caplog.at_level(logging.WARNING, logger="moetune.lane.providers.ssh"):
        t.copy_out("big.bin", local)
    dropper.join()
    assert killed, "the connection was never dropped"
    assert "Retry 1/" in caplog.text
    assert staged_at_start[0] == 0 and staged_at_start[1] > 10 * 2**20  # resumed, not restarted
    assert sha256(local) == sha256(big)
    assert not staging_path(local).exists()


# -- the provider --------------------------------------------------------------------------


def test_create_is_idempotent_and_list_status_follow_dirs(provider: SshProvider) -> None:
    assert provider.list() == []  # base dir not there yet
    pod = provider.create(PodSpec(name="moetune-run1-a"))
    assert pod.status == "running" and pod.ssh == provider.target
    assert Path(pod.workdir).is_absolute() and Path(pod.workdir).is_dir()
    (Path(pod.workdir) / "user-data").write_text("keep")
    assert provider.create(PodSpec(name="moetune-run1-a")) == pod
    assert (Path(pod.workdir) / "user-data").read_text() == "keep"
    provider.create(PodSpec(name="moetune-run2-b"))
    assert sorted(p.id for p in provider.list()) == ["moetune-run1-a", "moetune-run2-b"]
    assert provider.wait_ready("moetune-run1-a", 10) == pod
    assert provider.status("moetune-run1-a") == pod
    with pytest.raises(PodGone):
        provider.status("never-made")
    with pytest.raises(LaneError, match="safe directory name"):
        provider.create(PodSpec(name="../escape"))
    assert provider.exec(pod.id, "cat user-data").stdout == "keep"


def test_wait_ready_times_out_with_lane_error(server: Sshd, tmp_path: Path) -> None:
    nobody = SshProvider(SshTarget("127.0.0.1", free_port()), server.identity, tmp_path / "kh")
    start = time.monotonic()
    with pytest.raises(LaneError, match="did not accept SSH within") as err:
        nobody.wait_ready("pod", 1.5)
    assert not isinstance(err.value, TransientError)
    assert time.monotonic() - start < 10


def test_env_reaches_commands_and_jobs_through_stdin_never_argv(
    provider: SshProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A secret given as `env` is in the command's environment, and in no argv ssh runs."""
    secret = "hf_" + "s3cr3t" * 6
    argvs: list[list[str]] = []
    real = SshTransport._call

    def spy(self: SshTransport, argv: list[str], *args: object, **kw: object) -> object:
        argvs.append(argv)
        return real(self, argv, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(SshTransport, "_call", spy)
    pod = provider.create(PodSpec(name="env"))
    env = {"HF_TOKEN": secret, "ODD": 'it\'s "quoted" $HOME'}
    got = provider.exec(pod.id, 'printf "%s|%s" "$HF_TOKEN" "$ODD"', 30, env=env)
    assert got.stdout == f'{secret}|it\'s "quoted" $HOME'
    provider.exec_background(pod.id, 'printf %s "$HF_TOKEN" > seen', "job.log", env=env)
    assert wait_for(lambda: provider.poll_background(pod.id, "job.log")) == 0
    assert (Path(pod.workdir) / "seen").read_text() == secret
    assert argvs and not any(secret in " ".join(a) for a in argvs)


def test_background_job_outlives_its_session_and_reports_rc(provider: SshProvider) -> None:
    pod = provider.create(PodSpec(name="bg"))
    job = "until [ -e go ]; do sleep 0.05; done; echo done; exit 3"
    provider.exec_background(pod.id, job, "logs/stage.log")
    assert provider.poll_background(pod.id, "logs/stage.log") is None  # its ssh call has ended
    (Path(pod.workdir) / "go").touch()
    assert wait_for(lambda: provider.poll_background(pod.id, "logs/stage.log")) == 3
    assert (Path(pod.workdir) / "logs" / "stage.log").read_text() == "done\n"
    assert (Path(pod.workdir) / "logs" / "stage.log.rc").read_text().strip() == "3"
    assert provider.poll_background(pod.id, "never.log") == -1  # never started: no rc


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    state = (
        Path(f"/proc/{pgid}/stat").read_text().split()[2] if Path(f"/proc/{pgid}").exists() else "X"
    )
    return state != "Z"


def test_terminate_kills_jobs_keeps_files_and_is_idempotent(provider: SshProvider) -> None:
    pod = provider.create(PodSpec(name="victim"))
    provider.exec_background(pod.id, "sleep 1000 & sleep 1000; wait", "train.log")
    pgid = int((Path(pod.workdir) / ".moetune" / "jobs" / "train.log.pid").read_text())
    assert _group_alive(pgid) and provider.poll_background(pod.id, "train.log") is None
    provider.terminate(pod.id)
    assert not _group_alive(pgid)
    assert provider.poll_background(pod.id, "train.log") == VANISHED_RC
    assert Path(pod.workdir).is_dir()  # the user's files stay
    provider.terminate(pod.id)  # already terminated: success
    provider.terminate("never-made")


def test_self_terminate_command_ends_sibling_jobs(provider: SshProvider) -> None:
    pod = provider.create(PodSpec(name="deadman"))
    provider.exec_background(pod.id, "sleep 1000", "train.log")
    switch = f"sleep 0.3; {provider.self_terminate_command(pod.id)}"
    provider.exec_background(pod.id, switch, "watchdog.log")
    assert wait_for(lambda: provider.poll_background(pod.id, "train.log")) == VANISHED_RC
    assert wait_for(lambda: provider.poll_background(pod.id, "watchdog.log")) == 0


def test_relative_workdir_lives_under_home(server: Sshd, tmp_path: Path) -> None:
    name = f"moetune-test-{uuid.uuid4().hex[:8]}"
    home = Path(pwd.getpwnam(server.target.user).pw_dir)
    provider = SshProvider(server.target, server.identity, tmp_path / "kh", f"{name}/runs")
    try:
        pod = provider.create(PodSpec(name="rel"))
        assert pod.workdir == str(home / name / "runs" / "rel")
        (tmp_path / "f.txt").write_text("x")
        provider.copy_in("rel", tmp_path / "f.txt", "in/f.txt")
        provider.copy_out("rel", "in", tmp_path / "out")
        assert (tmp_path / "out" / "f.txt").read_text() == "x"
        provider.exec_background("rel", "sleep 1000", "job.log")
        provider.exec("rel", provider.self_terminate_command("rel"))  # "$HOME"-based path
        assert provider.poll_background("rel", "job.log") == VANISHED_RC
        assert [p.workdir for p in provider.list()] == [pod.workdir]
    finally:
        shutil.rmtree(home / name, ignore_errors=True)


def test_registered_and_built_from_config(server: Sshd, tmp_path: Path) -> None:
    assert PROVIDERS.get("ssh") is SshProvider
    ssh = {"host": "127.0.0.1", "port": server.port, "identity": str(server.identity)}
    lane = LaneArgs(provider="ssh", workdir=str(tmp_path / "runs"), ssh=ssh)  # type: ignore[arg-type]
    built = SshProvider.from_config(lane, tmp_path / "state")
    assert built.base.known_hosts == tmp_path / "state" / "known_hosts"
    assert built.create(PodSpec(name="cfg")).workdir == str(tmp_path / "runs" / "cfg")
    with pytest.raises(LaneError, match=r"lane\.ssh\.host"):
        SshProvider.from_config(LaneArgs(provider="ssh"), tmp_path / "state")
