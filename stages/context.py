"""Context stage (fastwam backend): each task's umT5 text context -> <run_dir>/context/.

Optional: init computes the same file itself when it is missing or stale
(wamrl.policy.context.task_contexts), and reuses it when it matches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wamrl.policy.context import task_contexts
from wamrl.runtime import say_device


def main(cfg: dict[str, Any], run_dir: Path, iteration: int = 0) -> None:
    if cfg["policy"]["backend"] != "fastwam":
        raise ValueError(
            f"the context stage is for policy.backend fastwam (got {cfg['policy']['backend']!r}); "
            "the tiny backend's contexts are computed by init"
        )
    # official_encoder's default: the umT5 encoder runs once per run, on the CPU
    say_device("context", "device cpu", "the text encoder runs once per run")
    task_contexts(cfg, Path(run_dir))
