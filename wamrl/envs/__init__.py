"""LIBERO environments: the 40-task table, Fast-WAM's conventions, one env, a pool of env workers.

`libero_env` and `pool` import LIBERO/robosuite only when an env is built, so importing
this package is cheap (set MUJOCO_GL before building an env).
"""

from wamrl.envs.conventions import (
    DUMMY_ACTION,
    Normalizer,
    env_actions,
    image_to_model_input,
    model_image,
    raw_proprio,
)
from wamrl.envs.tasks import Task, load_tasks, task_by_name, tasks_in_suites

__all__ = [
    "DUMMY_ACTION",
    "Normalizer",
    "Task",
    "env_actions",
    "image_to_model_input",
    "load_tasks",
    "model_image",
    "raw_proprio",
    "task_by_name",
    "tasks_in_suites",
]
