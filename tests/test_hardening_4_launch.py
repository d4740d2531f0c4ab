"""Issue 48 (fourth hardening pass): node 0's rendezvous timeout printed accelerate's
launcher traceback (torchrun's DistStoreError) before moetune's one line. The launcher's
output now goes through LauncherOutput: that trace is held back when moetune's line says
it, while a rank's own traceback and a progress bar redrawn in place pass as they come."""

from __future__ import annotations

import io
import os

import pytest

from moetune.train.distributed.launcher_output import LauncherOutput

RANK_TRACE = (
    b"Traceback (most recent call last):\n"
    b'  File "train.py", line 3, in <module>\n'
    b"ValueError: a rank's own error\n"
)
RDZV_TRACE = (
    b"Traceback (most recent call last):\n"
    b'  File "torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py", line 67\n'
    b"    self._store = TCPStore(\n"
    b"\n"
    b"torch.distributed.DistStoreError: Timed out after 3 seconds waiting for clients. "
    b"1/2 clients joined.\n"
)


def _through(chunks: list[bytes], rendezvous_said: bool) -> bytes:
    out = io.BytesIO()
    read, write = os.pipe()
    output = LauncherOutput(out)
    output.start(read)
    for chunk in chunks:
        os.write(write, chunk)
    os.close(write)
    output.finish(rendezvous_said=rendezvous_said)
    return out.getvalue()


@pytest.mark.parametrize("said", [True, False])
def test_the_launchers_rendezvous_trace_is_held_for_moetunes_line(said: bool) -> None:
    shown = _through([b"node 0 of 2: waiting up to 2 s\n", RDZV_TRACE[:50], RDZV_TRACE[50:]], said)
    assert shown.startswith(b"node 0 of 2: waiting up to 2 s\n")
    assert (b"Traceback" in shown) is not said  # printed only when moetune's line does not apply
    assert shown.endswith(b"" if said else b"1/2 clients joined.\n")


def test_a_ranks_trace_and_a_redrawn_bar_pass_through_whole() -> None:
    bar = b"step 1/4\rstep 2/4\r"
    shown = _through([bar, b"loss 1.0\n", RANK_TRACE, b"after\n"], rendezvous_said=True)
    assert shown == bar + b"loss 1.0\n" + RANK_TRACE + b"after\n"
