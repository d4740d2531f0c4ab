"""A real OpenSSH server on loopback for the ssh provider's tests.

Each `Sshd` owns a temp dir with its config, host key, client key and log. It runs
`/usr/sbin/sshd -D -e` as a child (root login by key only), so tests exercise the same
transport a remote box would – host-key pinning, auth, drops – without the network.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from moetune.lane.providers.base import SshTarget

SSHD = Path("/usr/sbin/sshd")
SFTP_SERVERS = (Path("/usr/lib/openssh/sftp-server"), Path("/usr/libexec/sftp-server"))
SKIP_REASON = "needs /usr/sbin/sshd (apt-get install openssh-server) and root (it logs in as root)"


def have_sshd() -> bool:
    return SSHD.exists() and os.geteuid() == 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def keygen(path: Path) -> Path:
    """A fresh ed25519 key pair at `path` / `path.pub` (no passphrase)."""
    path.unlink(missing_ok=True)
    Path(f"{path}.pub").unlink(missing_ok=True)
    cmd = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "moetune-test", "-f", str(path)]
    subprocess.run(cmd, check=True, capture_output=True)
    return path


@dataclass
class Sshd:
    """One sshd on 127.0.0.1:`port` accepting `identity` for root."""

    root: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def identity(self) -> Path:
        return self.root / "client_ed25519"

    @property
    def target(self) -> SshTarget:
        return SshTarget(host="127.0.0.1", port=self.port, user="root")

    def prepare(self) -> None:
        """Client key, authorised keys and a first host key."""
        self.root.mkdir(parents=True, exist_ok=True)
        keygen(self.identity)
        pub = Path(f"{self.identity}.pub").read_text()
        (self.root / "authorized_keys").write_text(pub)
        keygen(self.root / "host_ed25519")

    def config(self) -> str:
        sftp = next((p for p in SFTP_SERVERS if p.exists()), SFTP_SERVERS[0])
        return (
            f"Port {self.port}\nListenAddress 127.0.0.1\n"
            f"HostKey {self.root / 'host_ed25519'}\nPidFile {self.root / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {self.root / 'authorized_keys'}\n"
            "StrictModes no\nUsePAM no\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            f"Subsystem sftp {sftp}\nLogLevel INFO\n"
        )

    def start(self) -> None:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # privilege separation dir
        conf = self.root / "sshd_config"
        conf.write_text(self.config())
        log = (self.root / "sshd.log").open("ab")
        cmd = [str(SSHD), "-D", "-e", "-f", str(conf)]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        self._wait_listening()

    def _wait_listening(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd did not listen on {self.port} within {timeout_s}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        self.proc = None

    def restart_with_new_host_key(self) -> None:
        """Same port, new identity: what a man-in-the-middle (or a rebuilt box) looks like."""
        self.stop()
        keygen(self.root / "host_ed25519")
        self.start()


def start_sshd(root: Path) -> Sshd:
    server = Sshd(root)
    server.prepare()
    server.start()
    return server
