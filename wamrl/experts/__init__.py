"""Scripted experts for the 40 LIBERO tasks, planned from privileged simulator state.

from wamrl.experts import make_expert, SUPPORTED
expert = make_expert(task)      # raises NotImplementedError for a task without one
env.reset(init_state); expert.reset(env)
while not (success or expert.done or out of budget):
    success = env.step(expert.act(env))
"""

from __future__ import annotations

from typing import Any

from wamrl.experts.plan import Expert

# Task indices (wamrl.envs.tasks) whose expert succeeded on most of init states 0-2 in
# bench/bench_experts.py. Left out: 23 (bowl into the opened top drawer: not "In" after the
# drop), 25 (plate: the rim pinch misses), 33 (bottom drawer does not close all the way),
# 38 (moka pots: grasp misses / slips), 39 (mug into the microwave: blocked from above).
UNSUPPORTED: frozenset[int] = frozenset({23, 25, 33, 38, 39})
SUPPORTED: set[int] = set(range(40)) - UNSUPPORTED


def make_expert(task: Any) -> Expert:
    if task.index not in SUPPORTED:
        raise NotImplementedError(f"no scripted expert for task {task.index} {task.name!r}")
    return Expert(task)


__all__ = ["SUPPORTED", "UNSUPPORTED", "Expert", "make_expert"]
