"""Policy query latency and throughput of the tiny backend (not a test).

    python bench/bench_policy.py                          # batch 1 and 16, K 8, 2 threads, CPU
    python bench/bench_policy.py --batch 16 --threads 2 --repeats 50
    python bench/bench_policy.py --video-dim 64 --layers 2  # other model dims
    python bench/bench_policy.py --device cuda            # where a GPU is available; adds the
                                                          # CUDA-graph query (wamrl/graphed.py),
                                                          # float32 and bf16 (sampler.amp)

A query is what the rollout does once per macro-step for a batch of envs: prefill the
first-frame K/V cache (image autoencoder + video expert on one frame), then K denoising
steps of the action expert with the mixed ODE/SDE sampler (sample_chunk, a = 0.5). Model
dims default to configs/default.yaml's policy.tiny (and world_model.lora_rank); weights are
random (latency does not depend on them). The table also splits the query into its parts:
the autoencoder's encode, the whole prefill, and one velocity step, so it says which is slow.
Throughput: queries/s counts batched calls; env-queries/s = batch x calls/s; env-actions/s =
env-queries/s x env.replan_steps (10 by default: a chunk drives 10 env steps).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from rich.console import Console
from rich.table import Table

from wamrl.config import load_config
from wamrl.contract import ACTION_DIM, CHUNK_LEN, PROPRIO_DIM
from wamrl.graphed import GraphedSampler
from wamrl.policy.base import Obs
from wamrl.policy.tiny import TinyWAM, build_tiny
from wamrl.runtime import wait_sleeping
from wamrl.sampler import sample_chunk

DIMS = ("video_dim", "action_dim", "layers", "heads", "head_dim", "latent_channels", "ffn_mult")


def timed(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> list[float]:
    """Wall-clock milliseconds of `repeats` calls of fn after `warmup` untimed calls."""
    out = []
    for i in range(warmup + repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def cpu_per_query(fn: Callable[[], object], device: torch.device, sleep: bool, n: int) -> float:
    """CPU milliseconds this process spends per call of fn, waiting for the GPU either by
    synchronising (CUDA spins the core) or by wait_sleeping (the rollout's way)."""
    wait = (lambda: wait_sleeping(device)) if sleep else (lambda: torch.cuda.synchronize(device))
    fn()
    wait()
    t0 = time.process_time()
    for _ in range(n):
        fn()
        wait()
    return (time.process_time() - t0) / n * 1e3


def p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10, method="inclusive")[-1] if len(xs) > 1 else xs[0]


def random_obs(model: TinyWAM, batch: int, text_len: int, device: torch.device) -> Obs:
    g = torch.Generator().manual_seed(0)
    return Obs(
        image=torch.rand(batch, 3, 224, 448, generator=g) * 2 - 1,
        proprio=torch.rand(batch, PROPRIO_DIM, generator=g) * 2 - 1,
        context=torch.randn(batch, text_len, model.cfg.text_dim, generator=g),
        context_mask=torch.ones(batch, text_len, dtype=torch.bool),
    ).to(device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="envs per query")
    p.add_argument("--K", type=int, default=None, help="denoising steps (default sampler.K)")
    p.add_argument(
        "--a", type=float, default=None, help="SDE noise level (default sampler.noise_a)"
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph column")
    p.add_argument("--config", nargs="*", default=[], help="YAML files over default.yaml")
    for key in DIMS:
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, dest=key)
    p.add_argument("--lora-rank", type=int, default=None)
    p.add_argument("--profile", type=int, default=0, help="CUDA: profile one query of this batch")
    p.add_argument("--compile", action="store_true", help="CUDA: a bf16 graph column with "
                   "torch.compile'd layers (sampler.compile)")  # fmt: skip
    args = p.parse_args()

    overrides: dict[str, object] = {}
    for key in DIMS:
        if getattr(args, key) is not None:
            overrides[f"policy.tiny.{key}"] = getattr(args, key)
    if args.lora_rank is not None:
        overrides["world_model.lora_rank"] = args.lora_rank
    cfg = load_config(args.config, overrides)
    K = args.K if args.K is not None else int(cfg["sampler"]["K"])
    a = args.a if args.a is not None else float(cfg["sampler"]["noise_a"])
    shift = float(cfg["sampler"]["shift"])
    replan = int(cfg["env"]["replan_steps"])
    text_len = int(cfg["policy"]["tiny"]["text_max_len"])

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is available here")
    torch.manual_seed(0)
    # Matmuls stay full float32 (no TF32), as in the rollout stage: bf16 is its own column.
    with device:  # full-size weights are made on the GPU, not copied there
        model = build_tiny(cfg).eval()
    n_params = sum(p.numel() for p in model.parameters())

    console = Console()
    tc = model.cfg
    console.print(
        f"tiny: video_dim {tc.video_dim}, action_dim {tc.action_dim}, layers {tc.layers}, "
        f"ffn x{tc.ffn_mult}, "
        f"heads {tc.heads} x {tc.head_dim}, latent_channels {tc.latent_channels}, "
        f"lora_rank {tc.lora_rank}, text {text_len} x {tc.text_dim}; {n_params / 1e6:.2f} M params"
    )
    console.print(
        f"device {device}, threads {torch.get_num_threads()}, K {K}, a {a}, shift {shift}, "
        f"repeats {args.repeats} (+{args.warmup} warm-up), torch {torch.__version__}"
    )

    table = Table(title="policy query = prefill + K denoising steps (sample_chunk)")
    for col in (
        "batch",
        "query ms (median)",
        "query ms (p90)",
        "AE encode ms",
        "prefill ms",
        "velocity ms / step",
        "K x velocity ms",
        "queries/s",
        "env-queries/s",
        "env-actions/s",
    ):
        table.add_column(col, justify="right")
    graphs = device.type == "cuda" and not args.no_graphs
    if graphs:  # the rollout's path on CUDA: the same query replayed as a CUDA graph
        table.add_column("CUDA-graph query ms (median)", justify="right")
        table.add_column("graph speed-up", justify="right")
        table.add_column("bf16 CUDA-graph query ms (median)", justify="right")
        table.add_column("... casting weights per call", justify="right")
        graphed = GraphedSampler(model, K, a, shift, max(args.batch))
        graphed_bf16 = GraphedSampler(model, K, a, shift, max(args.batch), amp=torch.bfloat16)
        recast_bf16 = GraphedSampler(
            model, K, a, shift, max(args.batch), amp=torch.bfloat16, cast_once=False
        )
        if args.compile:
            table.add_column("bf16 graph, compiled layers", justify="right")
            compiled_bf16 = GraphedSampler(
                model, K, a, shift, max(args.batch), amp=torch.bfloat16, compile=True
            )

    for b in args.batch:
        obs = random_obs(model, b, text_len, device)
        gen = torch.Generator().manual_seed(1)
        with torch.inference_mode():
            cache = model.prefill(obs)
            x = torch.randn(b, CHUNK_LEN, ACTION_DIM, device=device)
            sigma = torch.full((b,), 0.5, device=device)

            def query(obs=obs, b=b, gen=gen) -> None:
                sample_chunk(model, model.prefill(obs), b, K, a, shift, gen)

            q = timed(query, device, args.warmup, args.repeats)
            if graphs:
                gq = timed(
                    lambda obs=obs, gen=gen: graphed.query(obs, gen), device, 2, args.repeats
                )
                gq16 = timed(
                    lambda obs=obs, gen=gen: graphed_bf16.query(obs, gen), device, 2, args.repeats
                )
                gq16r = timed(
                    lambda obs=obs, gen=gen: recast_bf16.query(obs, gen), device, 2, args.repeats
                )
                if args.compile:
                    t0 = time.perf_counter()
                    compiled_bf16.query(obs, gen)
                    console.print(f"batch {b}: compile + capture {time.perf_counter() - t0:.1f} s")
                    gqc = timed(
                        lambda obs=obs, gen=gen: compiled_bf16.query(obs, gen), device, 2,
                        args.repeats,
                    )  # fmt: skip
                spin, sleep = (
                    cpu_per_query(lambda obs=obs, gen=gen: graphed_bf16.query(obs, gen),
                                  device, sleeping, args.repeats)
                    for sleeping in (False, True)
                )  # fmt: skip
                console.print(
                    f"batch {b}: policy-process CPU per bf16 graph query: {spin:.1f} ms when "
                    f"synchronising (spins), {sleep:.1f} ms with wait_sleeping (the rollout's)"
                )
                ref = sample_chunk(
                    model, model.prefill(obs), b, K, a, shift, torch.Generator().manual_seed(5)
                )
                checks = [("CUDA graph", graphed), ("bf16 CUDA graph", graphed_bf16)]
                if args.compile:
                    checks.append(("compiled bf16 CUDA graph", compiled_bf16))
                for name, g in checks:
                    out = g.query(obs, torch.Generator().manual_seed(5))
                    console.print(
                        f"batch {b}: {name} vs eager fp32, same noise: max |chain diff| "
                        f"{(out.chain - ref.chain).abs().max():.2e}, max |log pi diff| "
                        f"{(out.logp - ref.logp).abs().max():.2e}, graphs captured {g.captures}"
                    )
            enc = timed(lambda obs=obs: model.ae.encode(obs.image), device, 1, args.repeats)
            pre = timed(lambda obs=obs: model.prefill(obs), device, 1, args.repeats)
            vel = timed(
                lambda c=cache, x=x, s=sigma: model.velocity(c, x, s),
                device,
                1,
                max(args.repeats, 3 * K),
            )
        med = statistics.median(q)
        calls = 1e3 / med
        v_med = statistics.median(vel)
        table.add_row(
            str(b),
            f"{med:.1f}",
            f"{p90(q):.1f}",
            f"{statistics.median(enc):.1f}",
            f"{statistics.median(pre):.1f}",
            f"{v_med:.2f}",
            f"{K * v_med:.1f}",
            f"{calls:.1f}",
            f"{b * calls:.1f}",
            f"{b * calls * replan:.0f}",
            *(
                [
                    f"{statistics.median(gq):.2f}",
                    f"{med / statistics.median(gq):.1f}x",
                    f"{statistics.median(gq16):.2f}",
                    f"{statistics.median(gq16r):.2f}",
                    *([f"{statistics.median(gqc):.2f}"] if args.compile else []),
                ]
                if graphs
                else []
            ),
        )
    console.print(table)
    if args.profile:  # where a query's GPU time goes, by op (eager, so each op is visible)
        from torch.profiler import ProfilerActivity, profile

        from wamrl.rollout import SamplerSettings, query_chunks

        obs = random_obs(model, args.profile, text_len, device)
        for amp in (None, torch.bfloat16):
            settings = SamplerSettings(K, a, shift, amp=amp)
            query_chunks(model, obs, settings, torch.Generator().manual_seed(0))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                query_chunks(model, obs, settings, torch.Generator().manual_seed(0))
                torch.cuda.synchronize(device)
            console.print(f"eager query, batch {args.profile}, amp {amp}: top ops by GPU time")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))


if __name__ == "__main__":
    main()
