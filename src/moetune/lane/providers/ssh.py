"""Provider `ssh`: a plain SSH box, where a pod is the directory `<base_workdir>/<name>`.

`SshTransport` is the OpenSSH plumbing – commands, resumable and verified copies, detached
jobs – kept free of config objects so the runpod provider drives a pod's public IP:port
with the same code.

Every connection pins the host key in a per-run known_hosts file on first use
(`StrictHostKeyChecking=accept-new`); a key that changes afterwards is refused, never
re-learned. The host needs bash, GNU coreutils >= 8.30 (`sha256sum -z`) and util-linux
`setsid`; rsync is used when both ends have it, scp otherwise.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from moetune.io import file_digests
from moetune.lane.hosts import check_node_hosts, check_target, node_targets, shown
from moetune.lane.providers.base import (
    Env,
    ExecResult,
    LaneError,
    Pod,
    PodGone,
    PodSpec,
    Provider,
    SshTarget,
    TransientError,
    register_provider,
)

if TYPE_CHECKING:
    from moetune.config import LaneArgs, RunConfig

log = logging.getLogger(__name__)
T = TypeVar("T")
q = shlex.quote

SSH_RC_TRANSPORT = 255  # ssh's own failure; a remote command's codes pass through unchanged
# rsync: 10 socket I/O, 12 protocol stream (peer died), 30 I/O timeout, 35 daemon timeout;
# 255: ssh itself failed (rsync and scp pass it through)
TRANSFER_RC_TRANSIENT = frozenset({10, 12, 30, 35, 255})
SCP_DROP_MARKERS = ("Connection closed", "lost connection", "Connection reset", "Broken pipe")
HOST_KEY_CHANGED = ("REMOTE HOST IDENTIFICATION HAS CHANGED", "Host key verification failed")
AUTH_REFUSED = re.compile(r"Permission denied \([a-z-]+[,)]")  # not "(13)": that is a file
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
JOBS_DIR = ".moetune/jobs"  # per pod: <log key>.pid while a detached job runs, then .ended
VANISHED_RC = -1  # poll_background: the job died without writing its exit code

# True when process group $1 still has a live (non-zombie) leader; orphans of a dropped
# session may never be reaped in containers whose init does not wait for them.
ALIVE_FN = (
    'alive() { kill -0 -- "-$1" 2>/dev/null && '
    '[ "$(cut -d" " -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }'
)


def staging_path(local: Path) -> Path:
    """Where `copy_out(…, local)` collects files until they are verified (kept for resume)."""
    return local.parent / f".{local.name}.moetune-partial"


def kill_jobs_script(workdir: str) -> str:
    """Bash that ends every detached job recorded under `workdir` (TERM, then KILL after 5 s);
    it spares its own process group, so a job may run it to end its siblings."""
    where = q(workdir) if workdir.startswith("/") else f'"$HOME"/{q(workdir)}'  # any cwd
    return f"""cd -- {where} 2>/dev/null || exit 0
shopt -s nullglob
{ALIVE_FN}
me=$(cut -d" " -f5 /proc/$$/stat 2>/dev/null)
groups=()
for f in {JOBS_DIR}/*.pid; do
  g=$(cat "$f"); [ -n "$g" ] && [ "$g" != "$me" ] || continue
  kill -TERM -- "-$g" 2>/dev/null; groups+=("$g")
done
for _ in $(seq 50); do
  live=0; for g in "${{groups[@]}}"; do alive "$g" && live=1; done
  [ "$live" = 0 ] && break; sleep 0.1
done
for g in "${{groups[@]}}"; do kill -KILL -- "-$g" 2>/dev/null; done
for f in {JOBS_DIR}/*.pid; do
  [ "$(cat "$f")" = "$me" ] || mv -f "$f" "${{f%.pid}}.ended" 2>/dev/null
done
true
"""


def _tail(text: str, lines: int = 3) -> str:
    return " | ".join(text.strip().splitlines()[-lines:]) or "no output"


class SshTransport:
    """Commands and copies on one host, relative to `workdir` (relative: under home)."""

    def __init__(
        self, target: SshTarget, identity: Path | None, known_hosts: Path, workdir: str
    ) -> None:
        check_target(target, "ssh target")  # runpod's pods come here too, not via _target
        self.target = target
        self.identity = identity
        self.known_hosts = known_hosts
        known_hosts.parent.mkdir(parents=True, exist_ok=True)  # else ssh cannot pin the key
        self.workdir = workdir
        self.retry_delays: tuple[float, ...] = (2.0, 5.0, 15.0)  # copies: after each drop
        self.rsync_args: tuple[str, ...] = ()  # extra rsync flags, e.g. "--bwlimit=20m"
        self.prefer_rsync = True
        self._workdir_made = False
        self._remote_rsync: bool | None = None

    @property
    def where(self) -> str:
        return shown(self.target)

    def ssh_options(self) -> list[str]:
        """Options shared by ssh, scp and rsync's ssh (the port flag differs, so not here)."""
        opts = {
            "BatchMode": "yes",  # never prompt: a prompt would hang an unattended lane
            "UserKnownHostsFile": str(self.known_hosts),
            "StrictHostKeyChecking": "accept-new",
            "ConnectTimeout": "10",
            "ServerAliveInterval": "15",
            "ServerAliveCountMax": "4",
            "LogLevel": "ERROR",  # keeps "Permanently added …" out of a command's stderr
        }
        if self.identity is not None:
            opts["IdentitiesOnly"] = "yes"
        args = [a for k, v in opts.items() for a in ("-o", f"{k}={v}")]
        return args + (["-i", str(self.identity)] if self.identity is not None else [])

    def ssh_argv(self) -> list[str]:
        login = f"{self.target.user}@{self.target.host}"
        # "--": nothing after it is an option, whatever a name holds (check_target too)
        return ["ssh", *self.ssh_options(), "-p", str(self.target.port), "--", login]

    def _spec(self, path: str) -> str:
        host = f"[{self.target.host}]" if ":" in self.target.host else self.target.host
        return f"{self.target.user}@{host}:{path}"  # rsync/scp want IPv6 literals bracketed

    def remote_path(self, remote: str) -> str:
        """Absolute stays; relative is under the workdir (itself relative to home)."""
        return posixpath.normpath(posixpath.join(self.workdir, remote))

    # -- commands --------------------------------------------------------------------------

    def _call(
        self, argv: list[str], what: str, timeout_s: float | None, stdin: bytes = b""
    ) -> tuple[int, bytes, str]:
        try:
            done = subprocess.run(argv, capture_output=True, input=stdin, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            cause = f"{what} on {self.where} timed out after {timeout_s:g}s."
            raise TransientError(cause, "retry; raise the timeout if the work is slow") from None
        except FileNotFoundError:
            cause = f"{argv[0]} is not installed on this machine."
            raise LaneError(cause, "install the OpenSSH client (and rsync).") from None
        return done.returncode, done.stdout, done.stderr.decode(errors="replace")

    def _transport_error(self, what: str, stderr: str) -> LaneError:
        """The error for a failed connection: a changed host key is never retryable."""
        if any(marker in stderr for marker in HOST_KEY_CHANGED):
            host, port = self.target.host, self.target.port
            cause = f"host key of {host}:{port} changed since this run pinned it (refused)."
            entry = host if port == 22 else f"[{host}]:{port}"
            fix = (
                f"if the host was rebuilt on purpose, run `ssh-keygen -R '{entry}' -f"
                f" {self.known_hosts}` and retry; otherwise do not connect – it may be intercepted."
            )
            return LaneError(cause, fix)
        if AUTH_REFUSED.search(stderr):
            cause = f"{what}: {self.where} refused the login ({_tail(stderr, 1)})."
            return LaneError(cause, "check lane.ssh.user / lane.ssh.identity and the host's keys")
        cause = f"{what}: connection to {self.where} failed ({_tail(stderr)})."
        return TransientError(cause, "retry; check the host is up and reachable")

    def _ssh(
        self, script: str, what: str, timeout_s: float | None, env: Env | None = None
    ) -> tuple[int, bytes, str]:
        """Run a bash script from the login's home; transport failures raise. `env` goes
        over stdin as `export` lines the shell sources first: never in argv or a file."""
        exports = "".join(f"export {k}={q(v)}\n" for k, v in (env or {}).items())
        head = ". /dev/stdin\n" if exports else ""
        argv = [*self.ssh_argv(), f"bash -lc {q(head + script)}"]
        rc, out, err = self._call(argv, what, timeout_s, exports.encode())
        if rc == SSH_RC_TRANSPORT:
            raise self._transport_error(what, err)
        return rc, out, err

    def run(
        self, script: str, timeout_s: float | None = None, env: Env | None = None
    ) -> ExecResult:
        """A bash script run from home (not the workdir); rc 255 raises as a transport fault."""
        rc, out, err = self._ssh(script, "ssh", timeout_s, env)
        return ExecResult(rc, out.decode(errors="replace"), err)

    def exec(
        self, command: str, timeout_s: float | None = None, env: Env | None = None
    ) -> ExecResult:
        """`command` under `bash -lc` in the workdir (created on first use), with `env`."""
        wd = q(self.workdir)
        prefix = "" if self._workdir_made else f"mkdir -p -- {wd} && "
        result = self.run(f"{prefix}cd -- {wd} || exit 1\n{command}", timeout_s, env)
        self._workdir_made = True
        return result

    # -- detached jobs ---------------------------------------------------------------------

    def _job_files(self, log_name: str) -> tuple[str, str, str]:
        """(pid file, ended marker, rc file) of the job logging to `log_name`."""
        parts = log_name.split("/")
        if log_name.startswith("/") or not log_name or {"", ".", ".."} & set(parts):
            raise LaneError(
                f"log name {log_name!r} is not a plain relative path.", "use e.g. train.log"
            )
        key = "__".join(parts)
        return f"{JOBS_DIR}/{key}.pid", f"{JOBS_DIR}/{key}.ended", f"{log_name}.rc"

    def exec_background(self, command: str, log_name: str, env: Env | None = None) -> None:
        """Start `command` detached (`nohup setsid`) in the workdir so an SSH drop does not
        kill it; output appends to `log_name`, the exit code lands in `<log_name>.rc`."""
        pid, ended, rc = (q(p) for p in self._job_files(log_name))
        inner = (
            f"echo $$ > {pid}\n(\n{command}\n)\nrc=$?\n"
            f"echo $rc > {rc}.tmp && mv -f {rc}.tmp {rc}\nmv -f {pid} {ended}\n"
        )
        logdir = q(posixpath.dirname(log_name) or ".")
        script = (
            f'{ALIVE_FN}\n[ -f {pid} ] && alive "$(cat {pid})" && '
            "echo 'already running' >&2 && exit 1\n"
            f"mkdir -p {JOBS_DIR} {logdir} && rm -f -- {rc} {pid} {ended} || exit 1\n"
            f"nohup setsid bash -lc {q(inner)} >> {q(log_name)} 2>&1 < /dev/null &\n"
            f"for _ in $(seq 200); do [ -s {pid} ] || [ -e {ended} ] && exit 0; sleep 0.05; done\n"
            "echo 'the job did not start' >&2; exit 1"
        )
        result = self.exec(script, timeout_s=60, env=env)
        if result.rc != 0:
            cause = f"could not start {log_name} on {self.where}: {_tail(result.stderr)}."
            raise LaneError(cause, "check that bash, nohup and setsid exist on the host")

    def poll_background(self, log_name: str) -> int | None:
        """None while the job runs, else its exit code (VANISHED_RC when it was killed)."""
        pid, ended, rc = (q(p) for p in self._job_files(log_name))
        # rc is checked again after the liveness test: the job may finish in between
        script = (
            f"{ALIVE_FN}\nif [ -f {rc} ]; then cat {rc}\n"
            f'elif [ -f {pid} ] && alive "$(cat {pid})"; then echo running\n'
            f"elif [ -f {rc} ]; then cat {rc}\n"
            f"elif [ -e {pid} ] || [ -e {ended} ]; then echo vanished\nelse echo unknown; fi"
        )
        lines = self.exec(script, timeout_s=60).stdout.split()
        answer = lines[-1] if lines else "unknown"  # last line: a noisy login may print first
        if answer == "running":
            return None
        # never started reads like killed: the caller (re)starts it either way
        return VANISHED_RC if answer in ("vanished", "unknown") else int(answer)

    def kill_background(self) -> None:
        """End every detached job of this workdir; idempotent (none left is success)."""
        result = self.run(kill_jobs_script(self.workdir), timeout_s=60)
        if result.rc != 0:
            where = f"{self.workdir} on {self.where}"
            cause = f"could not stop the jobs in {where}: {_tail(result.stderr)}."
            raise LaneError(cause, "log in and kill them by hand")

    # -- copies ----------------------------------------------------------------------------

    def _retrying(self, fn: Callable[[], T]) -> T:
        """`fn()`, retried after each TransientError with the backoff in `retry_delays`."""
        for attempt, delay in enumerate(self.retry_delays, start=1):
            try:
                return fn()
            except TransientError as err:
                n = len(self.retry_delays)
                log.warning("%s Retry %d/%d in %gs.", err.cause, attempt, n, delay)
                time.sleep(delay)
        return fn()

    def _use_rsync(self) -> bool:
        if not self.prefer_rsync or shutil.which("rsync") is None:
            return False
        if self._remote_rsync is None:
            self._remote_rsync = self.run("command -v rsync >/dev/null", 60).rc == 0
        return self._remote_rsync

    def _rsync_argv(self, *paths: str, extra: tuple[str, ...] = ()) -> list[str]:
        rsh = shlex.join(["ssh", *self.ssh_options(), "-p", str(self.target.port)])
        # -s: file names travel inside the rsync protocol, never through the remote shell
        flags = ["-a", "-s", "--partial", "--timeout=120", *self.rsync_args, *extra]
        return ["rsync", *flags, "-e", rsh, "--", *paths]

    def _scp_argv(self, *paths: str) -> list[str]:
        port = str(self.target.port)
        return ["scp", "-r", "-p", "-q", *self.ssh_options(), "-P", port, "--", *paths]

    def _transfer(self, argv: list[str], what: str) -> None:
        rc, _, err = self._call(argv, what, None)
        if rc == 0:
            return
        # rsync's own codes are exact; scp says 1 for everything, so its words must tell
        scp_drop = argv[0] == "scp" and any(m in err for m in SCP_DROP_MARKERS)
        dropped = rc < 0 or rc in TRANSFER_RC_TRANSIENT or scp_drop
        if dropped or any(marker in err for marker in HOST_KEY_CHANGED):
            raise self._transport_error(what, err)
        raise LaneError(f"{what} failed (rc {rc}): {_tail(err)}.", "check the paths and free disk")

    def copy_in(self, local: Path, remote: str) -> None:
        """Copy a local file or directory to `remote`; a directory's contents merge into it."""
        if not local.exists():
            raise LaneError(f"{local} does not exist.", "build it first, or fix the path")
        full = self.remote_path(remote)
        parent = full if local.is_dir() else posixpath.dirname(full) or "."
        made = self._retrying(lambda: self.run(f"mkdir -p -- {q(parent)}", 60))
        if made.rc != 0:
            cause = f"cannot create {parent} on {self.where}: {_tail(made.stderr)}."
            raise LaneError(cause, "check the path, the host's disk and permissions")
        if self._use_rsync():
            src = f"{local}/" if local.is_dir() else str(local)
            argv = self._rsync_argv(src, self._spec(full + ("/" if local.is_dir() else "")))
        elif local.is_dir():
            entries = sorted(str(p) for p in local.iterdir())
            if not entries:
                return
            argv = self._scp_argv(*entries, self._spec(full + "/"))
        else:
            argv = self._scp_argv(str(local), self._spec(full))
        self._retrying(lambda: self._transfer(argv, f"copy_in {local.name}"))

    def copy_out(self, remote: str, local: Path) -> None:
        """Copy `remote` to `local`: resumes after drops, then checks every file's sha256
        against the host's before renaming into place, so `local` is absent or complete."""
        full = self.remote_path(remote)
        staging = staging_path(local)
        staging.mkdir(parents=True, exist_ok=True)
        payload = staging / posixpath.basename(full)
        self._retrying(lambda: self._fetch(full, staging))
        expected = self._retrying(lambda: self.remote_digests(full))
        verify_and_prune(payload, expected, f"{self.where}:{full}")
        _install(payload, local)
        shutil.rmtree(staging)

    def _fetch(self, full: str, staging: Path) -> None:
        """One transfer attempt of `full` into `staging/<basename>`; rsync resumes partials."""
        if self._use_rsync():
            argv = self._rsync_argv(self._spec(full), f"{staging}/", extra=("--delete",))
        else:  # scp cannot resume: start the payload afresh
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            argv = self._scp_argv(self._spec(full), f"{staging}/")
        self._transfer(argv, f"copy_out {full}")

    def remote_digests(self, full: str) -> dict[str, str]:
        """{relative path: sha256} of every regular file under `full` ("" when a file)."""
        r = q(full)
        hash_all = "find . -type f -print0 | xargs -0 -r sha256sum -z --"
        script = (
            f"if [ -d {r} ]; then cd -- {r} && {hash_all}\n"
            f"elif [ -f {r} ]; then sha256sum -z < {r}\n"
            f"else echo 'no such file or directory: {full}' >&2; exit 3; fi"
        )
        rc, out, err = self._ssh(script, "sha256", 600)
        if rc != 0:
            cause = f"cannot hash {full} on {self.where} (rc {rc}): {_tail(err)}."
            raise LaneError(cause, "check the path; the host needs GNU coreutils >= 8.30")
        return dict(_parse_digest(entry) for entry in out.split(b"\0") if entry)


def _parse_digest(entry: bytes) -> tuple[str, str]:
    digest, _, name = entry.partition(b" ")
    path = os.fsdecode(name[1:])  # after "<hash> ": " ./a/b" (text mode) or "*./a/b" (binary)
    return ("" if path == "-" else posixpath.normpath(path)), digest.decode()


def verify_and_prune(payload: Path, expected: dict[str, str], source: str) -> None:
    """LaneError unless `payload` holds every expected file with its sha256; mismatched
    files are deleted so the next copy fetches them afresh instead of trusting them."""
    got = file_digests(payload) if payload.exists() else {}
    bad = sorted(name for name, digest in expected.items() if got.get(name) != digest)
    if not bad:
        return
    for name in bad:
        (payload / name if name else payload).unlink(missing_ok=True)
    shown = ", ".join(name or payload.name for name in bad[:3])
    cause = f"copy of {source} failed verification: sha256 mismatch or missing ({shown})."
    fix = "copy it again (the bad files are fetched afresh); if it recurs, check both disks"
    raise LaneError(cause, fix)


def _install(payload: Path, local: Path) -> None:
    """Rename the verified copy onto `local`, moving any older copy aside first."""
    old = Path(tempfile.mkdtemp(dir=local.parent, prefix=f".{local.name}.old-"))
    if local.exists() or local.is_symlink():
        os.replace(local, old / "old")
    os.replace(payload, local)
    shutil.rmtree(old)


@register_provider("ssh")
class SshProvider(Provider):
    """Pods are run directories on one SSH host; terminating one stops its jobs and leaves
    its files (they are the user's)."""

    def __init__(
        self,
        target: SshTarget,
        identity: Path | None,
        known_hosts: Path,
        base_workdir: str = "moetune-runs",
    ) -> None:
        self.target = target
        self.base = SshTransport(target, identity, known_hosts, base_workdir)
        self._pods: dict[str, SshTransport] = {}

    multi_node = True  # one host per node (lane.ssh.hosts)

    @classmethod
    def from_config(cls, lane: LaneArgs, state_dir: Path, rank: int = 0) -> SshProvider:
        """Node `rank`'s host (node 0: lane.ssh.host, else the first of lane.ssh.hosts)."""
        hosts = node_targets(lane.ssh)
        if not hosts:
            cause = "lane.ssh.host is not set; provider ssh needs a host."
            raise LaneError(cause, "set lane.ssh.host (and port, user, identity) in the config")
        identity = Path(lane.ssh.identity).expanduser() if lane.ssh.identity else None
        if identity is not None and not identity.is_file():
            raise LaneError(
                f"lane.ssh.identity {identity} is not a file.", "point it at a private key"
            )
        state_dir.mkdir(parents=True, exist_ok=True)
        known = state_dir / ("known_hosts" if rank == 0 else f"known_hosts.n{rank}")
        return cls(hosts[rank], identity, known, lane.workdir)

    @classmethod
    def check_nodes(cls, cfg: RunConfig) -> None:
        check_node_hosts(cfg)

    @classmethod
    def node_hosts(cls, cfg: RunConfig) -> list[str]:
        targets = node_targets(cfg.lane.ssh)[: cfg.train.nnodes]
        return [shown(t) for t in targets]

    @classmethod
    def node_command(cls, cfg: RunConfig, command: str, rank: int) -> str:
        """Node 0's address is train.master_addr, else its host as lane.ssh.hosts names it
        (the nodes must reach it there)."""
        master = cfg.train.master_addr or node_targets(cfg.lane.ssh)[0].host
        t = cfg.train.model_copy(update={"master_addr": master})
        return super().node_command(cfg.model_copy(update={"train": t}), command, rank)

    def workers(self, cfg: RunConfig, state_dir: Path) -> list[Provider]:
        n = cfg.train.nnodes
        return [self.from_config(cfg.lane, state_dir, rank) for rank in range(1, n)]

    def transport(self, pod_id: str) -> SshTransport:
        """The transport whose workdir is this pod's run directory."""
        if not SAFE_NAME.fullmatch(pod_id):
            cause = f"pod name {pod_id!r} is not a safe directory name."
            raise LaneError(cause, "use letters, digits, '.', '_' and '-' only")
        if pod_id not in self._pods:
            b = self.base
            pod_dir = posixpath.join(b.workdir, pod_id)
            self._pods[pod_id] = SshTransport(b.target, b.identity, b.known_hosts, pod_dir)
        return self._pods[pod_id]

    def _pod(self, pod_id: str, workdir: str) -> Pod:
        return Pod(id=pod_id, name=pod_id, status="running", ssh=self.target, workdir=workdir)

    def create(self, spec: PodSpec) -> Pod:
        wd = q(self.transport(spec.name).workdir)
        result = self.base.run(f"mkdir -p -- {wd}/{JOBS_DIR} && cd -- {wd} && pwd", 60)
        if result.rc != 0:
            cause = f"cannot create {wd} on {self.base.where}: {_tail(result.stderr)}."
            raise LaneError(cause, "check lane.workdir and the host's disk and permissions")
        return self._pod(spec.name, result.stdout.strip())

    def status(self, pod_id: str, timeout_s: float | None = 60) -> Pod:
        wd = q(self.transport(pod_id).workdir)
        result = self.base.run(f"cd -- {wd} 2>/dev/null && pwd", timeout_s)
        if result.rc != 0:
            raise PodGone(f"pod {pod_id} has no directory on {self.base.where}.", "create it")
        return self._pod(pod_id, result.stdout.strip())

    def wait_ready(self, pod_id: str, timeout_s: float) -> Pod:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return self.status(pod_id, max(5.0, deadline - time.monotonic()))
            except TransientError as err:
                if time.monotonic() + 1 >= deadline:
                    late = f"did not accept SSH within {timeout_s:g}s ({err.cause})"
                    cause = f"{self.base.where} {late}"
                    raise LaneError(cause, "check the host, port, firewall and sshd") from None
                time.sleep(1.0)

    def exec(
        self, pod_id: str, command: str, timeout_s: float | None = None, env: Env | None = None
    ) -> ExecResult:
        return self.transport(pod_id).exec(command, timeout_s, env)

    def exec_background(
        self, pod_id: str, command: str, log_name: str, env: Env | None = None
    ) -> None:
        self.transport(pod_id).exec_background(command, log_name, env)

    def poll_background(self, pod_id: str, log_name: str) -> int | None:
        return self.transport(pod_id).poll_background(log_name)

    def copy_in(self, pod_id: str, local: Path, remote: str) -> None:
        self.transport(pod_id).copy_in(local, remote)

    def copy_out(self, pod_id: str, remote: str, local: Path) -> None:
        self.transport(pod_id).copy_out(remote, local)

    def terminate(self, pod_id: str) -> None:
        self.transport(pod_id).kill_background()

    def list(self) -> list[Pod]:
        script = (
            f"cd -- {q(self.base.workdir)} 2>/dev/null || exit 0\npwd\nshopt -s nullglob\n"
            "for d in */; do printf '%s\\0' \"${d%/}\"; done"
        )
        head, _, names = self.base.run(script, 60).stdout.partition("\n")
        found = [n for n in names.split("\0") if SAFE_NAME.fullmatch(n)]
        return [self._pod(n, f"{head}/{n}") for n in found]

    def self_terminate_command(self, pod_id: str) -> str:
        return f"bash -c {q(kill_jobs_script(self.transport(pod_id).workdir))}"
