"""Float32 master weights (wamrl.master) at the fastwam backend's dtype, bf16."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.helpers import ONE_LAYER_TINY, default_cfg, make_tiny_policy
from wamrl import paths, ppo, training
from wamrl.master import MasterWeightOptimizer
from wamrl.policy.tiny import TinyWAM

BF16_ULP_AT_002 = 2.0**-13  # bf16 keeps 8 significant bits: 0.02 lies in [2**-6, 2**-5)


def adam(lr: float = 1e-5, **kw: Any):
    return lambda ps: torch.optim.Adam(ps, lr=lr, **kw)


def _steps(opt: Any, params: list[nn.Parameter], grads: list[torch.Tensor], n: int) -> None:
    for _ in range(n):
        opt.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in params)
        for p, g in zip(params, grads, strict=True):
            p.grad = g.to(p.dtype).clone()
        opt.step()


def test_bf16_update_rounds_away_without_masters_and_accumulates_with_them() -> None:
    p0 = torch.tensor([0.02], dtype=torch.bfloat16)
    assert float(p0) == pytest.approx(164 * BF16_ULP_AT_002)  # 0.0200195...
    one = [torch.ones(1)]

    plain = nn.Parameter(p0.clone())
    _steps(torch.optim.Adam([plain], lr=1e-5), [plain], one, 10)
    assert torch.equal(plain.detach(), p0)  # 10 steps of ~1e-5 each: all rounded away

    p = nn.Parameter(p0.clone())
    opt = MasterWeightOptimizer([p], adam(1e-5))
    assert opt.num_masters == 1 and opt.masters[0].dtype == torch.float32
    # With a constant gradient every Adam step moves by lr. 6 steps = 6e-5 < half an ulp
    # (6.1e-5): the bf16 weight is unchanged but the master has moved.
    _steps(opt, [p], one, 6)
    assert float(opt.masters[0]) == pytest.approx(float(p0) - 6e-5, abs=1e-8)
    assert torch.equal(p.detach(), p0)
    # The 7th step takes the master past half an ulp: the bf16 weight drops by one ulp.
    _steps(opt, [p], one, 1)
    assert float(opt.masters[0]) == pytest.approx(float(p0) - 7e-5, abs=1e-8)
    assert float(p.detach()) == float(p0) - BF16_ULP_AT_002
    _steps(opt, [p], one, 3)
    assert float(opt.masters[0]) == pytest.approx(float(p0) - 10e-5, abs=1e-8)
    assert float(p.detach()) == float(p0) - BF16_ULP_AT_002  # 0.82 ulp rounds to 1 ulp
    assert p.dtype == torch.bfloat16
    assert torch.equal(p.detach(), opt.masters[0].to(torch.bfloat16))


def test_float32_params_are_plain_adam_bit_for_bit() -> None:
    torch.manual_seed(0)
    init = [torch.randn(4, 3), torch.randn(3)]
    a = [nn.Parameter(t.clone()) for t in init]
    b = [nn.Parameter(t.clone()) for t in init]
    plain = torch.optim.Adam(a, lr=1e-3, weight_decay=0.01)
    wrapped = MasterWeightOptimizer(b, adam(1e-3, weight_decay=0.01))
    assert wrapped.num_masters == 0
    assert all(m is p for m, p in zip(wrapped.masters, b, strict=True))  # no copies
    for _ in range(5):
        grads = [torch.randn_like(t) for t in init]
        _steps(plain, a, grads, 1)
        _steps(wrapped, b, grads, 1)
    for pa, pb in zip(a, b, strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(a[0].detach(), init[0])  # it did train


def test_optimizer_state_and_masters_round_trip() -> None:
    torch.manual_seed(0)
    names = ["w", "b"]
    w0, b0 = (torch.randn(4, 3) * 0.05).to(torch.bfloat16), torch.randn(3)
    grads = [torch.randn(4, 3), torch.randn(3)]

    def fresh(w: torch.Tensor, b: torch.Tensor) -> tuple[list[nn.Parameter], Any]:
        ps = [nn.Parameter(w.clone()), nn.Parameter(b.clone())]
        return ps, MasterWeightOptimizer(ps, adam(1e-5))

    ps, opt = fresh(w0, b0)
    _steps(opt, ps, grads, 3)
    tensors, meta = training.optimizer_to_tensors(opt.inner, names)
    assert meta["type"] == "Adam" and meta["params"] == names
    assert tensors["w.exp_avg"].dtype == torch.float32  # the moments live on the masters
    assert set(tensors) == {f"{n}.{k}" for n in names for k in ("exp_avg", "exp_avg_sq", "step")}
    # The wrapper exposes the inner optimizer's groups and state as its own, too.
    via_wrapper, _ = training.optimizer_to_tensors(opt, names)  # type: ignore[arg-type]
    assert all(torch.equal(via_wrapper[k], tensors[k]) for k in tensors)
    masters = opt.master_tensors(names)
    assert set(masters) == {"w"} and masters["w"].dtype == torch.float32
    # 3 steps of 1e-5 on weights of ~0.05 (ulp 2.4e-4): the master holds what bf16 cannot.
    assert not torch.equal(masters["w"], ps[0].detach().float())

    # A new run from the saved bf16 weights (what the merged checkpoint holds).
    ps2, opt2 = fresh(ps[0].detach(), ps[1].detach())
    assert opt2.load_masters(names, masters) == 1
    assert training.optimizer_from_tensors(opt2.inner, names, tensors) == 2
    # Without the masters, the sub-ulp part of the first 3 steps is lost.
    ps3, opt3 = fresh(ps[0].detach(), ps[1].detach())
    assert training.optimizer_from_tensors(opt3.inner, names, tensors) == 2
    _steps(opt, ps, grads, 4)
    _steps(opt2, ps2, grads, 4)
    _steps(opt3, ps3, grads, 4)
    for x, y in zip([*ps, *opt.masters], [*ps2, *opt2.masters], strict=True):
        assert torch.equal(x.detach(), y.detach())
    assert not torch.equal(opt.masters[0], opt3.masters[0])

    # A master that does not round to the loaded weight (another checkpoint) is not used.
    other = ps[0].detach().clone()
    other[0, 0] = -other[0, 0] + 1.0
    _, opt4 = fresh(other, ps[1].detach())
    assert opt4.load_masters(names, opt.master_tensors(names)) == 0
    assert torch.equal(opt4.masters[0], other.float())


# ---- a tiny-policy actor update with the actor group in bf16 --------------------------------


def _cfg(epochs: int, n: int) -> dict[str, Any]:
    cfg = default_cfg()
    cfg["rollout"]["workers"] = 1
    # bf16 weights need autocast for the mixed-dtype matmuls; log pi_old is the learner's
    # own (synthetic chains below), so the ratio starts at 1. One minibatch = one step.
    cfg["actor"].update(epochs=epochs, minibatch=n, lr=1e-5, amp="bf16", logp_old="recompute")
    return cfg


def _policy(actor_dtype: torch.dtype) -> TinyWAM:
    policy = make_tiny_policy(config=ONE_LAYER_TINY)
    with torch.no_grad():
        for p in policy.parameter_groups()["actor"]:
            p.data = p.data.to(actor_dtype)  # as the fastwam backend stores them
    return policy


def _data(n: int = 4) -> ppo.ActorData:
    rng = np.random.default_rng(0)
    return ppo.ActorData(
        image=rng.integers(0, 256, (n, 224, 448, 3), dtype=np.uint8),
        proprio=rng.uniform(-1, 1, (n, 8)).astype(np.float32),
        task=np.zeros(n, np.int64),
        x_k=rng.standard_normal((n, 32, 7)).astype(np.float32),
        x_next=rng.standard_normal((n, 32, 7)).astype(np.float32),
        k_star=rng.integers(1, 4, n),
        logp_old=np.zeros(n, np.float32),
        adv=np.where(np.arange(n) % 2 == 0, 1.0, -1.0).astype(np.float32),
        where=np.zeros((n, 3), np.int64),
        context=torch.randn(1, 4, 384, generator=torch.Generator().manual_seed(0)),
        context_mask=torch.ones(1, 4, dtype=torch.bool),
        K=4,
        noise_a=0.5,
        shift=5.0,
    )


def test_bf16_tiny_actor_update_moves_the_weights_with_masters() -> None:
    steps, data = 8, _data()
    cfg = _cfg(steps, len(data))
    plain_policy, policy = _policy(torch.bfloat16), _policy(torch.bfloat16)
    init = [p.detach().clone() for p in policy.parameter_groups()["actor"]]

    plain = torch.optim.Adam(plain_policy.parameter_groups()["actor"], lr=1e-5)
    ppo.actor_update(plain_policy, None, data, cfg, plain)
    params = policy.parameter_groups()["actor"]
    opt = MasterWeightOptimizer(params, adam(1e-5))
    metrics = ppo.actor_update(policy, None, data, cfg, opt)  # type: ignore[arg-type]
    assert opt.num_masters == len(params)
    assert metrics["epochs"][0]["ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-3)

    def changed(ps: list[nn.Parameter]) -> float:  # fraction of bf16 elements that moved
        moved = sum(int((p.detach() != p0).sum()) for p, p0 in zip(ps, init, strict=True))
        return moved / sum(p.numel() for p in ps)

    # Adam moves an element by at most ~lr per step. The masters keep all of it: nearly
    # every element moved, by several lr on average (measured: 5.1e-5 of at most 8e-5).
    pairs = zip(opt.masters, init, strict=True)
    shift = torch.cat([(m - p0.float()).abs().flatten() for m, p0 in pairs])
    assert float(shift.max()) <= steps * 1e-5 * 1.01
    assert float(shift.mean()) > 0.3 * steps * 1e-5
    assert float((shift > 0).float().mean()) > 0.99
    for p, m in zip(params, opt.masters, strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.to(torch.bfloat16))
    # Plain bf16 Adam drops every step below half an ulp (measured: 7.7 % of the elements
    # changed); with masters those steps accumulate (37.7 %).
    frac_plain, frac_master = changed(plain_policy.parameter_groups()["actor"]), changed(params)
    assert frac_plain < 0.15 and frac_master > 3 * frac_plain, (frac_master, frac_plain)


def test_float32_tiny_actor_update_is_unchanged_by_the_wrapper() -> None:
    data = _data()
    cfg = _cfg(2, 2)
    cfg["actor"]["amp"] = None
    a, b = _policy(torch.float32), _policy(torch.float32)
    ppo.actor_update(a, None, data, cfg, torch.optim.Adam(a.parameter_groups()["actor"], lr=1e-5))
    opt = MasterWeightOptimizer(b.parameter_groups()["actor"], adam(1e-5))
    ppo.actor_update(b, None, data, cfg, opt)  # type: ignore[arg-type]
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na


# ---- the actor stage: master.safetensors out, and back in at the next iteration -------------


def _run_actor_stage(
    monkeypatch: pytest.MonkeyPatch, run: Path, iteration: int, policy: TinyWAM, cfg: dict
) -> dict[str, Any]:
    import stages.actor
    import wamrl.policy
    import wamrl.policy.text

    data = _data()
    monkeypatch.setattr(wamrl.policy, "load_policy", lambda *a, **k: copy.deepcopy(policy))
    monkeypatch.setattr(
        wamrl.policy.text, "load_contexts", lambda *a: (data.context, data.context_mask)
    )
    monkeypatch.setattr(stages.actor, "load_actor_data", lambda *a: data)
    done = paths.reward_done(run, iteration)
    done.parent.mkdir(parents=True, exist_ok=True)
    done.write_text(json.dumps({"groups_kept": 1, "groups_total": 1, "config": cfg}))
    stages.actor.main(cfg, run, iteration)
    return json.loads((paths.actor_dir(run, iteration) / "metrics.json").read_text())


def test_actor_stage_saves_and_restores_masters(tmp_path, monkeypatch) -> None:
    cfg = _cfg(3, 4)
    policy = _policy(torch.bfloat16)
    names = training.param_names(policy, policy.parameter_groups()["actor"])
    m1 = _run_actor_stage(monkeypatch, tmp_path, 1, policy, cfg)
    assert m1["master_weights_params"] == len(names)
    assert m1["master_weights_restored_params"] == 0
    out = paths.actor_dir(tmp_path, 1)
    actor, masters = load_file(out / "actor.safetensors"), load_file(out / "master.safetensors")
    assert set(masters) == set(actor) == set(names)
    for n in names:
        assert actor[n].dtype == torch.bfloat16 and masters[n].dtype == torch.float32
        assert torch.equal(actor[n], masters[n].to(torch.bfloat16))
    assert json.loads((out / "optimizer.json").read_text())["type"] == "Adam"

    merged = copy.deepcopy(policy)  # what merge makes of iteration 1
    merged.load_state_dict(actor, strict=False)
    m2 = _run_actor_stage(monkeypatch, tmp_path, 2, merged, cfg)
    assert m2["master_weights_restored_params"] == len(names)
    with_state = [k for k in load_file(out / "optimizer.safetensors") if k.endswith(".exp_avg")]
    assert m2["optimizer_state_restored_params"] == len(with_state) > 0

    # Against another checkpoint (iteration 0's weights) a master is restored only for
    # the tensors whose bf16 value the last update did not change.
    m3 = _run_actor_stage(monkeypatch, tmp_path, 2, policy, cfg)
    state = policy.state_dict()
    same = sum(torch.equal(actor[n], state[n]) for n in names)
    assert m3["master_weights_restored_params"] == same < len(names)


def test_actor_stage_float32_writes_no_masters(tmp_path, monkeypatch) -> None:
    cfg = _cfg(1, 4)
    cfg["actor"]["amp"] = None
    metrics = _run_actor_stage(monkeypatch, tmp_path, 1, _policy(torch.float32), cfg)
    assert metrics["master_weights_params"] == 0
    assert not (paths.actor_dir(tmp_path, 1) / "master.safetensors").exists()


def test_max_kl_projection_moves_bf16_parameters_with_their_masters() -> None:
    """actor.max_kl on bf16 weights: the float32 masters are scaled back and rounded into
    the parameters, so each parameter is still its master in bf16, and the KL is max_kl."""
    data = _data()
    cfg = _cfg(8, len(data))
    cfg["actor"].update(lr=1e-4, max_kl=0.01)
    policy = _policy(torch.bfloat16)
    params = policy.parameter_groups()["actor"]
    opt = MasterWeightOptimizer(params, adam(1e-4))
    metrics = ppo.actor_update(policy, None, data, cfg, opt)  # type: ignore[arg-type]
    assert metrics["kl_projection"]["kl_before"] > 0.1  # measured: 0.144
    assert 0.009 <= metrics["kl"] <= 0.01
    for p, m in zip(params, opt.masters, strict=True):
        assert p.dtype == torch.bfloat16 and torch.equal(p.detach(), m.to(torch.bfloat16))
