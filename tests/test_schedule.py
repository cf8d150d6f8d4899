"""Which waiting episode a freed env slot runs next (rollout.next_spec)."""

from __future__ import annotations

from wamrl.rollout import next_spec


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
