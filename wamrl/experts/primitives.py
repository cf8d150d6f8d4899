"""Pure math of the scripted experts: the OSC delta controller and gripper conventions.

LIBERO's arm runs robosuite's OSC_POSE controller with deltas: an action a in [-1, 1]^6 sets
the goal pose to (p + 0.05 a[:3], Exp(0.5 a[3:6]) R) (world frame, axis-angle rotation,
left-multiplied). `delta_action` inverts that map toward a target pose and clips, so a target
within reach of one step becomes the controller's goal and farther targets are approached
at a bounded, human-like speed. a[6] is the gripper: -1 = open, +1 = close.

Only numpy here: unit-testable without LIBERO.
"""

from __future__ import annotations

import numpy as np

POS_SCALE = 0.05  # metres of goal offset per unit action (robosuite OSC output_max)
ROT_SCALE = 0.5  # radians of goal rotation per unit action
GRIP_OPEN = -1.0
GRIP_CLOSE = 1.0

# Gripper pointing straight down with the fingers closing along world y: LIBERO's reset pose
# (the grip site's columns are x = +y world, y = +x world, z = -z world).
R_DOWN = np.array([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, -1.0]])


def rot_z(yaw: float) -> np.ndarray:
    c, s = np.cos(yaw), np.sin(yaw)
    return np.array([[c, -s, 0.0], [s, c, 0.0], [0.0, 0.0, 1.0]])


def rot_axis(axis: np.ndarray, angle: float) -> np.ndarray:
    """Rotation matrix of `angle` about unit `axis` (Rodrigues)."""
    a = np.asarray(axis, np.float64)
    a = a / np.linalg.norm(a)
    k = np.array([[0.0, -a[2], a[1]], [a[2], 0.0, -a[0]], [-a[1], a[0], 0.0]])
    return np.eye(3) + np.sin(angle) * k + (1.0 - np.cos(angle)) * (k @ k)


def down_orientation(yaw: float = 0.0) -> np.ndarray:
    """Gripper pointing down, finger axis at `yaw` from world +y (about world z)."""
    return rot_z(yaw) @ R_DOWN


def finger_axis(R: np.ndarray) -> np.ndarray:
    """World direction along which the fingers close (the grip frame's x axis)."""
    return np.asarray(R)[:, 0]


def log_rotation(R: np.ndarray) -> np.ndarray:
    """Axis-angle vector (axis * angle, angle in [0, pi]) of a rotation matrix."""
    R = np.asarray(R, np.float64)
    cos = np.clip((np.trace(R) - 1.0) / 2.0, -1.0, 1.0)
    angle = float(np.arccos(cos))
    if angle < 1e-9:
        return np.zeros(3)
    if np.pi - angle < 1e-4:
        # near pi: axis from the symmetric part, sign fixed by the largest diagonal entry
        M = (R + np.eye(3)) / 2.0
        i = int(np.argmax(np.diag(M)))
        axis = M[:, i] / np.sqrt(max(M[i, i], 1e-12))
        return axis * angle
    w = np.array([R[2, 1] - R[1, 2], R[0, 2] - R[2, 0], R[1, 0] - R[0, 1]])
    return w / (2.0 * np.sin(angle)) * angle


def rotation_error(R_target: np.ndarray, R_current: np.ndarray) -> np.ndarray:
    """World-frame axis-angle e with Exp(e) R_current = R_target."""
    return log_rotation(np.asarray(R_target) @ np.asarray(R_current).T)


def clip_norm(v: np.ndarray, limit: float) -> np.ndarray:
    """Scale v down (keeping its direction) so that max |v_i| <= limit."""
    v = np.asarray(v, np.float64)
    m = float(np.max(np.abs(v))) if v.size else 0.0
    return v * (limit / m) if m > limit else v


def delta_action(
    pos: np.ndarray,
    R: np.ndarray,
    target_pos: np.ndarray,
    target_R: np.ndarray | None,
    grip: float,
    max_pos: float = 1.0,
    max_rot: float = 1.0,
    gain: float = 1.0,
) -> np.ndarray:
    """One raw env action (7,) moving the grip site from (pos, R) toward the target pose.

    Position and rotation parts are each scaled down uniformly (direction kept) to at most
    max_pos / max_rot per component, then everything is clipped to [-1, 1].
    target_R None holds the current orientation. grip is sent as is (-1 open, +1 close).
    """
    dp = gain * (np.asarray(target_pos, np.float64) - np.asarray(pos, np.float64)) / POS_SCALE
    dp = clip_norm(dp, max_pos)
    if target_R is None:
        dr = np.zeros(3)
    else:
        dr = clip_norm(gain * rotation_error(target_R, R) / ROT_SCALE, max_rot)
    out = np.concatenate([dp, dr, [float(grip)]])
    return np.clip(out, -1.0, 1.0)


def hold_action(grip: float) -> np.ndarray:
    """Stay still (zero deltas) with the given gripper command."""
    return np.array([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, float(grip)])


def narrowest_direction(points_xy: np.ndarray, step_deg: float = 3.0) -> tuple[float, float]:
    """The horizontal direction (angle in [0, pi)) across which the point set is narrowest,
    and that width."""
    pts = np.asarray(points_xy, np.float64)
    best = (0.0, np.inf)
    for ang in np.deg2rad(np.arange(0.0, 180.0, step_deg)):
        u = np.array([np.cos(ang), np.sin(ang)])
        w = float(np.ptp(pts @ u))
        if w < best[1] - 1e-9:
            best = (float(ang), w)
    return best


def yaw_for_finger_direction(direction_angle: float, current_yaw: float = 0.0) -> float:
    """Yaw (for `down_orientation`) whose finger axis lies along `direction_angle` (world
    angle from +x); of the two equivalent yaws (a parallel gripper is symmetric) the one
    nearest current_yaw."""
    # finger axis of down_orientation(yaw) is rot_z(yaw) @ (0, 1, 0): angle pi/2 + yaw
    yaw = direction_angle - np.pi / 2.0
    yaw = (yaw - current_yaw + np.pi / 2.0) % np.pi - np.pi / 2.0 + current_yaw
    return float(yaw)
