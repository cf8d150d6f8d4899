"""Named points where the fault-injection suite (tests/faults/) breaks a stage.

WAMRL_FAULT=[STAGE:]POINT[:MODE] acts the first time the process reaches POINT (in STAGE, as
stages.cli.run_stage names it). MODE kill (the default) sends SIGKILL to the process itself;
enospc and erofs raise the OSError a full or read-only disk would. Unset, a point costs one
dictionary lookup. The points:

    start        a stage began (its leftovers settled, no work done)
    temp         an artifact's temporary directory was just created (atomic.make_temp_dir)
    filled       an artifact's temporary directory is complete, not yet renamed into place
    text         a text file's temporary is written, not yet renamed (atomic.write_text)
    moved_aside  replace_dir moved the old version aside, the new one not yet in place
    episode      a rollout or eval episode finished (and, in a rollout, was written)
    reward_group one shard's reward/ group was published, the other shards not yet
"""

from __future__ import annotations

import errno
import os
import signal

ENV = "WAMRL_FAULT"
STAGE: str | None = None  # set by stages.cli.run_stage
_ERRORS = {"enospc": errno.ENOSPC, "erofs": errno.EROFS}


def point(name: str) -> None:
    want = os.environ.get(ENV)
    if not want:
        return
    where, _, mode = want.rpartition(":") if want.endswith(tuple(_ERRORS)) else (want, "", "")
    if where not in (name, f"{STAGE}:{name}"):
        return
    if mode:
        code = _ERRORS[mode]
        raise OSError(code, f"{os.strerror(code)} (injected by {ENV}={want})")
    os.kill(os.getpid(), signal.SIGKILL)
