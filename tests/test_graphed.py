"""The graph-ready query path reproduces prefill + sample_chunk exactly (run eagerly on CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import make_obs, make_tiny_policy
from wamrl.graphed import GraphedSampler, draw_noise
from wamrl.policy.base import Obs
from wamrl.policy.tiny import TinyConfig, TinyWAM
from wamrl.sampler import sample_chunk

# Two layers at the default text dims: a 384-wide context (every row's 5 tokens real).
CFG = TinyConfig(video_dim=64, action_dim=32, layers=2, heads=2, head_dim=16)


def _policy_and_obs(batch: int) -> tuple[TinyWAM, Obs]:
    policy = make_tiny_policy(config=CFG).eval()
    return policy, make_obs(1, batch, ctx_len=5, text_dim=CFG.text_dim, row0_len=None)


@pytest.mark.parametrize("a", [0.0, 0.5])
def test_static_path_equals_sample_chunk(a: float) -> None:
    policy, obs = _policy_and_obs(6)
    sampler = GraphedSampler(policy, K=8, a=a, shift=5.0, max_batch=8)
    with torch.no_grad():
        ref = sample_chunk(
            policy, policy.prefill(obs), 6, 8, a, 5.0, torch.Generator().manual_seed(7)
        )
    out = sampler.query(obs, torch.Generator().manual_seed(7))
    assert torch.equal(out.k_star, ref.k_star)
    torch.testing.assert_close(out.chain, ref.chain, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logp, ref.logp, rtol=0, atol=1e-4)
    if a > 0:
        assert (out.logp != 0).all()  # every row had its SDE step


def _per_row_noise(n: int, K: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    x0 = torch.randn(n, 32, 7, generator=g)
    return x0, torch.randint(1, K, (n,), generator=g), torch.randn(n, 32, 7, generator=g)


def test_per_row_noise_by_hand_and_through_the_graph_path() -> None:
    """Per-episode noise (wamrl.rollout): rows carry their own x_0, k* and SDE noise xi.
    The SDE step is mu + std * xi at k* (checked by hand on one row), the static (graph)
    path gives sample_chunk's numbers, and no generator is drawn from."""
    from wamrl.sampler import gaussian_log_prob, sde_mean_std, sigma_schedule

    policy, obs = _policy_and_obs(4)
    K, a = 6, 0.5
    x0, k_star, xi = _per_row_noise(4, K)
    with torch.no_grad():
        cache = policy.prefill(obs)
        ref = sample_chunk(policy, cache, 4, K, a, 5.0, None, x0=x0, k_star=k_star, xi=xi)
        # row 0 by hand: ODE steps up to k*, then mu + std xi, its log-density the logp
        k = int(k_star[0])
        sig = sigma_schedule(K, 5.0)
        x = ref.chain[:, k]
        v = policy.velocity(cache, x, sig[k].expand(4))
        mu, std = sde_mean_std(x, v, sig[k], sig[k + 1], a)
    want = mu[0] + std[0] * xi[0]
    torch.testing.assert_close(ref.chain[0, k + 1], want, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        ref.logp[:1], gaussian_log_prob(want[None], mu[:1], std[:1]), rtol=0, atol=1e-4
    )
    assert torch.equal(ref.chain[:, 0], x0) and torch.equal(ref.k_star, k_star)
    sampler = GraphedSampler(policy, K=K, a=a, shift=5.0, max_batch=4)
    out = sampler.query(obs, None, x0=x0, k_star=k_star, xi=xi)
    assert torch.equal(out.k_star, k_star)
    torch.testing.assert_close(out.chain, ref.chain, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logp, ref.logp, rtol=0, atol=1e-4)


def test_draw_noise_leaves_the_generator_where_sample_chunk_does() -> None:
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    policy, obs = _policy_and_obs(4)
    with torch.no_grad():
        sample_chunk(policy, policy.prefill(obs), 4, 6, 0.5, 5.0, g1)
    draw_noise(4, 6, 0.5, g2)
    assert torch.equal(torch.randn(3, generator=g1), torch.randn(3, generator=g2))


def test_buckets_and_weight_signature() -> None:
    policy, _ = _policy_and_obs(1)
    sampler = GraphedSampler(policy, K=4, a=0.5, shift=5.0, max_batch=12)
    assert sampler.buckets == [1, 2, 4, 8, 12]
    assert [sampler.bucket(n) for n in (1, 3, 8, 9, 12)] == [1, 4, 8, 12, 12]
    assert GraphedSampler(policy, 4, 0.5, 5.0, max_batch=12, fixed_batch=True).buckets == [12]
    with pytest.raises(ValueError, match="exceeds max_batch 12"):
        sampler.bucket(13)
    before = sampler.weights_signature()
    with torch.no_grad():
        next(policy.parameters()).add_(1.0)  # an in-place update, as an optimizer step does
    assert sampler.weights_signature() != before
    sig = sampler.weights_signature()
    policy.load_state_dict(policy.state_dict())
    assert sampler.weights_signature() != sig


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_equals_eager_and_recaptures_after_an_update() -> None:
    policy, obs = _policy_and_obs(5)
    policy = policy.cuda()
    obs = obs.to("cuda")
    sampler = GraphedSampler(policy, K=8, a=0.5, shift=5.0, max_batch=8)

    def eager(seed: int):
        with torch.no_grad():
            gen = torch.Generator().manual_seed(seed)
            return sample_chunk(policy, policy.prefill(obs), 5, 8, 0.5, 5.0, gen)

    for seed in (7, 8):  # the second replays the captured graph with new noise
        ref, out = eager(seed), sampler.query(obs, torch.Generator().manual_seed(seed))
        torch.testing.assert_close(out.chain, ref.chain, rtol=0, atol=1e-4)
        torch.testing.assert_close(out.logp, ref.logp, rtol=0, atol=1e-2)
    assert sampler.captures == 1
    with torch.no_grad():
        for p in policy.parameters():
            p.mul_(1.01)  # new weights, in place: the graph must be re-captured
    ref, out = eager(9), sampler.query(obs, torch.Generator().manual_seed(9))
    assert sampler.captures == 2
    torch.testing.assert_close(out.chain, ref.chain, rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_warm_up_captures_every_bucket_once() -> None:
    policy, obs = _policy_and_obs(3)
    policy, obs = policy.cuda(), obs.to("cuda")
    sampler = GraphedSampler(policy, K=8, a=0.5, shift=5.0, max_batch=6)
    assert sampler.warm_up(obs) == len(sampler.buckets) == 4  # 1, 2, 4, 6
    sampler.query(obs, torch.Generator().manual_seed(1))  # batch 3 -> bucket 4: a replay
    assert sampler.captures == 4


def test_bf16_query_autocasts_the_model_and_keeps_log_pi_float32() -> None:
    """sampler.amp: the graph-ready path and rollout.query_chunks agree under bf16, the
    model really ran in bf16 (the chain moved), and the log-prob math stayed float32."""
    from wamrl.rollout import SamplerSettings, query_chunks

    policy, obs = _policy_and_obs(4)
    bf16 = SamplerSettings(8, 0.5, 5.0, amp=torch.bfloat16)
    with torch.no_grad():
        ref = query_chunks(policy, obs, bf16, torch.Generator().manual_seed(7))
        fp32 = query_chunks(
            policy, obs, SamplerSettings(8, 0.5, 5.0), torch.Generator().manual_seed(7)
        )
    out = GraphedSampler(policy, 8, 0.5, 5.0, 4, amp=torch.bfloat16).query(
        obs, torch.Generator().manual_seed(7)
    )
    assert out.logp.dtype == out.chain.dtype == torch.float32
    assert torch.equal(out.k_star, ref.k_star) and torch.equal(ref.k_star, fp32.k_star)
    torch.testing.assert_close(out.chain, ref.chain, rtol=0, atol=1e-6)
    torch.testing.assert_close(out.logp, ref.logp, rtol=0, atol=1e-4)
    gap = (ref.chain[:, -1] - fp32.chain[:, -1]).abs().max()
    assert 1e-4 < gap < 0.1, gap  # bf16 rounding: visible, yet the same actions


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_cuda_graph_replays_the_eager_bf16_query() -> None:
    from wamrl.rollout import SamplerSettings, query_chunks

    policy, obs = _policy_and_obs(3)
    policy, obs = policy.cuda(), obs.to("cuda")
    sampler = GraphedSampler(policy, K=8, a=0.5, shift=5.0, max_batch=4, amp=torch.bfloat16)
    bf16 = SamplerSettings(8, 0.5, 5.0, amp=torch.bfloat16)
    for seed in (7, 8):  # capture, then a replay
        with torch.no_grad():
            ref = query_chunks(policy, obs, bf16, torch.Generator().manual_seed(seed))
        out = sampler.query(obs, torch.Generator().manual_seed(seed))
        assert out.logp.dtype == torch.float32
        torch.testing.assert_close(out.chain, ref.chain, rtol=0, atol=1e-3)
        torch.testing.assert_close(out.logp, ref.logp, rtol=0, atol=5e-2)
    assert sampler.captures == 1


def test_bf16_weight_copy_equals_autocast_to_the_bit_and_follows_weight_updates() -> None:
    """Under sampler.amp queries run matmul_weights_in's copy (weights stored in bf16, LoRA
    folded): exactly what autocast computes on the fp32 policy, rebuilt when weights change."""
    from wamrl.graphed import matmul_weights_in
    from wamrl.policy.lora import LoRALinear
    from wamrl.rollout import SamplerSettings, query_chunks

    policy, obs = _policy_and_obs(3)
    bf16 = SamplerSettings(6, 0.5, 5.0, amp=torch.bfloat16)
    sampler = GraphedSampler(policy, 6, 0.5, 5.0, 4, amp=torch.bfloat16)

    def check(seed: int) -> None:
        with torch.no_grad():
            ref = query_chunks(policy, obs, bf16, torch.Generator().manual_seed(seed))
        out = sampler.query(obs, torch.Generator().manual_seed(seed))
        assert torch.equal(out.chain, ref.chain) and torch.equal(out.logp, ref.logp)

    check(1)
    copy = sampler._model
    assert copy is not policy and not any(isinstance(m, LoRALinear) for m in copy.modules())
    assert copy.video_blocks[0].qkv.weight.dtype == torch.bfloat16
    assert copy.video_blocks[0].norm1.weight.dtype == torch.float32  # norms stay fp32
    with torch.no_grad():  # a world-model update: LoRA B moves off zero, folded into the copy
        for m in policy.modules():
            if isinstance(m, LoRALinear):
                m.lora_b.normal_(0, 0.05)
    check(2)
    assert sampler._model is not copy
    assert matmul_weights_in(copy, torch.bfloat16) is copy  # stored in bf16 already: no copy


@pytest.mark.compile
def test_compiled_layers_answer_like_the_eager_policy_and_share_its_weights() -> None:
    """sampler.compile: the query copy (weights shared, LoRA folded) with torch.compile'd
    layers gives the eager query's chain and log pi; the policy itself is left as it was."""
    try:  # Inductor on CPU builds C++: a machine without a compiler or Python headers can't
        torch.compile(lambda t: t + 1)(torch.ones(2))
    except Exception as err:  # noqa: BLE001 - whatever the toolchain raised
        pytest.skip(f"torch.compile does not work here: {err!r:.200}")
    policy, obs = _policy_and_obs(3)
    sampler = GraphedSampler(policy, K=4, a=0.5, shift=5.0, max_batch=4, compile=True)
    for batch in (3, 2):  # a second batch size: dynamic shapes, no recompile per size
        part = Obs(*(t[:batch] for t in (obs.image, obs.proprio, obs.context, obs.context_mask)))
        with torch.no_grad():
            ref = sample_chunk(
                policy, policy.prefill(part), batch, 4, 0.5, 5.0,
                torch.Generator().manual_seed(batch),
            )  # fmt: skip
        out = sampler.query(part, torch.Generator().manual_seed(batch))
        torch.testing.assert_close(out.chain, ref.chain, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.logp, ref.logp, rtol=0, atol=1e-3)
    copy = sampler._model
    assert copy is not policy
    assert (
        copy.action_blocks[0].qkv.weight.data_ptr() == policy.action_blocks[0].qkv.weight.data_ptr()
    )
    assert "finish" in vars(copy.action_blocks[0]) and "finish" not in vars(policy.action_blocks[0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_wait_sleeping_returns_only_when_the_queued_work_is_done() -> None:
    from wamrl.runtime import wait_sleeping

    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(50):  # tens of milliseconds of queued GPU work
        x = torch.tanh(x @ x)
    assert not torch.cuda.current_stream().query()
    wait_sleeping(x.device)
    assert torch.cuda.current_stream().query()


def _rows_alone_in_fixed_batches(device: str, query) -> None:
    """Eval pads every batch to one size (run_episodes fixed_batch): a row's chain must then
    not depend on the other rows or on its position, bitwise. On the CPU that holds with one
    torch thread, the stages' setting (with two, a row's thread share changes its kernel)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _check_rows_alone(device, query)
    finally:
        torch.set_num_threads(threads)


def _check_rows_alone(device: str, query) -> None:
    policy, obs = _policy_and_obs(6)
    policy, obs = policy.to(device), obs.to(device)
    x0 = torch.randn(6, 32, 7, generator=torch.Generator().manual_seed(2)).to(device)

    def run(rows: list[int]) -> torch.Tensor:
        idx = torch.tensor(rows, device=device)
        o = Obs(obs.image[idx], obs.proprio[idx], obs.context[idx], obs.context_mask[idx])
        return query(policy, o, x0[idx])

    ref = run([0, 1, 2, 3, 4, 5])
    for rows in ([5, 3, 1, 0, 2, 4], [2, 2, 2, 2, 2, 2], [4, 0, 0, 0, 0, 0]):
        out = run(rows)
        for j, r in enumerate(rows):
            assert torch.equal(out[j], ref[r]), (rows, j)


def test_a_row_of_a_fixed_size_batch_does_not_depend_on_the_others() -> None:
    def query(policy, obs, x0):
        with torch.no_grad():
            return sample_chunk(policy, policy.prefill(obs), 6, 20, 0.0, 5.0, None, x0=x0).chain

    _rows_alone_in_fixed_batches("cpu", query)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_rollout_rows_with_their_own_noise_do_not_depend_on_the_others(device: str) -> None:
    """Rollouts (a > 0) in fixed-size batches (rollout.fixed_batch): with per-row x_0, k*
    and xi as graph inputs, a row's chain and log pi are the same bits whichever rows share
    its batch and wherever it sits (CPU: one torch thread, the stages' setting)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    policy, obs = _policy_and_obs(6)
    policy, obs = policy.to(device), obs.to(device)
    x0, k_star, xi = _per_row_noise(6, 8)
    sampler = GraphedSampler(policy, 8, 0.5, 5.0, 6, fixed_batch=True)

    def run(rows: list[int]):
        i = torch.tensor(rows)
        o = Obs(*(t[i.to(device)] for t in (obs.image, obs.proprio, obs.context, obs.context_mask)))
        return sampler.query(o, None, x0=x0[i].to(device), k_star=k_star[i], xi=xi[i])

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = run([0, 1, 2, 3, 4, 5])
        for rows in ([5, 3, 1, 0, 2, 4], [2, 2, 2, 2, 2, 2], [4, 0, 0, 0, 0, 0]):
            out = run(rows)
            for j, r in enumerate(rows):
                assert torch.equal(out.chain[j], ref.chain[r]), (rows, j)
                assert torch.equal(out.logp[j], ref.logp[r]), (rows, j)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_a_row_of_a_fixed_size_cuda_graph_does_not_depend_on_the_others(amp) -> None:
    graphed = {}

    def query(policy, obs, x0):
        if not graphed:
            graphed["g"] = GraphedSampler(policy, 20, 0.0, 5.0, 6, amp=amp, fixed_batch=True)
        return graphed["g"].query(obs, None, x0=x0).chain

    _rows_alone_in_fixed_batches("cuda", query)


def test_a_compiled_query_that_cannot_run_says_which_setting_to_change(monkeypatch) -> None:
    policy, obs = _policy_and_obs(2)
    sampler = GraphedSampler(policy, K=4, a=0.5, shift=5.0, max_batch=2, compile=True)
    sampler.use_graphs = True  # as on CUDA; capture fails the way Inductor does without cc

    def capture_fails(*_):
        raise RuntimeError("InductorError: no working C compiler found")

    monkeypatch.setattr(sampler, "_graph_for", capture_fails)
    with pytest.raises(RuntimeError, match="set sampler.compile: false"):
        sampler.query(obs, torch.Generator().manual_seed(0))
