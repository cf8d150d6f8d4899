"""A task's BDDL goal -> a sequence of skills, and the Expert that plays it.

The goal is read from LIBERO's parsed problem (`parsed_problem["goal_state"]`): a list of
predicates such as ["on", obj, target], ["in", obj, region], ["open", region],
["close", region_or_object], ["turnon", stove]. Each becomes one skill; the order is
turn-on first, then opens, then placements, then closes (a drawer that must hold something
is opened before the placement even if the goal does not ask for it).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np

from wamrl.experts import skills
from wamrl.experts.primitives import hold_action
from wamrl.experts.skills import Ctx

ORDER = {"turnon": 0, "turnoff": 0, "open": 1, "on": 2, "in": 2, "close": 3}


def goal_predicates(env: Any) -> list[list[str]]:
    return [[str(x).lower() for x in g] for g in env._robosuite_env.parsed_problem["goal_state"]]


def order_goal(goal: list[list[str]]) -> list[list[str]]:
    """Sort predicates by ORDER (stable), dropping unknown ones to the end."""
    return sorted(goal, key=lambda g: ORDER.get(g[0], 9))


def _site_joints(ctx: Ctx, site: str) -> list[str]:
    obj = ctx.sc.rs.object_sites_dict.get(site)
    return list(getattr(obj, "joints", None) or [])


def holds(ctx: Ctx, pred: list[str]) -> bool:
    """LIBERO's own check of one goal predicate on the current state."""
    return bool(ctx.sc.rs._eval_predicate(pred))


def run_goal(ctx: Ctx, goal: list[list[str]]) -> Generator[np.ndarray, None, bool]:
    ok = True
    for pred in order_goal(goal):
        kind, args = pred[0], pred[1:]
        if kind in ("on", "in"):
            obj, target = args
            joints = _site_joints(ctx, target) if ctx.sc.is_site(target) else []
            if kind == "in" and joints and not skills.drawer_is_open(ctx, joints[0]):
                ok &= yield from skills.open_drawer(ctx, joints[0])
            if skills.needs_push(ctx, obj):
                ok &= yield from skills.push_to(ctx, obj, skills.target_xy(ctx, target))
                continue
            placed = False
            for _ in range(3):  # re-pick what slipped or missed
                if (yield from skills.pick(ctx, obj)):
                    yield from skills.place_on(ctx, obj, target, inside=kind == "in")
                    yield from skills.hold(ctx, 5)
                if holds(ctx, pred):
                    placed = True
                    break
                ctx.note(f"{pred}: not yet, retrying")
            ok &= placed
        elif kind == "open":
            ok &= yield from skills.open_drawer(ctx, _site_joints(ctx, args[0])[0])
        elif kind == "close":
            (target,) = args
            if ctx.sc.is_site(target):
                ok &= yield from skills.close_drawer(ctx, _site_joints(ctx, target)[0])
            else:
                ok &= yield from skills.close_door(ctx, target)
        elif kind == "turnon":
            ok &= yield from skills.turn_knob(ctx, args[0], on=True)
        else:
            raise NotImplementedError(f"goal predicate {pred}")
    yield from skills.retreat(ctx)
    return ok


class Expert:
    """Scripted expert of one task: reset(env) after env.reset(...), then act(env) per step."""

    def __init__(self, task: Any):
        self.task = task
        self.done = True
        self.ctx: Ctx | None = None
        self._gen: Generator[np.ndarray, None, bool] | None = None
        self.result: bool | None = None

    def reset(self, env: Any) -> None:
        self.ctx = Ctx(env)
        self._gen = run_goal(self.ctx, goal_predicates(env))
        self.done = False
        self.result = None

    def act(self, env: Any) -> np.ndarray:
        if self._gen is None or self.ctx is None:
            raise RuntimeError("reset(env) first")
        if not self.done:
            try:
                return np.asarray(next(self._gen), np.float64)
            except StopIteration as stop:
                self.done = True
                self.result = bool(stop.value)
        return hold_action(self.ctx.grip)

    @property
    def log(self) -> list[str]:
        return [] if self.ctx is None else self.ctx.log
