"""How long worker processes live: not past the stage that started them.

Imports nothing heavy: a spawned worker calls die_with_parent first thing, and every second
spent importing (torch takes seconds) is a second in which a killed parent leaves it behind.
"""

from __future__ import annotations

import os
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int) -> None:
    """Make this process receive SIGKILL when its parent dies (Linux; a no-op elsewhere).

    For worker processes (LIBERO envs, ~1-2 GB each; data-parallel ranks): a stage killed
    with -9 gets no chance to stop them, and a scheduler that kills only the stage's pid
    would leave them holding cores and memory. The kernel signals on the exit of the parent
    *thread* that started the child: pools start their workers from the main thread.
    `parent_pid` is the parent as the parent saw itself: if it already died before the
    signal was armed, this process is an orphan and exits now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not fatal: the worker still exits at EOF on its pipe
    if os.getppid() != parent_pid:
        os._exit(1)
