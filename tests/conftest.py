"""Fixtures shared by several test files. The builders behind them live in tests/helpers.py,
which tests that pass arguments import directly.

helpers imports torch: it is imported inside the fixtures, so that test files that never use
them (the config and Snakefile tests) do not pay for torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from wamrl.policy.base import Obs
    from wamrl.policy.tiny import TinyWAM


@pytest.fixture
def tiny_policy() -> TinyWAM:
    """The small tiny policy from seed 0 with signal on every path and sharp attention, in
    eval mode (helpers.make_tiny_policy for other seeds, sizes or perturbations)."""
    from tests.helpers import make_tiny_policy

    return make_tiny_policy(perturb="sharp").eval()


@pytest.fixture
def tiny_obs() -> Obs:
    """2 random observations for the small tiny policy, row 0 with a shorter instruction."""
    from tests.helpers import make_obs

    return make_obs()


@pytest.fixture(scope="module")
def run_after_reward(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The learner tests' synthetic run (iter_000/policy + two stores, helpers.make_run) at
    helpers.small_cfg, after the reward stage ran for real; one per test module."""
    import stages.reward
    from tests.helpers import make_run, small_cfg

    cfg = small_cfg()
    run = make_run(tmp_path_factory.mktemp("learner"), cfg)
    stages.reward.main(cfg, run, 1)
    return run, cfg
