"""No orphans: every process of a `train --nproc` launch dies with moetune's launcher,
whatever kills it (kill -9 included). Linux's PR_SET_PDEATHSIG makes the kernel SIGKILL a
process the moment its parent dies; it is set in the accelerate launcher (moetune's
child) and in every rank (the launcher's child) as the first thing the rank runs – in
`python -m moetune`, before the CLI's imports, which take seconds – so the chain breaks
nowhere. Light on purpose: only the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal

LAUNCHED_ENV = "MOETUNE_LAUNCHED"  # the launcher's pid, for the ranks: they print nothing
PR_SET_PDEATHSIG = 1
ORPHANED_EXIT = 128 + signal.SIGKILL  # a rank whose launcher was gone before it started


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux; elsewhere nothing happens)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def die_with_launcher() -> None:
    """In a rank of a `--nproc` launch (LAUNCHED_ENV set): die with its parent, and at
    once if moetune's launcher is gone already – it may have died before the prctl."""
    launcher = int(os.environ.get(LAUNCHED_ENV, "0") or 0)
    if launcher <= 1:
        return
    die_with_parent()
    if not alive(launcher):
        os._exit(ORPHANED_EXIT)


def alive(pid: int) -> bool:
    """Whether process `pid` exists (a pid now someone else's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
