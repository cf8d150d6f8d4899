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
from typing import NamedTuple

import numpy as np
import torch
from rich.console import Console

from wamrl.config import SamplerSection
from wamrl.contract import ACTION_DIM, CHUNK_LEN, IMAGE_HW, N_FUTURE, PROPRIO_DIM
from wamrl.envs.conventions import Normalizer, env_actions, image_to_model_input
from wamrl.envs.pool import Crashed, EnvPool, Event, Query, StepResult
from wamrl.graphed import GraphedSampler
from wamrl.plan import EpisodeSpec
from wamrl.policy.base import Obs, Policy
from wamrl.progress import progress_bar
from wamrl.runtime import AMP_DTYPES, autocast, wait_sleeping
from wamrl.sampler import draw_kstar, sample_chunk
from wamrl.store import EpisodeData


@dataclass(frozen=True)
class SamplerSettings:
    K: int
    a: float
    shift: float
    cuda_graphs: bool = False  # replay each query as a CUDA graph (wamrl/graphed.py) on CUDA
    amp: torch.dtype | None = None  # sampler.amp: autocast dtype of the model (log pi stays fp32)
    max_batch: int | None = None  # sampler.max_batch: most queries answered in one batch
    compile: bool = False  # sampler.compile: graphs record torch.compile'd layers
    kstar_max: int | None = None  # sampler.kstar_max: k* ~ U{1..kstar_max} (None = K - 1)
    # x_k and the ODE step sizes in this dtype (a = 0 only): eval.protocol official on a bf16
    # model, as Fast-WAM's infer_action; float32 otherwise
    scheduler_dtype: torch.dtype = torch.float32

    @classmethod
    def from_config(
        cls, s: SamplerSection, K: int | None = None, a: float | None = None
    ) -> SamplerSettings:
        """The config's `sampler` section; K and a override its K and noise_a."""
        return cls(
            s.K if K is None else K, s.noise_a if a is None else a, s.shift, s.cuda_graphs,
            AMP_DTYPES[s.amp], s.max_batch, s.compile, kstar_max=s.kstar_max,
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
            image=np.stack(self.image[:t]) if t else np.zeros((0, *IMAGE_HW, 3), np.uint8),
            proprio=np.stack(self.proprio[:t]).astype(np.float32)
            if t
            else np.zeros((0, PROPRIO_DIM), np.float32),
            chain=np.stack(self.chain[:t])
            if t
            else np.zeros((0, 0, CHUNK_LEN, ACTION_DIM), np.float32),
            k_star=np.asarray(self.k_star[:t], np.int32),
            logp_old=np.asarray(self.logp[:t], np.float32),
            frames=np.stack(self.frames) if t else np.zeros((0, N_FUTURE, *IMAGE_HW, 3), np.uint8),
            r_task=r_task,
            done=done,
            video_frames=np.stack(video) if video else None,
            video_proprio=np.stack(self.video_proprio).astype(np.float32) if video else None,
        )


class QueryModel(NamedTuple):
    """What a stage that queries the policy reads from a policy dir (a tuple, so it unpacks as
    `policy, context, context_mask, normalizer`)."""

    policy: Policy  # in eval mode
    context: torch.Tensor  # every task's text context, on the query device
    context_mask: torch.Tensor
    normalizer: Normalizer


def load_for_queries(policy_dir: Path, device: torch.device) -> QueryModel:
    """The model (eval mode), every task's text context and mask (on `device`), and the
    normaliser of a policy dir."""
    from wamrl.policy import load_policy
    from wamrl.policy.text import load_contexts

    policy = load_policy(policy_dir, device=device).eval()
    context, mask = load_contexts(policy_dir / "context.safetensors")
    return QueryModel(
        policy, context.to(device), mask.to(device), Normalizer.load(policy_dir / "stats.json")
    )


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
            kstar_max=sampler.kstar_max,
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


@dataclass(frozen=True)
class Batching:
    """When waiting queries are answered, and in which batches (no envs, no model: tests
    drive it alone).

    lockstep: answer only when every running episode waits, so each batch holds the same
    episodes on every rerun: all of them, in slot order, in batches of max_batch. Otherwise
    whoever waits is answered at once, longest-waiting first, at most max_batch of them; the
    rest go in a later batch, so envs fall into groups that step while another group is
    queried (batch composition then follows process timing, which pad_to makes harmless).

    pad_to (eval's fixed_batch): every batch is padded to this many rows, repeating its first
    row. A row's result then depends only on its own inputs, not on which envs happened to
    wait with it (matmul kernels differ with the batch size, not with the other rows; on the
    CPU given one torch thread, as the stages set), so with per-episode noise seeds a rerun
    gives the same bits whatever the timing, async or lockstep.
    """

    lockstep: bool = False
    max_batch: int | None = None
    pad_to: int | None = None

    def ready(self, waiting: dict[int, int], running: int) -> list[list[int]]:
        """The batches of slots to answer now, in order. waiting: slot -> arrival number of
        its pending query (smaller waited longer); running: how many episodes run."""
        if not waiting or (self.lockstep and len(waiting) < running):
            return []
        order = sorted(waiting) if self.lockstep else sorted(waiting, key=waiting.__getitem__)
        cap = self.max_batch or len(order)
        parts = [order[i : i + cap] for i in range(0, len(order), cap)]
        return parts if self.lockstep else parts[:1]

    def rows(self, n: int) -> list[int] | None:
        """The rows a batch of n becomes: row 0 repeated up to pad_to; None: as it is."""
        if self.pad_to is None or self.pad_to <= n:
            return None
        return [*range(n), *[0] * (self.pad_to - n)]


class EpisodeRunner:
    """Runs a list of episodes on a pool to completion: `start` an episode on a free slot,
    `on_event` for each pool event (a query waits, a macro-step is recorded, an episode ends),
    `answer_ready` to answer the queries `Batching` says are due. `run` is the loop.

    A crashed env process ends its episode as failed and truncated (env_crashed); the pool
    restarts the process for the next episode and the run goes on.

    Episodes start longest step budget first (libero_10 before the rest), so the long ones
    do not run alone at the end while the other envs idle.
    """

    def __init__(
        self,
        model: QueryModel,
        pool: EnvPool,
        specs: list[EpisodeSpec],
        sampler: SamplerSettings,
        batching: Batching,
        on_episode: Callable[[int, EpisodeData], None],
        device: torch.device,
        max_macro_steps: int | None = None,
        seed: int = 0,
        record_frames: bool = True,
        graphed: GraphedSampler | None = None,
    ):
        """record_frames False (eval) skips rendering the +4/+8 frames only the reward uses.
        seed: the run's generator, for episodes without their own noise_seed.
        graphed: a GraphedSampler to reuse (e.g. already warmed up); by default one is made
        here when sampler.cuda_graphs and the device is CUDA, and its graphs are captured
        while the envs build and reset for their first episodes."""
        self.t_start = time.perf_counter()
        self.model, self.pool, self.sampler, self.batching = model, pool, sampler, batching
        self.on_episode, self.device = on_episode, device
        self.max_macro_steps, self.record_frames = max_macro_steps, record_frames
        self.generator = torch.Generator(device="cpu").manual_seed(seed)
        capture = graphed is None and sampler.cuda_graphs and torch.device(device).type == "cuda"
        self.capture = capture and sampler.scheduler_dtype == torch.float32  # float32 steps only
        if self.capture:
            graphed = GraphedSampler(
                model.policy,
                sampler.K,
                sampler.a,
                sampler.shift,
                batching.pad_to or min(len(pool), sampler.max_batch or len(pool)),
                amp=sampler.amp,
                compile=sampler.compile,
                fixed_batch=batching.pad_to is not None,
                kstar_max=sampler.kstar_max,
            )
        self.graphed = graphed
        step_cap = math.inf if max_macro_steps is None else max_macro_steps * pool.replan
        self.todo = sorted(
            enumerate(specs), key=lambda item: -min(item[1].task.max_steps, step_cap)
        )
        self.running: dict[int, _Running] = {}
        self.env_task: dict[int, int] = {}  # the task whose env each slot's process holds
        self.arrivals = 0
        self.console: Console | None = None
        self.stats: dict[str, float] = {
            "queries": 0, "batches": 0, "env_steps": 0, "crashed": 0, "answer_s": 0.0
        }  # fmt: skip

    def start(self, slot: int) -> None:
        """Start the next waiting episode on a free slot (next_spec picks which)."""
        busy = {ep.spec.task.index for ep in self.running.values()}
        j = next_spec([s.task.index for _, s in self.todo], self.env_task.get(slot), busy)
        i, spec = self.todo.pop(j)
        self.env_task[slot] = spec.task.index
        gen = None
        if spec.noise_seed is not None:
            gen = torch.Generator(device="cpu").manual_seed(spec.noise_seed)
        self.running[slot] = _Running(i, spec, gen)
        self.pool.start_episode(
            slot, spec.task, spec.init_state, spec.record_video, self.max_macro_steps,
            self.record_frames,
        )  # fmt: skip

    def on_event(self, ev: Event) -> EpisodeData | None:
        """Record one pool event; an episode that ends goes to on_episode, its slot starts the
        next waiting one, and its data is returned."""
        ep = self.running.get(ev.slot)
        if ep is None:
            return None
        if isinstance(ev, Query):
            ep.pending = (ev.image, self.model.normalizer.normalize_state(ev.proprio_raw))
            ep.waiting_since, self.arrivals = self.arrivals, self.arrivals + 1
            if ep.spec.record_video and not ep.video:
                ep.video.append(ev.image)
                ep.video_proprio.append(ev.proprio_raw)
            return None
        if isinstance(ev, StepResult):
            ep.frames.append(ev.frames)
            ep.success = ep.success or ev.success
            self.stats["env_steps"] += ev.env_steps
            if ev.video is not None:
                ep.video.extend(ev.video)
                ep.video_proprio.extend(ev.video_proprio)
            if not ev.done:
                return None
            crashed = False
        elif isinstance(ev, Crashed):
            crashed = True
            self.stats["crashed"] += 1
            self.env_task.pop(ev.slot, None)  # a fresh process builds its env anew
            last = ev.error.strip().splitlines()[-1] if ev.error.strip() else "?"
            (self.console or Console(stderr=True)).print(
                f"[yellow]env crashed: task {ep.spec.task.index}, init state "
                f"{ep.spec.init_state}, macro-step {len(ep.frames)}: {last}"
            )
        else:  # pragma: no cover - the pool has three event kinds
            raise TypeError(f"unknown pool event {ev!r}")
        data = ep.finish(crashed)
        del self.running[ev.slot]
        if self.todo:  # first, so the env resets while on_episode may still block
            self.start(ev.slot)
        self.on_episode(ep.index, data)
        return data

    def answer_ready(self) -> None:
        """Answer the waiting queries that are due, batch by batch."""
        waiting = {s: ep.waiting_since for s, ep in self.running.items() if ep.pending is not None}
        for part in self.batching.ready(waiting, len(self.running)):
            t0 = time.perf_counter()
            _answer(
                self.model, self.pool, self.running, part, self.sampler, self.generator,
                self.device, self.graphed, self.batching.rows(len(part)),
            )  # fmt: skip
            self.stats["answer_s"] += time.perf_counter() - t0
            self.stats["queries"] += len(part)
            self.stats["batches"] += 1
            self.stats.setdefault("first_query_s", time.perf_counter() - self.t_start)

    def run(self, description: str = "rollout") -> dict[str, float]:
        """Run every episode; returns counts (queries, batches, env_steps, crashed),
        first_query_s: the seconds until the first batch was answered (env builds, resets,
        graph capture), and answer_s: the seconds spent answering (policy queries, start to
        actions sent)."""
        with progress_bar() as bar:
            self.console = bar.console
            job = bar.add_task(description, total=len(self.todo), info="")
            for slot in range(min(len(self.pool), len(self.todo))):
                self.start(slot)
            if self.capture and self.graphed is not None:  # a throwaway query per batch bucket
                m = self.model  # ... captured while the envs build
                image, proprio = torch.zeros(1, 3, *IMAGE_HW), torch.zeros(1, PROPRIO_DIM)
                obs = Obs(image, proprio, m.context[:1], m.context_mask[:1]).to(self.device)
                self.graphed.warm_up(obs)
            done = successes = 0
            while self.running:
                # Queries left unanswered by the batch cap: look for news without blocking.
                backlog = any(ep.pending is not None for ep in self.running.values())
                events = self.pool.poll(timeout=0.0 if backlog else None)
                events += self.pool.poll(timeout=0.0)
                for ev in events:
                    data = self.on_event(ev)
                    if data is not None:
                        done, successes = done + 1, successes + int(data.success)
                        bar.update(job, advance=1, info=f"success {successes}/{done}")
                self.answer_ready()
        return self.stats


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
    """Run every spec to completion on the pool (EpisodeRunner); `on_episode(i, data)` gets
    each finished one. lockstep and fixed_batch: see Batching (fixed_batch pads every batch
    to the largest, the pool size or sampler.max_batch); sampler.max_batch caps one batch.
    Returns EpisodeRunner.run's stats."""
    largest = min(len(pool), sampler.max_batch or len(pool))
    batching = Batching(lockstep, sampler.max_batch, largest if fixed_batch else None)
    model = QueryModel(policy, context, context_mask, normalizer)
    runner = EpisodeRunner(
        model, pool, specs, sampler, batching, on_episode, device, max_macro_steps, seed,
        record_frames, graphed,
    )  # fmt: skip
    return runner.run(description)


def _episode_noise(
    ep: _Running, K: int, a: float, kstar_max: int | None = None
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(x_0 [32, 7], k*, xi [32, 7]) of an episode's next query from its own generator: the
    same numbers whichever env or batch the query lands in. x_0 first, so a = 0 (eval) draws
    exactly one randn per query; with reseed_each_query the generator restarts every query
    (every query starts from the same x_0)."""
    if ep.spec.reseed_each_query:
        ep.generator.manual_seed(ep.spec.noise_seed)
    x0 = torch.randn(CHUNK_LEN, ACTION_DIM, generator=ep.generator)
    if a <= 0:
        return x0, 0, torch.zeros(CHUNK_LEN, ACTION_DIM)
    k_star = int(draw_kstar(1, K, ep.generator, high=kstar_max)[0])
    return x0, k_star, torch.randn(CHUNK_LEN, ACTION_DIM, generator=ep.generator)


def _answer(
    model: QueryModel,
    pool: EnvPool,
    running: dict[int, _Running],
    slots: list[int],
    sampler: SamplerSettings,
    generator: torch.Generator,
    device: torch.device,
    graphed: GraphedSampler | None = None,
    rows: list[int] | None = None,
) -> None:
    """One batched query for `slots`; each gets its chunk. rows: Batching.rows' padding."""
    eps = [running[s] for s in slots]
    images = np.stack([ep.pending[0] for ep in eps])
    proprio = np.stack([ep.pending[1] for ep in eps]).astype(np.float32)
    tasks = torch.as_tensor([ep.spec.task.index for ep in eps])
    obs = Obs(
        # uint8 to the device, converted there: a quarter of the bytes, no CPU float pass
        image_to_model_input(torch.from_numpy(images).to(device)),
        torch.from_numpy(proprio),
        model.context[tasks],
        model.context_mask[tasks],
    ).to(device)
    x0 = k_star = xi = None
    if all(ep.generator is not None for ep in eps):  # per-episode reproducible noise
        noise = [_episode_noise(ep, sampler.K, sampler.a, sampler.kstar_max) for ep in eps]
        x0 = torch.stack([n[0] for n in noise]).to(device)
        k_star = torch.tensor([n[1] for n in noise], dtype=torch.long)
        xi = torch.stack([n[2] for n in noise])
    if rows is not None:  # fixed_batch: the padding repeats row 0
        index = torch.tensor(rows, device=device)
        obs = Obs(obs.image[index], obs.proprio[index], obs.context[index], obs.context_mask[index])
        if x0 is not None:
            x0, k_star, xi = x0[index], k_star[index.cpu()], xi[index.cpu()]
    if graphed is not None:
        out = graphed.query(obs, generator, x0=x0, k_star=k_star, xi=xi)
    else:
        out = query_chunks(model.policy, obs, sampler, generator, x0=x0, k_star=k_star, xi=xi)
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
        pool.send_chunk(slot, env_actions(chain[j, -1], model.normalizer, pool.replan))
