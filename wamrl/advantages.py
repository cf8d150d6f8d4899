"""Reward combination, discounted returns, group advantages and degenerate-group filtering.

Pure numpy (docs/design.md "Reward" and "Advantages"). Arrays are [E, T] over episodes and
macro-steps, with `valid` [E, T] marking macro-steps that exist (padding is False). Every
function returns 0 on padding so the arrays can be written into the store as they are.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

FilterMode = Literal["all_same", "zero_spread", "none"]

LIBERO_10_TASKS = range(30, 40)  # suite order: spatial, object, goal, libero_10


def normalise_rec(
    r_rec: np.ndarray, valid: np.ndarray, eps: float = 1e-8
) -> tuple[np.ndarray, float, float]:
    """(r_rec - mean) / std over all valid macro-steps of the iteration (population std).

    Pass every shard's steps together (concatenate along E) so the statistics are the
    iteration's. A spread below `eps` (e.g. a single valid step) divides by 1 instead of
    blowing up, so r_rec_norm is then 0 everywhere.
    """
    valid = valid.astype(bool)
    vals = r_rec[valid].astype(np.float64)
    if vals.size == 0:
        return np.zeros_like(r_rec, dtype=np.float32), 0.0, 1.0
    mean = float(vals.mean())
    std = float(vals.std())
    scale = std if std > eps else 1.0
    out = np.where(valid, (r_rec - mean) / scale, 0.0).astype(np.float32)
    return out, mean, std


def combine(
    r_task: np.ndarray,
    r_rec_norm: np.ndarray,
    beta: float,
    gamma: float | np.ndarray = 0.99,
    clip: float = 3.0,
) -> np.ndarray:
    """r = r^task + beta * (1 - gamma) * clip(r~^rec, -clip, clip) (inputs 0 on padding).

    gamma: a float or one discount per episode [E] (the episode's own, see episode_gammas).
    Why: the reconstruction part of any return R_t over the n steps left is beta times
    sum_k (1 - gamma) gamma^k clip(z_{t+k}), a discount-weighted average of clipped z-scores
    (weights sum to 1 - gamma^n <= 1), so its magnitude is at most
    B(n) = beta * clip * (1 - gamma^n) < beta * clip, however long the episode. A success
    at step s adds gamma^(s-t) to R_t; success_margin says when that beats every failing
    member's reconstruction return. beta = 0 gives r = r^task exactly.
    """
    r_task = np.asarray(r_task)
    if beta == 0:  # exact, even where r~^rec is not finite
        return r_task.astype(np.float32)
    g = np.asarray(gamma, dtype=np.float64)
    scale = beta * (1.0 - (g[:, None] if g.ndim == 1 else g))  # [E, 1] per episode
    rec = np.clip(np.asarray(r_rec_norm, dtype=np.float64), -clip, clip)
    return (r_task + scale * rec).astype(np.float32)


def success_margin(beta: float, gamma: float, clip: float, horizon: int) -> float:
    """min over n = 1..horizon of gamma^(n-1) - 2 B(n), B(n) = beta * clip * (1 - gamma^n).

    At step t, a member that succeeds at step s (n = s - t + 1 <= horizon steps left,
    counting t) has R_t >= gamma^(n-1) - B(n); a failing member alive at t has
    R_t <= B(n') for its n' <= horizon steps left (r^task = 0, combine's bound). Hence
    success beats every failing member alive at every step iff the margin is > 0, for any
    clipped z-scores (tight: failures at +clip, the success at -clip, both `horizon` long).
    Both terms fall with n, so the minimum is at n = horizon. horizon: the store's T.
    """
    if horizon < 1:
        return 1.0  # no step, nothing to outweigh
    n = np.arange(1, int(horizon) + 1, dtype=np.float64)
    g = float(gamma)
    return float(np.min(g ** (n - 1) - 2.0 * beta * clip * (1.0 - g**n)))


def success_dominates(beta: float, gamma: float, clip: float, horizon: int) -> bool:
    """True iff a success always out-returns every failing group member (success_margin > 0).

    beta = 0 always passes (r = r^task: a failure's return is 0, a success's is > 0).
    """
    return beta == 0 or success_margin(beta, gamma, clip, horizon) > 0


def require_success_dominates(
    beta: float, clip: float, gammas: dict[str, float], horizon: int
) -> dict[str, float]:
    """success_margin per discount in use ({config key: gamma}); ValueError if one fails.

    The message names reward.beta, reward.rec_clip, the gamma key and the horizon, and the
    largest beta that would pass, so a run stops before any work with the fix in hand.
    """
    margins: dict[str, float] = {}
    for key, g in gammas.items():
        margins[key] = success_margin(beta, g, clip, horizon)
        if success_dominates(beta, g, clip, horizon):
            continue
        lhs, bound = g ** (horizon - 1), 2.0 * clip * (1.0 - g**horizon)
        raise ValueError(
            f"reward.beta={beta}, reward.rec_clip={clip}, {key}={g}, horizon T={horizon} "
            f"macro-steps: reconstruction reward can outweigh task success (needs "
            f"gamma^(T-1) > 2 * beta * rec_clip * (1 - gamma^T): {lhs:.4g} <= "
            f"{beta * bound:.4g}). Use reward.beta < {lhs / bound:.4g} at this rec_clip, "
            f"a smaller reward.rec_clip, or fewer macro-steps (env.max_macro_steps)."
        )
    return margins


def episode_gammas(
    task: np.ndarray, gamma: float = 0.99, gamma_libero_10: float = 0.995
) -> np.ndarray:
    """Per-episode discount from the task's suite: libero_10 (tasks 30..39) uses the longer one."""
    task = np.asarray(task)
    is_long = (task >= LIBERO_10_TASKS.start) & (task < LIBERO_10_TASKS.stop)
    return np.where(is_long, gamma_libero_10, gamma).astype(np.float64)


def discounted_returns(reward: np.ndarray, valid: np.ndarray, gamma: np.ndarray) -> np.ndarray:
    """R_t = sum_{j >= t} gamma^{j-t} r_j within the episode; 0 on padding.

    gamma: [E], one discount per episode. Padding rewards are ignored (treated as 0), so
    a padded tail contributes nothing and the episode's last valid step has R = r.
    """
    valid = valid.astype(bool)
    r = np.where(valid, reward, 0.0).astype(np.float64)
    E, T = r.shape
    out = np.zeros((E, T), dtype=np.float64)
    running = np.zeros(E, dtype=np.float64)
    g = np.asarray(gamma, dtype=np.float64).reshape(E)
    for t in range(T - 1, -1, -1):  # backward recursion R_t = r_t + gamma R_{t+1}
        running = r[:, t] + g * running
        out[:, t] = running
    return np.where(valid, out, 0.0).astype(np.float32)


AdvScale = Literal["step", "episode"]


def group_advantages(
    returns: np.ndarray,
    valid: np.ndarray,
    group: np.ndarray,
    eps: float = 1e-6,
    scale: AdvScale = "step",
) -> np.ndarray:
    """A_{i,t} = (R_{i,t} - mean_j R_{j,t}) / (s + eps) over the group's live members.

    The mean at step t uses only the group's episodes whose step t is valid (an episode
    that ended is no longer part of the comparison). s, the population std (ddof = 0):
      step:    std_j R_{j,t} over the members alive at t (docs/design.md's formula; with two
               live members the advantages are exactly +-1, up to eps);
      episode: std_j R_{j,0}, the spread of the group's whole-episode returns, one per group.
    Why `episode`: once a group's successes have ended, the failures still alive differ only
    by their reconstruction returns (at most beta * rec_clip apart), and `step` scales those
    differences up to +-1, as large as success against failure. `episode` keeps them at their
    size next to the success spread; the step's ranking and sign are the same as `step`'s.
    A = 0 on padding and where fewer than two members are alive (nothing to compare).
    """
    valid = valid.astype(bool)
    group = np.asarray(group)
    R = returns.astype(np.float64)
    adv = np.zeros_like(R)
    for g in np.unique(group):
        members = group == g
        Rg, vg = R[members], valid[members]  # [M, T]
        n = vg.sum(axis=0)  # live members per step
        mean = np.where(vg, Rg, 0.0).sum(axis=0) / np.maximum(n, 1)
        if scale == "step":
            std = np.sqrt(np.where(vg, (Rg - mean) ** 2, 0.0).sum(axis=0) / np.maximum(n, 1))
        elif scale == "episode":
            R0 = Rg[vg[:, 0], 0]  # an episode that exists has its step 0
            std = np.full(mean.shape, R0.std() if R0.size else 0.0)
        else:
            raise ValueError(f"reward.adv_scale: {scale!r} is not one of step, episode")
        with np.errstate(divide="ignore", invalid="ignore"):  # masked just below
            a = (Rg - mean) / (std + eps)
        adv[members] = np.where(vg & (n >= 2), a, 0.0)
    return adv.astype(np.float32)


def live_members(valid: np.ndarray, group: np.ndarray) -> np.ndarray:
    """[E, T]: how many of episode i's group are alive at step t (0 on padding)."""
    valid = valid.astype(bool)
    out = np.zeros(valid.shape, dtype=np.int64)
    for g in np.unique(group):
        members = group == g
        out[members] = np.where(valid[members], valid[members].sum(axis=0), 0)
    return out


def group_spread(returns: np.ndarray, valid: np.ndarray, group: np.ndarray) -> dict[int, float]:
    """Largest per-step population std of returns over live members, per group."""
    valid = valid.astype(bool)
    out: dict[int, float] = {}
    for g in np.unique(group):
        members = group == g
        Rg, vg = returns[members].astype(np.float64), valid[members]
        n = vg.sum(axis=0)
        mean = np.where(vg, Rg, 0.0).sum(axis=0) / np.maximum(n, 1)
        var = np.where(vg, (Rg - mean) ** 2, 0.0).sum(axis=0) / np.maximum(n, 1)
        var = np.where(n >= 2, var, 0.0)
        out[int(g)] = float(np.sqrt(var.max())) if var.size else 0.0
    return out


def degenerate_groups(
    success: np.ndarray,
    returns: np.ndarray,
    valid: np.ndarray,
    group: np.ndarray,
    mode: FilterMode = "all_same",
    eps: float = 1e-6,
) -> np.ndarray:
    """group_kept [E]: True for episodes whose group takes part in the actor update.

    all_same: drop groups whose episodes all succeeded or all failed (SimpleVLA-RL
    dynamic sampling); a one-episode group is all-same by definition.
    zero_spread: drop only groups whose returns have ~zero spread (largest per-step std
    over live members <= eps), so a group with equal outcomes but differing
    reconstruction rewards is kept.
    none: keep everything.
    """
    group = np.asarray(group)
    success = np.asarray(success).astype(bool)
    kept = np.ones(group.shape[0], dtype=bool)
    if mode == "none":
        return kept
    if mode == "all_same":
        for g in np.unique(group):
            members = group == g
            s = success[members]
            if s.all() or not s.any():
                kept[members] = False
        return kept
    if mode == "zero_spread":
        for g, spread in group_spread(returns, valid, group).items():
            if spread <= eps:
                kept[group == g] = False
        return kept
    raise ValueError(f"unknown reward.filter mode {mode!r} (all_same | zero_spread | none)")
