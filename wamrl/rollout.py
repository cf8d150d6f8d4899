"""Run LIBERO episodes with a policy: queries batched over every env waiting for one.

Used by both the rollout stage (mixed ODE/SDE sampler, K = 8, a = 0.5) and the eval stage
(pure ODE, K = 20, a = 0, noise from a fixed per-episode seed). The loop:

    start an episode on every free env slot
    poll the pool: Query -> wait for a chunk; StepResult -> record the macro-step
    all waiting slots -> one batched prefill + K denoising steps -> send each its 10 actions
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from wamrl.envs.conventions import Normalizer, env_actions, image_to_model_input
from wamrl.envs.pool import Crashed, EnvPool, Query, StepResult
from wamrl.envs.tasks import Task
from wamrl.graphed import GraphedSampler
from wamrl.policy.base import PROPRIO_DIM, Obs, Policy
from wamrl.runtime import AMP_DTYPES, autocast, wait_sleeping
from wamrl.sampler import draw_kstar, sample_chunk
from wamrl.store import EpisodeData


@dataclass(frozen=True)
class EpisodeSpec:
    """What to run, decided before the episode starts."""

    task: Task
    init_state: int
    group: int
    record_video: bool = False
    # x_0 (and with a > 0, k* and the SDE noise) drawn from this seed's own generator, so an
    # episode's numbers do not depend on its env or batch (eval and rollout plans set it)
    noise_seed: int | None = None
    # eval.protocol official: the generator is reseeded with noise_seed before every query, so
    # every query starts from the same x_0 (Fast-WAM's eval: seed 42 at every infer_action)
    reseed_each_query: bool = False


@dataclass(frozen=True)
class SamplerSettings:
    K: int
    a: float
    shift: float
    cuda_graphs: bool = False  # replay each query as a CUDA graph (wamrl/graphed.py) on CUDA
    amp: torch.dtype | None = None  # sampler.amp: autocast dtype of the model (log pi stays fp32)
    max_batch: int | None = None  # sampler.max_batch: most queries answered in one batch
    compile: bool = False  # sampler.compile: graphs record torch.compile'd layers
    # x_k and the ODE step sizes in this dtype (a = 0 only): eval.protocol official on a bf16
    # model, as Fast-WAM's infer_action; float32 otherwise
    scheduler_dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(
        cls, s: dict[str, Any], K: int | None = None, a: float | None = None
    ) -> SamplerSettings:
        """The config's `sampler` section; K and a override its K and noise_a."""
        return cls(
            s["K"] if K is None else K, s["noise_a"] if a is None else a, s["shift"],
            s["cuda_graphs"], AMP_DTYPES[s["amp"]], s["max_batch"], s["compile"],
        )  # fmt: skip


@dataclass
class _Running:
    """One episode in flight on a slot."""

    index: int
    spec: EpisodeSpec
    generator: torch.Generator | None
    image: list[np.ndarray] = field(default_factory=list)
    proprio: list[np.ndarray] = field(default_factory=list)
    chain: list[np.ndarray] = field(default_factory=list)
    k_star: list[int] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    frames: list[np.ndarray] = field(default_factory=list)
    success: bool = False
    video: list[np.ndarray] = field(default_factory=list)
    video_proprio: list[np.ndarray] = field(default_factory=list)
    pending: tuple[np.ndarray, np.ndarray] | None = None  # the query waiting for a chunk
    waiting_since: int = 0  # arrival number of the pending query: the longest-waiting go first

    def finish(self, crashed: bool) -> EpisodeData:
        t = len(self.frames)  # completed macro-steps (a query without its chunk is dropped)
        r_task = np.zeros(t, np.float32)
        done = np.zeros(t, bool)
        if t:
            done[-1] = True
            r_task[-1] = float(self.success)
        video = self.video if self.spec.record_video and not crashed else None
        return EpisodeData(
            task=self.spec.task.index,
            init_state=self.spec.init_state,
            group=self.spec.group,
            success=self.success and not crashed,
            video_sft=video is not None,
            env_crashed=crashed,
            length=t,
            image=np.stack(self.image[:t]) if t else np.zeros((0, 224, 448, 3), np.uint8),
            proprio=np.stack(self.proprio[:t]).astype(np.float32)
            if t
            else np.zeros((0, 8), np.float32),
            chain=np.stack(self.chain[:t]) if t else np.zeros((0, 0, 32, 7), np.float32),
            k_star=np.asarray(self.k_star[:t], np.int32),
            logp_old=np.asarray(self.logp[:t], np.float32),
            frames=np.stack(self.frames) if t else np.zeros((0, 2, 224, 448, 3), np.uint8),
            r_task=r_task,
            done=done,
            video_frames=np.stack(video) if video else None,
            video_proprio=np.stack(self.video_proprio).astype(np.float32) if video else None,
        )


class LoggedProgress(Progress):
    """A rich Progress that also reports where no live bar can be drawn (a log file: Snakemake
    jobs, nohup), where rich would print the bar only when it stops: a plain line per task at
    most every `interval` seconds and when it completes."""

    def __init__(self, *columns: Any, interval: float = 60.0, **kwargs: Any):
        super().__init__(*columns, **kwargs)
        self.interval = interval
        self._printed: dict[TaskID, float] = {}

    def update(self, task_id: TaskID, **kwargs: Any) -> None:
        super().update(task_id, **kwargs)
        if self.console.is_terminal:
            return
        task = self._tasks[task_id]
        now, last = time.monotonic(), self._printed.get(task_id, -math.inf)
        if last == math.inf:  # its final line is out
            return
        if task.finished or now - last >= self.interval:
            self._printed[task_id] = math.inf if task.finished else now
            eta = task.time_remaining
            self.console.print(
                f"{task.description}: {task.completed:.0f}/{task.total:.0f} "
                f"{task.fields.get('info', '')}  elapsed {task.elapsed or 0:.0f} s"
                + ("" if eta is None or task.finished else f", ETA {eta:.0f} s")
            )


def progress_bar(interval: float = 60.0, console: Console | None = None) -> Progress:
    return LoggedProgress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        interval=interval,
        console=console,
    )


def load_for_queries(
    policy_dir: Path, device: torch.device
) -> tuple[Policy, torch.Tensor, torch.Tensor, Normalizer]:
    """What a stage that queries the policy reads from a policy dir: the model (eval mode),
    every task's text context and mask (on `device`), and the normaliser."""
    from wamrl.policy import load_policy
    from wamrl.policy.text import load_contexts

    policy = load_policy(policy_dir, device=device).eval()
    context, mask = load_contexts(policy_dir / "context.safetensors")
    return policy, context.to(device), mask.to(device), Normalizer.load(policy_dir / "stats.json")


@torch.no_grad()
def query_chunks(
    policy: Policy,
    obs: Obs,
    sampler: SamplerSettings,
    generator: torch.Generator | None,
    x0: torch.Tensor | None = None,
    k_star: torch.Tensor | None = None,
    xi: torch.Tensor | None = None,
):
    """One batched policy query: prefill the first-frame cache, then K denoising steps.
    x0, k_star, xi: per-row noise (else drawn from `generator`)."""
    with autocast(obs.image.device, sampler.amp):
        cache = policy.prefill(obs)
        return sample_chunk(
            policy, cache, obs.batch_size, sampler.K, sampler.a, sampler.shift, generator, x0=x0,
            k_star=k_star, xi=xi, scheduler_dtype=sampler.scheduler_dtype,
        )  # fmt: skip


def next_spec(todo_tasks: list[int], slot_task: int | None, busy_tasks: set[int]) -> int:
    """Which waiting episode a freed slot runs: one of the task its env already holds (no
    env to build: a LIBERO env takes seconds to create, and in lockstep every other env
    waits for it), else one of a task no running episode has (each task stays on one env),
    else the first waiting. Indices are into todo_tasks, the waiting episodes' tasks."""
    for want in (lambda t: t == slot_task, lambda t: t not in busy_tasks):
        for j, t in enumerate(todo_tasks):
            if want(t):
                return j
    return 0


def run_episodes(
    policy: Policy,
    pool: EnvPool,
    specs: list[EpisodeSpec],
    context: torch.Tensor,
    context_mask: torch.Tensor,
    normalizer: Normalizer,
    sampler: SamplerSettings,
    max_macro_steps: int | None,
    seed: int,
    on_episode: Callable[[int, EpisodeData], None],
    device: torch.device,
    description: str = "rollout",
    lockstep: bool = False,
    record_frames: bool = True,
    graphed: GraphedSampler | None = None,
    fixed_batch: bool = False,
) -> dict[str, float]:
    """Run every spec to completion on the pool; `on_episode(i, data)` gets each finished one.

    lockstep: answer only when every running episode waits, so each batch holds the same
    episodes on every rerun; otherwise whoever waits is answered at once (batch composition
    then follows process timing, which fixed_batch makes harmless).

    sampler.max_batch caps one query batch. Lockstep answers all waiting in batches of that
    size, in slot order; otherwise the longest-waiting are answered first and the rest in
    the next batch, so envs fall into groups that step while another group is queried.

    record_frames False (eval) skips rendering the +4/+8 frames that only the reward uses.

    fixed_batch (eval): every query batch is padded to the largest batch (the pool size or
    sampler.max_batch), repeating its first row. A row's result then depends only on its
    own inputs, not on which envs happened to wait with it (matmul kernels differ with the
    batch size, not with the other rows; on the CPU given one torch thread, as the stages
    set), so with per-episode noise seeds a rerun gives the same bits whatever the timing,
    async or lockstep (tests/test_stages.py, tests/test_graphed.py).

    A crashed env process ends its episode as failed and truncated (env_crashed); the pool
    restarts the process for the next episode and the run goes on.

    graphed: a GraphedSampler to reuse (e.g. already warmed up); by default one is made here
    when sampler.cuda_graphs and the device is CUDA, and its graphs are captured while the
    envs build and reset for their first episodes.

    Episodes start longest step budget first (libero_10 before the rest), so the long ones
    do not run alone at the end while the other envs idle.

    Returns counts (queries, batches, env_steps, crashed), first_query_s: the seconds until
    the first batch was answered (env builds, resets, graph capture), and answer_s: the
    seconds spent answering (policy queries, start to actions sent).
    """
    t_start = time.perf_counter()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    capture = graphed is None and sampler.cuda_graphs and torch.device(device).type == "cuda"
    capture = capture and sampler.scheduler_dtype == torch.float32  # graphs: float32 steps only
    largest = min(len(pool), sampler.max_batch or len(pool))
    if capture:
        graphed = GraphedSampler(
            policy,
            sampler.K,
            sampler.a,
            sampler.shift,
            largest,
            amp=sampler.amp,
            compile=sampler.compile,
            fixed_batch=fixed_batch,
        )
    replan = pool.replan
    step_cap = math.inf if max_macro_steps is None else max_macro_steps * replan
    todo = sorted(enumerate(specs), key=lambda item: -min(item[1].task.max_steps, step_cap))
    running: dict[int, _Running] = {}
    env_task: dict[int, int] = {}  # the task whose env each slot's process holds
    stats: dict[str, float] = {
        "queries": 0, "batches": 0, "env_steps": 0, "crashed": 0, "answer_s": 0.0
    }  # fmt: skip

    def start(slot: int) -> None:
        busy = {ep.spec.task.index for ep in running.values()}
        j = next_spec([s.task.index for _, s in todo], env_task.get(slot), busy)
        i, spec = todo.pop(j)
        env_task[slot] = spec.task.index
        gen = None
        if spec.noise_seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(spec.noise_seed)
        running[slot] = _Running(i, spec, gen)
        pool.start_episode(
            slot, spec.task, spec.init_state, spec.record_video, max_macro_steps, record_frames
        )

    with progress_bar() as bar:
        job = bar.add_task(description, total=len(specs), info="")
        for slot in range(min(len(pool), len(todo))):
            start(slot)
        if capture:  # one throwaway query per batch bucket, while the envs build
            image, proprio = torch.zeros(1, 3, 224, 448), torch.zeros(1, PROPRIO_DIM)
            graphed.warm_up(Obs(image, proprio, context[:1], context_mask[:1]).to(device))
        done_count = successes = arrivals = 0
        while running:
            # Queries left unanswered by the batch cap: look for news without blocking.
            backlog = any(ep.pending is not None for ep in running.values())
            events = pool.poll(timeout=0.0 if backlog else None)
            events += pool.poll(timeout=0.0)
            for ev in events:
                ep = running.get(ev.slot)
                if ep is None:
                    continue
                if isinstance(ev, Query):
                    ep.pending = (ev.image, normalizer.normalize_state(ev.proprio_raw))
                    ep.waiting_since, arrivals = arrivals, arrivals + 1
                    if ep.spec.record_video and not ep.video:
                        ep.video.append(ev.image)
                        ep.video_proprio.append(ev.proprio_raw)
                    continue
                if isinstance(ev, StepResult):
                    ep.frames.append(ev.frames)
                    ep.success = ep.success or ev.success
                    stats["env_steps"] += ev.env_steps
                    if ev.video is not None:
                        ep.video.extend(ev.video)
                        ep.video_proprio.extend(ev.video_proprio)
                    if not ev.done:
                        continue
                    crashed = False
                elif isinstance(ev, Crashed):
                    crashed = True
                    stats["crashed"] += 1
                    env_task.pop(ev.slot, None)  # a fresh process builds its env anew
                    last = ev.error.strip().splitlines()[-1] if ev.error.strip() else "?"
                    bar.console.print(
                        f"[yellow]env crashed: task {ep.spec.task.index}, init state "
                        f"{ep.spec.init_state}, macro-step {len(ep.frames)}: {last}"
                    )
                else:  # pragma: no cover - the pool has three event kinds
                    raise TypeError(f"unknown pool event {ev!r}")
                data = ep.finish(crashed)
                on_episode(ep.index, data)
                del running[ev.slot]
                done_count += 1
                successes += int(data.success)
                bar.update(job, advance=1, info=f"success {successes}/{done_count}")
                if todo:
                    start(ev.slot)
            waiting = [s for s, ep in running.items() if ep.pending is not None]
            if waiting and (not lockstep or len(waiting) == len(running)):
                if lockstep:
                    waiting.sort()
                else:
                    waiting.sort(key=lambda s: running[s].waiting_since)
                cap = sampler.max_batch or len(waiting)
                parts = [waiting[i : i + cap] for i in range(0, len(waiting), cap)]
                for part in parts if lockstep else parts[:1]:
                    t0 = time.perf_counter()
                    _answer(
                        policy,
                        pool,
                        running,
                        part,
                        context,
                        context_mask,
                        normalizer,
                        sampler,
                        generator,
                        device,
                        replan,
                        graphed,
                        pad_to=largest if fixed_batch else None,
                    )
                    stats["answer_s"] += time.perf_counter() - t0
                    stats["queries"] += len(part)
                    stats["batches"] += 1
                    stats.setdefault("first_query_s", time.perf_counter() - t_start)
    return stats


def _episode_noise(ep: _Running, K: int, a: float) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(x_0 [32, 7], k*, xi [32, 7]) of an episode's next query from its own generator: the
    same numbers whichever env or batch the query lands in. x_0 first, so a = 0 (eval) draws
    exactly one randn per query; with reseed_each_query the generator restarts every query
    (every query starts from the same x_0)."""
    if ep.spec.reseed_each_query:
        ep.generator.manual_seed(ep.spec.noise_seed)
    x0 = torch.randn(32, 7, generator=ep.generator)
    if a <= 0:
        return x0, 0, torch.zeros(32, 7)
    k_star = int(draw_kstar(1, K, ep.generator)[0])
    return x0, k_star, torch.randn(32, 7, generator=ep.generator)


def _answer(
    policy: Policy,
    pool: EnvPool,
    running: dict[int, _Running],
    slots: list[int],
    context: torch.Tensor,
    context_mask: torch.Tensor,
    normalizer: Normalizer,
    sampler: SamplerSettings,
    generator: torch.Generator,
    device: torch.device,
    replan: int,
    graphed: GraphedSampler | None = None,
    pad_to: int | None = None,
) -> None:
    eps = [running[s] for s in slots]
    images = np.stack([ep.pending[0] for ep in eps])
    proprio = np.stack([ep.pending[1] for ep in eps]).astype(np.float32)
    tasks = torch.as_tensor([ep.spec.task.index for ep in eps])
    obs = Obs(
        # uint8 to the device, converted there: a quarter of the bytes, no CPU float pass
        image_to_model_input(torch.from_numpy(images).to(device)),
        torch.from_numpy(proprio),
        context[tasks],
        context_mask[tasks],
    ).to(device)
    x0 = k_star = xi = None
    if all(ep.generator is not None for ep in eps):  # per-episode reproducible noise
        noise = [_episode_noise(ep, sampler.K, sampler.a) for ep in eps]
        x0 = torch.stack([n[0] for n in noise]).to(device)
        k_star = torch.tensor([n[1] for n in noise], dtype=torch.long)
        xi = torch.stack([n[2] for n in noise])
    if pad_to is not None and pad_to > len(eps):  # fixed_batch: the padding repeats row 0
        rows = torch.tensor([*range(len(eps)), *[0] * (pad_to - len(eps))], device=device)
        obs = Obs(obs.image[rows], obs.proprio[rows], obs.context[rows], obs.context_mask[rows])
        if x0 is not None:
            x0, k_star, xi = x0[rows], k_star[rows.cpu()], xi[rows.cpu()]
    if graphed is not None:
        out = graphed.query(obs, generator, x0=x0, k_star=k_star, xi=xi)
    else:
        out = query_chunks(policy, obs, sampler, generator, x0=x0, k_star=k_star, xi=xi)
    wait_sleeping(device)  # the copies below would spin a core that an env needs
    chain = out.chain.float().cpu().numpy()
    k_star = out.k_star.cpu().numpy()
    logp = out.logp.float().cpu().numpy()
    for j, (slot, ep) in enumerate(zip(slots, eps, strict=True)):
        ep.image.append(ep.pending[0])
        ep.proprio.append(ep.pending[1])
        ep.chain.append(chain[j])
        ep.k_star.append(int(k_star[j]))
        ep.logp.append(float(logp[j]))
        ep.pending = None
        pool.send_chunk(slot, env_actions(chain[j, -1], normalizer, replan))
