"""Which waiting episode a freed env slot runs next (rollout.next_spec)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from wamrl.rollout import next_spec

ROOT = Path(__file__).resolve().parents[1]


def test_same_task_first_then_an_idle_task_then_the_first_waiting() -> None:
    todo = [3, 3, 5, 7, 7]
    assert next_spec(todo, slot_task=7, busy_tasks={3, 7}) == 3  # its env holds task 7
    assert next_spec(todo, slot_task=1, busy_tasks={3, 7}) == 2  # task 5: nobody runs it
    assert next_spec(todo, slot_task=None, busy_tasks={3, 5, 7}) == 0  # all busy: join one
    assert next_spec([4], slot_task=None, busy_tasks=set()) == 0


def test_each_task_stays_on_one_env_when_slots_are_many() -> None:
    """16 slots, 40 tasks x 10 episodes, equal lengths: the first wave puts one task on each
    slot, every slot then runs its task's episodes back to back, and only the last tasks,
    shared out so that no slot idles, make slots switch."""
    todo = [t for t in range(40) for _ in range(10)]
    env_task: dict[int, int] = {}
    running: dict[int, int] = {}
    for slot in range(16):
        j = next_spec(todo, env_task.get(slot), set(running.values()))
        running[slot] = env_task[slot] = todo.pop(j)
    assert sorted(running.values()) == list(range(16))
    switches = 0
    while todo:
        for slot in range(16):  # every slot finishes at once, in slot order
            if not todo:
                break
            del running[slot]
            j = next_spec(todo, env_task[slot], set(running.values()))
            t = todo.pop(j)
            switches += t != env_task[slot]
            running[slot] = env_task[slot] = t
    # 75 env builds after the first wave; first-in-first-out builds one for 384 of the 384.
    assert switches <= 80


class _ScriptedPool:
    """A pool double for run_episodes' batching alone: every episode is `chunks` macro-steps;
    a Query follows each start and each chunk. A chunk takes time: its events arrive only
    when run_episodes blocks in poll (timeout None); poll(0) returns what has arrived. A
    blocking poll with nothing to come would hang a real pool forever, so it fails here."""

    replan = 10

    def __init__(self, n: int, chunks: int):
        self.n, self.chunks = n, chunks
        self.queue: list = []  # arrived
        self.flight: list = []  # still stepping
        self.left: dict[int, int] = {}

    def __len__(self) -> int:
        return self.n

    def _query(self, slot: int):
        from wamrl.envs.pool import Query

        return Query(slot, np.zeros((224, 448, 3), np.uint8), np.zeros(8, np.float32))

    def start_episode(self, slot, task, init_state, record_video, max_macro_steps, record_frames):
        self.left[slot] = self.chunks
        self.queue.append(self._query(slot))

    def send_chunk(self, slot: int, actions: np.ndarray) -> None:
        from wamrl.envs.pool import StepResult

        assert actions.shape == (self.replan, 7)
        self.left[slot] -= 1
        done = self.left[slot] == 0
        frames = np.zeros((2, 224, 448, 3), np.uint8)
        self.flight.append(StepResult(slot, frames, False, done, None, None, self.replan))
        if not done:
            self.flight.append(self._query(slot))

    def poll(self, timeout: float | None = None) -> list:
        if timeout is None:  # block: time passes until the chunks in flight are done
            assert self.queue or self.flight, "blocking poll with nothing to come"
            self.queue, self.flight = self.queue + self.flight, []
        out, self.queue = self.queue, []
        return out


@pytest.mark.parametrize("lockstep", [False, True])
def test_max_batch_caps_each_query_batch_and_serves_the_longest_waiting_first(
    lockstep: bool, monkeypatch
) -> None:
    import wamrl.rollout as rollout
    from wamrl.envs.conventions import Normalizer
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy.tiny import TinyConfig, TinyWAM

    batches: list[list[int]] = []
    real = rollout._answer
    monkeypatch.setattr(
        rollout,
        "_answer",
        lambda p, pool, run, slots, *a, **kw: (
            batches.append(list(slots)),
            real(p, pool, run, slots, *a, **kw),
        ),
    )
    cfg = TinyConfig(video_dim=32, action_dim=32, layers=1, heads=2, head_dim=16, text_max_len=4)
    policy = TinyWAM(cfg).eval()
    task = load_tasks()[0]
    specs = [rollout.EpisodeSpec(task, i, i) for i in range(6)]
    got: dict[int, object] = {}
    stats = rollout.run_episodes(
        policy, _ScriptedPool(6, chunks=3), specs, torch.zeros(40, 4, cfg.text_dim),
        torch.ones(40, 4, dtype=torch.bool), Normalizer.load(ROOT / "data" / "stats.json"),
        rollout.SamplerSettings(4, 0.5, 5.0, max_batch=4), None, 0, got.__setitem__,
        torch.device("cpu"), lockstep=lockstep,
    )  # fmt: skip
    assert sorted(got) == list(range(6)) and all(d.length == 3 for d in got.values())
    assert stats["queries"] == 18 and max(len(b) for b in batches) == 4
    if lockstep:  # every round: all six waiting, answered in slot order, 4 then 2
        assert batches == [[0, 1, 2, 3], [4, 5]] * 3
    else:  # the two left over are answered while the first four still step
        assert batches[:2] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("cap", [None, 3])
def test_longest_step_budget_starts_first_unless_a_cap_makes_them_equal(cap) -> None:
    """libero_10 episodes (700 steps) start before the 400-step ones, so they do not run alone
    at the end; under a macro-step cap every budget is the same and the order is kept."""
    import wamrl.rollout as rollout
    from wamrl.envs.conventions import Normalizer
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy.tiny import TinyConfig, TinyWAM

    started: list[int] = []

    class Recording(_ScriptedPool):
        def start_episode(self, slot, task, *args):
            started.append(task.index)
            super().start_episode(slot, task, *args)

    tasks = load_tasks()
    a, b, long = tasks[0], tasks[10], tasks[30]  # spatial, object: 400 steps; libero_10: 700
    assert long.max_steps > a.max_steps == b.max_steps
    specs = [rollout.EpisodeSpec(t, 0, i) for i, t in enumerate([a, a, b, b, long, long])]
    cfg = TinyConfig(video_dim=32, action_dim=32, layers=1, heads=2, head_dim=16, text_max_len=4)
    rollout.run_episodes(
        TinyWAM(cfg).eval(), Recording(2, chunks=2), specs, torch.zeros(40, 4, cfg.text_dim),
        torch.ones(40, 4, dtype=torch.bool), Normalizer.load(ROOT / "data" / "stats.json"),
        rollout.SamplerSettings(4, 0.5, 5.0), cap, 0, lambda i, d: None, torch.device("cpu"),
    )  # fmt: skip
    if cap is None:  # the long task first (one slot: tasks stay spread over the envs)
        assert started[0] == 30 and 30 not in started[4:], started
    else:  # equal budgets: the given order, the long task last
        assert started[:2] == [0, 10] and started[4:] == [30, 30], started


def test_batching_policy_alone() -> None:
    """rollout.Batching, no envs and no model: which waiting slots are answered now, in which
    batches, and how a batch is padded (fixed_batch)."""
    from wamrl.rollout import Batching

    waiting = {0: 5, 1: 2, 3: 7}  # slot -> arrival number: slot 1 waited longest
    # async: whoever waits, longest-waiting first, one batch of at most max_batch
    assert Batching().ready(waiting, running=4) == [[1, 0, 3]]
    assert Batching(max_batch=2).ready(waiting, running=4) == [[1, 0]]
    assert Batching().ready({}, running=4) == []
    # lockstep: nothing until every running episode waits, then all, in slot order
    assert Batching(lockstep=True, max_batch=2).ready(waiting, running=4) == []
    everyone = {**waiting, 2: 9}
    assert Batching(lockstep=True, max_batch=2).ready(everyone, running=4) == [[0, 1], [2, 3]]
    assert Batching(lockstep=True).ready(everyone, running=4) == [[0, 1, 2, 3]]
    # fixed_batch: padded to pad_to by repeating row 0; a full batch or no pad_to stays
    assert Batching(pad_to=4).rows(2) == [0, 1, 0, 0]
    assert Batching(pad_to=4).rows(4) is None and Batching().rows(2) is None


@pytest.mark.parametrize("fixed_batch", [False, True])
def test_kstar_max_holds_for_episodes_without_their_own_noise(fixed_batch: bool) -> None:
    """Episodes without a noise_seed draw from the run's generator: sampler.kstar_max still
    bounds their k*, padded batches included."""
    import wamrl.rollout as rollout
    from wamrl.envs.conventions import Normalizer
    from wamrl.envs.tasks import load_tasks
    from wamrl.policy.tiny import TinyConfig, TinyWAM

    cfg = TinyConfig(video_dim=32, action_dim=32, layers=1, heads=2, head_dim=16, text_max_len=4)
    task = load_tasks()[0]
    got: dict[int, object] = {}
    rollout.run_episodes(
        TinyWAM(cfg).eval(), _ScriptedPool(6, chunks=4), [rollout.EpisodeSpec(task, i, i) for i in range(5)],
        torch.zeros(40, 4, cfg.text_dim), torch.ones(40, 4, dtype=torch.bool),
        Normalizer.load(ROOT / "data" / "stats.json"),
        rollout.SamplerSettings(8, 0.5, 5.0, kstar_max=2), None, 0, got.__setitem__,
        torch.device("cpu"), fixed_batch=fixed_batch,
    )  # fmt: skip
    k_star = np.concatenate([d.k_star for d in got.values()])
    assert len(k_star) == 20 and set(k_star.tolist()) == {1, 2}
