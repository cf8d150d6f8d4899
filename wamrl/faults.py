"""Named points where the fault-injection suite (tests/faults/) kills a stage with SIGKILL.

WAMRL_FAULT=POINT or STAGE:POINT (e.g. `reward:moved_aside`) kills the process the first
time it reaches POINT (in STAGE, as wamrl.cli.run_stage names it). Unset, a point is one
dictionary lookup. The points:

    start        a stage began (its leftovers settled, no work done)
    temp         an artifact's temporary was just created (atomic.make_temp_dir)
    filled       an artifact's temporary is complete, not yet renamed into place
    moved_aside  replace_dir moved the old version aside, the new one not yet in place
    episode      a rollout or eval episode finished (and, in a rollout, was written)
    reward_group one shard's reward/ group was published, the other shards not yet
"""

from __future__ import annotations

import os
import signal

ENV = "WAMRL_FAULT"
STAGE: str | None = None  # set by wamrl.cli.run_stage


def point(name: str) -> None:
    want = os.environ.get(ENV)
    if want and want in (name, f"{STAGE}:{name}"):
        os.kill(os.getpid(), signal.SIGKILL)
