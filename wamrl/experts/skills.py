"""Skills as generators of raw env actions: move, grip, pick, place, push, pull, turn.

Each skill is a generator that yields one (7,) action per env step and reads the sim state
(through a `Ctx`) after every step; `yield from skill(...)` returns whether it reached its
goal. The caller (wamrl.experts.plan.Expert) steps the env between yields.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np

from wamrl.experts.primitives import (
    GRIP_CLOSE,
    GRIP_OPEN,
    delta_action,
    down_orientation,
    narrowest_direction,
    rot_axis,
    rotation_error,
    yaw_for_finger_direction,
)
from wamrl.experts.scene import Scene

Actions = Generator[np.ndarray, None, bool]

MAX_GRASP_WIDTH = 0.072  # the Panda hand opens to 0.08 m
CLEARANCE = 0.06  # carried objects pass this far above whatever lies under their path
RIM_OBJECTS = ("bowl", "mug", "plate")  # too wide to grasp across: pinch the rim


class Ctx:
    """What a plan knows while it runs: the scene and its own last commands."""

    def __init__(self, env: Any):
        self.sc = Scene(env)
        self.grip = GRIP_OPEN
        self.yaw = 0.0
        self.R = down_orientation(0.0)
        self.target = self.sc.ee()[0]
        self.held: str | None = None
        self.log: list[str] = []

    def note(self, msg: str) -> None:
        self.log.append(msg)


def move(
    ctx: Ctx,
    pos: np.ndarray,
    R: np.ndarray | None = None,
    tol: float = 0.008,
    rot_tol: float = 0.08,
    max_steps: int = 120,
    max_pos: float = 1.0,
    max_rot: float = 1.0,
    gain: float = 1.5,
) -> Actions:
    """Drive the grip site to `pos` (and orientation R, default: keep the last one)."""
    pos = np.asarray(pos, np.float64)
    if R is not None:
        ctx.R = R
    ctx.target = pos
    for _ in range(max_steps):
        p, Rc = ctx.sc.ee()
        if np.linalg.norm(pos - p) < tol and np.linalg.norm(rotation_error(ctx.R, Rc)) < rot_tol:
            return True
        yield delta_action(p, Rc, pos, ctx.R, ctx.grip, max_pos, max_rot, gain)
    return False


def hold(ctx: Ctx, steps: int) -> Actions:
    """Stay at the last target for `steps` steps (with the current gripper command)."""
    for _ in range(steps):
        p, Rc = ctx.sc.ee()
        yield delta_action(p, Rc, ctx.target, ctx.R, ctx.grip, 0.5, 0.5)
    return True


def set_gripper(ctx: Ctx, close: bool, steps: int = 10) -> Actions:
    ctx.grip = GRIP_CLOSE if close else GRIP_OPEN
    return (yield from hold(ctx, steps))


def lift_to(ctx: Ctx, z: float, **kw: Any) -> Actions:
    p, _ = ctx.sc.ee()
    if p[2] >= z - 0.01:
        return True
    return (yield from move(ctx, np.array([p[0], p[1], z]), **kw))


# ---------------------------------------------------------------- grasp planning


def _horizontal_frame(angle: float) -> tuple[np.ndarray, np.ndarray]:
    u = np.array([np.cos(angle), np.sin(angle)])
    return u, np.array([-u[1], u[0]])


def plan_grasp(ctx: Ctx, obj: str) -> tuple[np.ndarray, float]:
    """Grip-site position and yaw for grasping `obj` from above."""
    sc = ctx.sc
    pts = sc.points(obj)
    lo, hi = pts.min(0), pts.max(0)
    height = hi[2] - lo[2]
    if any(k in obj for k in RIM_OBJECTS):
        return _plan_rim_grasp(ctx, obj, pts)
    ang, width = narrowest_direction(pts[:, :2])
    u, v = _horizontal_frame(ang)
    pu, pv = pts[:, :2] @ u, pts[:, :2] @ v
    cxy = u * (pu.min() + pu.max()) / 2 + v * (pv.min() + pv.max()) / 2
    depth = min(0.03, 0.5 * height) if height < 0.1 else 0.04
    z = max(hi[2] - depth, lo[2] + 0.012)
    if width > MAX_GRASP_WIDTH:
        ctx.note(f"{obj}: {width:.3f} m wide, grasping anyway")
    return np.array([cxy[0], cxy[1], z]), yaw_for_finger_direction(ang, 0.0)


def _plan_rim_grasp(ctx: Ctx, obj: str, pts: np.ndarray) -> tuple[np.ndarray, float]:
    """Pinch the rim of a bowl / mug on the side with the most free space around it."""
    sc = ctx.sc
    lo, hi = pts.min(0), pts.max(0)
    top = pts[pts[:, 2] > hi[2] - 0.02]  # the rim ring
    c = (top[:, :2].min(0) + top[:, :2].max(0)) / 2
    best = None
    root = sc.root(obj)
    for ang in (0.0, np.pi / 2, np.pi, -np.pi / 2):
        d = np.array([np.cos(ang), np.sin(ang)])
        radius = float(((top[:, :2] - c) @ d).max())
        outside = c + d * (radius + 0.03)
        obstacle = sc.support_height(outside - 0.015, outside + 0.015, exclude={root})
        # prefer free space, then the side facing the robot (-x)
        score = obstacle - 0.01 * (-d[0])
        if best is None or score < best[0]:
            best = (score, d, radius)
    _, d, radius = best
    g = c + d * (radius - 0.012)
    z = max(hi[2] - 0.02, lo[2] + 0.014)
    return np.array([g[0], g[1], z]), yaw_for_finger_direction(np.arctan2(d[1], d[0]), 0.0)


# ---------------------------------------------------------------- pick and place


def pick(ctx: Ctx, obj: str, attempts: int = 2) -> Actions:
    sc = ctx.sc
    root = sc.root(obj)
    for attempt in range(attempts):
        grasp, yaw = plan_grasp(ctx, obj)
        R = down_orientation(yaw)
        ctx.yaw = yaw
        p, _ = sc.ee()
        lo, hi = sc.box(obj)
        above = max(hi[2] + 0.08, grasp[2] + 0.10)
        # up, over, down
        ctx.grip = GRIP_OPEN
        yield from lift_to(ctx, max(above, p[2]))
        yield from move(ctx, [grasp[0], grasp[1], max(above, p[2])], R, tol=0.015)
        yield from move(ctx, [grasp[0], grasp[1], above], R, tol=0.01)
        yield from move(ctx, grasp, R, tol=0.006, max_pos=0.6, max_steps=80)
        yield from set_gripper(ctx, True, 12)
        z0 = sc.pos(obj)[2]
        yield from move(ctx, [grasp[0], grasp[1], grasp[2] + 0.08], tol=0.02, max_pos=0.6)
        if sc.pos(obj)[2] > z0 + 0.03 and sc.finger_gap() > 0.002:
            ctx.held = obj
            return True
        ctx.note(f"pick {obj}: attempt {attempt} missed")
        yield from set_gripper(ctx, False, 8)
    del root
    return False


def place(
    ctx: Ctx,
    obj: str,
    target_xy: np.ndarray,
    release_gap: float = 0.015,
    support_z: float | None = None,
    footprint: float = 0.8,
) -> Actions:
    """Carry the held `obj` so that its body origin lands over target_xy, lower it until its
    bottom is `release_gap` above what lies under it, and let go."""
    sc = ctx.sc
    root = sc.root(obj)
    target_xy = np.asarray(target_xy, np.float64)
    p, _ = sc.ee()
    lo, hi = sc.box(obj)
    off = sc.pos(obj)[:2] - p[:2]  # body origin relative to the grip site
    below = p[2] - lo[2]  # how far the object hangs below the grip site
    half = (hi[:2] - lo[:2]) / 2
    centre_off = (lo[:2] + hi[:2]) / 2 - sc.pos(obj)[:2]
    goal_ee = target_xy - off
    # carry height: clear everything along the way
    path_top = 0.0
    for s in np.linspace(0.0, 1.0, 12):
        xy = (1 - s) * p[:2] + s * goal_ee
        c = xy + off + centre_off
        path_top = max(path_top, sc.support_height(c - half, c + half, exclude={root}))
    carry = max(p[2], path_top + below + CLEARANCE)
    yield from lift_to(ctx, carry, tol=0.015, max_pos=0.7)
    yield from move(ctx, [goal_ee[0], goal_ee[1], carry], tol=0.012, max_pos=0.7)
    c = target_xy + centre_off
    if support_z is None:
        support_z = sc.support_height(c - half * footprint, c + half * footprint, exclude={root})
    z_rel = support_z + release_gap + below
    ctx.note(f"place {obj}: xy {np.round(target_xy, 3)} support {support_z:.3f} below {below:.3f}")
    yield from move(ctx, [goal_ee[0], goal_ee[1], z_rel], tol=0.006, max_pos=0.5, max_steps=80)
    yield from set_gripper(ctx, False, 10)
    ctx.held = None
    p, _ = sc.ee()
    yield from move(ctx, [p[0], p[1], p[2] + 0.08], tol=0.02, max_steps=30)
    return True


def place_on(ctx: Ctx, obj: str, target: str, inside: bool = False) -> Actions:
    """Place the held obj on (or into) a target object or a region site."""
    sc = ctx.sc
    xy = target_xy(ctx, target)
    joints = list(getattr(sc.rs.object_sites_dict.get(target), "joints", None) or [])
    if inside and joints:
        # a drawer's region: the cabinet above overhangs it; take the support from a small
        # footprint, a little toward the drawer's exposed front
        _, axis = sc.joint_anchor_axis(joints[0])
        o = -axis[:2] / max(float(np.linalg.norm(axis[:2])), 1e-9)
        return (yield from place(ctx, obj, xy + o * 0.012, footprint=0.3))
    return (yield from place(ctx, obj, xy))


def target_xy(ctx: Ctx, target: str) -> np.ndarray:
    sc = ctx.sc
    return sc.site_pos(target)[:2] if sc.is_site(target) else sc.pos(target)[:2]


def needs_push(ctx: Ctx, obj: str) -> bool:
    """Too wide to grasp and not something with a rim: slide it instead."""
    if any(k in obj for k in RIM_OBJECTS):
        return False
    pts = ctx.sc.points(obj)
    _, width = narrowest_direction(pts[:, :2])
    return width > MAX_GRASP_WIDTH and np.ptp(pts[:, 2]) < 0.04


def retreat(ctx: Ctx) -> Actions:
    """Open the hand and move up a little, clear of what was manipulated."""
    ctx.grip = GRIP_OPEN
    p, _ = ctx.sc.ee()
    yield from move(ctx, [p[0], p[1], p[2] + 0.05], tol=0.02, max_steps=15)
    return True


# ---------------------------------------------------------------- articulated objects


def drawer_is_open(ctx: Ctx, joint: str) -> bool:
    return ctx.sc.qpos(joint) < -0.145


def drawer_is_closed(ctx: Ctx, joint: str) -> bool:
    return ctx.sc.qpos(joint) > -0.004


def horizontal_orientation(approach: np.ndarray) -> np.ndarray:
    """Gripper pointing along the horizontal unit vector `approach`, fingers closing
    vertically: R_DOWN pitched by 90 degrees."""
    a = np.asarray(approach, np.float64)
    return pitched_orientation(a, np.pi / 2)


def pitched_orientation(approach: np.ndarray, angle: float) -> np.ndarray:
    """The down orientation tilted by `angle` so the fingertips lead along `approach`."""
    a = np.asarray(approach, np.float64)
    return rot_axis(np.array([a[1], -a[0], 0.0]), angle) @ down_orientation(0.0)


def _drawer_handle(ctx: Ctx, joint: str) -> tuple[np.ndarray, np.ndarray]:
    """Handle centre of a drawer (world) and the drawer's horizontal opening direction."""
    sc = ctx.sc
    j = sc.model.joint_name2id(joint)
    body = int(sc.mj.jnt_bodyid[j])
    _, axis = sc.joint_anchor_axis(joint)
    o = -axis  # LIBERO's cabinets open toward negative joint values
    o[2] = 0.0
    o /= np.linalg.norm(o)
    pts = sc.geom_points(sc._subtree_geoms(body))
    proj = pts @ o
    handle = pts[proj > proj.max() - 0.012]
    return (handle.min(0) + handle.max(0)) / 2, o


def open_drawer(ctx: Ctx, joint: str) -> Actions:
    """Grasp the drawer's handle with a horizontal hand and pull it out along its slide."""
    sc = ctx.sc
    h, o = _drawer_handle(ctx, joint)
    R = horizontal_orientation(-o)
    ctx.grip = GRIP_OPEN
    p, _ = sc.ee()
    high = max(p[2], h[2] + 0.12)
    pre = h + o * 0.12
    yield from _approach_at_height(ctx, pre, R, high)
    yield from move(ctx, h - o * 0.004, tol=0.005, max_pos=0.4, max_steps=80)
    yield from set_gripper(ctx, True, 12)
    for _ in range(4):  # pull in a few legs, re-reading the handle
        if drawer_is_open(ctx, joint):
            break
        h_now, _ = _drawer_handle(ctx, joint)
        yield from move(ctx, h_now + o * 0.06, tol=0.01, max_pos=0.5, max_steps=40)
    yield from set_gripper(ctx, False, 8)
    yield from _back_off_and_rise(ctx, o, out_steps=30, up_steps=40)
    return drawer_is_open(ctx, joint)


def close_drawer(ctx: Ctx, joint: str) -> Actions:
    """Push the drawer back in with the closed fingertips, the hand pitched 45 degrees
    back from them so it stays clear of the drawers above."""
    sc = ctx.sc
    h, o = _drawer_handle(ctx, joint)
    a = -o
    R = pitched_orientation(a, np.pi / 4)
    ctx.grip = GRIP_CLOSE
    p, _ = sc.ee()
    start = h + o * 0.05
    high = max(p[2], h[2] + 0.15)
    yield from _approach_at_height(ctx, start, R, high)
    for _ in range(8):
        if drawer_is_closed(ctx, joint):
            break
        h_now, _ = _drawer_handle(ctx, joint)
        yield from move(ctx, h_now + a * 0.06, tol=0.01, max_pos=0.6, max_steps=20)
    yield from _back_off_and_rise(ctx, o, out_steps=25, up_steps=30)
    return drawer_is_closed(ctx, joint)


def _approach_at_height(ctx: Ctx, target: np.ndarray, R: np.ndarray, high: float) -> Actions:
    """Rise to `high`, go above `target`, turn to R there, then descend onto it."""
    yield from lift_to(ctx, high)
    yield from move(ctx, [target[0], target[1], high], tol=0.015)
    yield from move(ctx, [target[0], target[1], high], R, tol=0.01, rot_tol=0.05, max_steps=80)
    return (yield from move(ctx, target, tol=0.008, max_pos=0.6))


def _back_off_and_rise(ctx: Ctx, o: np.ndarray, out_steps: int, up_steps: int) -> Actions:
    """8 cm out along the drawer's opening direction o, 10 cm up, then the hand down again."""
    p, _ = ctx.sc.ee()
    yield from move(ctx, p + o * 0.08, tol=0.015, max_steps=out_steps)
    p, _ = ctx.sc.ee()
    yield from move(ctx, [p[0], p[1], p[2] + 0.1], tol=0.02, max_steps=up_steps)
    return (
        yield from move(
            ctx, ctx.sc.ee()[0], down_orientation(0.0), tol=0.05, rot_tol=0.1, max_steps=60
        )
    )


def _hinge_of(ctx: Ctx, obj: str) -> str:
    sc = ctx.sc
    for j in range(sc.mj.njnt):
        name = sc.model.joint_id2name(j)
        if name.startswith(obj) and sc.mj.jnt_type[j] == 3:
            return name
    raise NotImplementedError(f"{obj}: no hinge joint")


def push_arc(
    ctx: Ctx,
    joint: str,
    q_goal: float,
    z: float | None = None,
    radius_frac: float = 0.8,
    lead: float = 0.25,
    done: Any = None,
    max_legs: int = 40,
) -> Actions:
    """Rotate a hinged part (knob, door) toward q_goal by pushing its far edge with the
    closed fingers along the arc of the rotation."""
    sc = ctx.sc
    j = sc.model.joint_name2id(joint)
    body = int(sc.mj.jnt_bodyid[j])
    anchor, axis = sc.joint_anchor_axis(joint)
    pts = sc.geom_points(sc._subtree_geoms(body))
    rel = pts - anchor
    rel_h = rel - np.outer(rel @ axis, axis)
    far = pts[int(np.argmax(np.linalg.norm(rel_h, axis=1)))]
    if z is None:
        z = float(far[2])
    q0 = sc.qpos(joint)
    sign = np.sign(q_goal - q0) or 1.0
    r_far = rel_h[int(np.argmax(np.linalg.norm(rel_h, axis=1)))]
    arm = r_far * radius_frac

    def point(q: float) -> np.ndarray:
        v = rot_axis(axis, q - q0) @ arm + anchor
        return np.array([v[0], v[1], z])

    ctx.grip = GRIP_CLOSE
    p, _ = sc.ee()
    start = point(q0 - sign * lead)
    high = max(p[2], z + 0.10)
    yield from lift_to(ctx, high)
    yield from move(ctx, [start[0], start[1], high], down_orientation(ctx.yaw), tol=0.015)
    yield from move(ctx, start, tol=0.008, max_pos=0.6)
    for _ in range(max_legs):
        q = sc.qpos(joint)
        if (done is not None and done()) or sign * (q_goal - q) <= 0:
            break
        target = point(q + sign * 0.2)
        yield from move(ctx, target, tol=0.01, max_pos=0.5, max_steps=6)
    p, _ = sc.ee()
    yield from move(ctx, [p[0], p[1], p[2] + 0.08], tol=0.02, max_steps=30)
    return done() if done is not None else True


def turn_knob(ctx: Ctx, obj: str, on: bool = True) -> Actions:
    """Grasp the knob's fin on its axis and twist the hand about the vertical."""
    sc = ctx.sc
    joint = _hinge_of(ctx, obj)
    stove = sc.rs.get_object(obj)

    def reached() -> bool:
        q = sc.qpos(joint)
        return bool(stove.turn_on(q)) if on else bool(stove.turn_off(q))

    j = sc.model.joint_name2id(joint)
    body = int(sc.mj.jnt_bodyid[j])
    anchor, axis = sc.joint_anchor_axis(joint)
    geoms = sc._subtree_geoms(body)
    pts = sc.geom_points(geoms).reshape(-1, 8, 3)
    top = pts[:, :, 2].max()
    fin = pts[pts[:, :, 2].max(1) > top - 0.02].reshape(-1, 3)  # geoms reaching the top
    ang, _ = narrowest_direction(fin[:, :2])
    yaw0 = yaw_for_finger_direction(ang, 0.0)
    grasp = np.array([anchor[0], anchor[1], top - 0.018])
    sign = (1.0 if on else -1.0) * float(np.sign(axis[2]) or 1.0)
    q_goal = 0.75 if on else 0.0
    ctx.grip = GRIP_OPEN
    p, _ = sc.ee()
    high = max(p[2], top + 0.10)
    yield from lift_to(ctx, high)
    yield from move(ctx, [grasp[0], grasp[1], high], down_orientation(yaw0), tol=0.012)
    yield from move(ctx, grasp, tol=0.006, max_pos=0.5, max_steps=80)
    yield from set_gripper(ctx, True, 12)
    yaw = yaw0
    for _ in range(12):
        if reached() and abs(sc.qpos(joint) - q_goal) < 0.3:
            break
        yaw += sign * 0.25
        yield from move(ctx, grasp, down_orientation(yaw), tol=0.01, rot_tol=0.05, max_steps=12)
    yield from set_gripper(ctx, False, 8)
    ctx.yaw = yaw
    p, _ = sc.ee()
    yield from move(ctx, [p[0], p[1], p[2] + 0.08], tol=0.02, max_steps=30)
    return reached()


def push_to(ctx: Ctx, obj: str, target_xy: np.ndarray, tol: float = 0.012) -> Actions:
    """Slide a flat, rimmed object (a plate) over the table to target_xy: the closed
    fingers go down inside it next to its leading rim and drag it there in short legs."""
    sc = ctx.sc
    target_xy = np.asarray(target_xy, np.float64)
    ctx.grip = GRIP_CLOSE
    for _ in range(30):
        c = sc.pos(obj)[:2]
        d = target_xy - c
        dist = float(np.linalg.norm(d))
        if dist < tol:
            return True
        u = d / dist
        pts = sc.points(obj)
        r = float(((pts[:, :2] - c) @ u).max())
        inside = c + u * (0.3 * r)
        z = float(pts[:, 2].min()) + 0.024
        p, _ = sc.ee()
        rel = p[:2] - c
        if np.linalg.norm(rel) > 0.75 * r or rel @ u < -0.01 or p[2] > z + 0.015:
            high = max(p[2], float(pts[:, 2].max()) + 0.06)
            yield from lift_to(ctx, high)
            yield from move(ctx, [inside[0], inside[1], high], down_orientation(0.0), tol=0.012)
            yield from move(ctx, [inside[0], inside[1], z], tol=0.008, max_pos=0.6)
            p, _ = sc.ee()
        goal = p[:2] + u * min(dist + 0.01, 0.05)
        yield from move(ctx, [goal[0], goal[1], z], tol=0.006, max_pos=0.4, max_steps=10)
    return False


def close_door(ctx: Ctx, obj: str) -> Actions:
    sc = ctx.sc
    joint = _hinge_of(ctx, obj)
    door = sc.rs.get_object(obj)

    def is_closed() -> bool:
        return bool(door.is_close(sc.qpos(joint)))

    return (yield from push_arc(ctx, joint, 0.05, done=is_closed, radius_frac=0.7))
