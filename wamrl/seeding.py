"""One way to turn a tuple of keys into a seed. Numpy only: the plan and env workers use it."""

from __future__ import annotations

import numpy as np


def derive_seed(*keys: int) -> int:
    """A 32-bit seed from non-negative integer keys (e.g. seed, iteration, group, member):
    the first word of SeedSequence(keys)'s state, so nearby keys give unrelated seeds and a
    seed stored before (rollout noise seeds, eval episode seeds) stays the same number."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1)[0])
