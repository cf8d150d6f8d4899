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

# task indices (wamrl.envs.tasks) whose expert succeeds on most init states (bench_experts.py)
SUPPORTED: set[int] = set(range(40))


def make_expert(task: Any) -> Expert:
    if task.index not in SUPPORTED:
        raise NotImplementedError(f"no scripted expert for task {task.index} {task.name!r}")
    return Expert(task)


__all__ = ["SUPPORTED", "Expert", "make_expert"]
