"""The launcher's output, passed through as it comes – but a Python traceback is held until
its last line says whose it is. torchrun's own rendezvous failure (node 0 waited its
timeout and the other nodes never came) is held back: moetune says it in one line
(nodes.never_met), and prints the held trace only when that line does not apply. Every
other traceback – a rank's error, which the launch failure points at – is printed whole.
"""

from __future__ import annotations

import os
import threading
from typing import BinaryIO

TRACEBACK = b"Traceback (most recent call last):"
# a trace block goes on while its lines are indented, or chain two exceptions
_CHAINED = (b"During handling of the above exception", b"The above exception was the direct")
# the last line of torchrun's static rendezvous timing out on node 0
RENDEZVOUS = (b"DistStoreError: Timed out after", b"RendezvousTimeoutError")


class LauncherOutput:
    """Copies a pipe (the launcher's stdout and stderr) to `out` on a thread."""

    def __init__(self, out: BinaryIO) -> None:
        self.out, self.fd = out, -1
        self.block: list[bytes] | None = None  # the traceback being read, if any
        self.held: list[bytes] = []  # rendezvous traces, printed only if asked (finish)
        self.thread = threading.Thread(target=self._copy, daemon=True)

    def start(self, fd: int) -> None:
        """Read `fd` (this object then owns it) until the launcher closes it."""
        self.fd = fd
        self.thread.start()

    def finish(self, rendezvous_said: bool) -> None:
        """After the launcher exited: the rest of its output; the held trace unless
        moetune's own line says what it said."""
        if self.fd >= 0:  # started: the launcher's exit closed the pipe (its group killed)
            self.thread.join()
        if self.block:
            self._write(b"".join(self.block))
        if not rendezvous_said and self.held:
            self._write(b"".join(self.held))

    def _copy(self) -> None:
        partial = b""
        while chunk := os.read(self.fd, 1 << 16):
            lines = (partial + chunk).split(b"\n")
            partial = lines.pop()
            for line in lines:
                self._line(line + b"\n")
            if partial and self.block is None and not TRACEBACK.startswith(partial[:40]):
                self._write(partial)  # a progress bar redrawn with \r: shown as it comes
                partial = b""
        os.close(self.fd)
        if partial:
            self._line(partial)

    def _line(self, line: bytes) -> None:
        if self.block is None:
            if not line.startswith(TRACEBACK):
                self._write(line)
                return
            self.block = []
        self.block.append(line)
        if line[:1] in (b" ", b"\t") or line.startswith((TRACEBACK, *_CHAINED)) or not line.strip():
            return
        block, self.block = b"".join(self.block), None  # its last line: the exception
        if any(mark in line for mark in RENDEZVOUS):
            self.held.append(block)
        else:
            self._write(block)

    def _write(self, data: bytes) -> None:
        self.out.write(data)
        self.out.flush()
