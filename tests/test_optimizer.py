"""CPUAdam against torch.optim.AdamW and Adam: steps, groups, schedulers, closures, state dicts."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ulp_distance

from cpu_adam import CPUAdam

GRAD_SCALE = 0.5  # grads are 0.1 * randn: |g| < 0.5 here
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (4097,), (5,), (64, 64)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def grads_for(params, step: int, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(p.shape, generator=g) * 0.1).to(dtype or p.dtype) for p in params]


def clone_params(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def assert_ulps(actual: torch.Tensor, expected: torch.Tensor, max_ulps: int, what: str) -> None:
    worst = ulp_distance(actual.detach(), expected.detach()).max().item()
    assert worst <= max_ulps, f"{what}: {worst} ulps apart"


def assert_close_in_ulps_of(actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str) -> None:
    """A few ulps of |expected| + scale, where scale is the size of the terms that cancel:
    |g| for exp_avg = m + (g - m) * (1 - beta1), the summed updates for p = p - update."""
    u = 2.0 ** (-8 if actual.dtype == torch.bfloat16 else -24)
    excess = (actual.double() - expected.double()).abs() - 8 * u * (expected.double().abs() + scale)
    assert excess.max() <= 0, f"{what}: off by {excess.max().item():.3g} beyond a few ulps"


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_fp32_matches_torch_over_many_steps(adamw_mode: bool) -> None:
    ours_params = make_params()
    torch_params = clone_params(ours_params)
    ours = CPUAdam(ours_params, **HYPER, adamw_mode=adamw_mode)
    reference_class = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    reference = reference_class(torch_params, **HYPER, foreach=False)
    for step in range(12):
        for p, q, g in zip(ours_params, torch_params, grads_for(ours_params, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()
    # torch fuses multiply-adds and divides by sqrt(bc2) where the kernel multiplies
    # by its reciprocal: a few float32 ulps after a dozen steps, not bitwise.
    for p, q in zip(ours_params, torch_params):
        assert_close_in_ulps_of(p, q, 12 * HYPER["lr"], "param")
        assert_close_in_ulps_of(ours.state[p]["exp_avg"], reference.state[q]["exp_avg"], GRAD_SCALE, "exp_avg")
        assert_ulps(ours.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"], 8, "exp_avg_sq")
        assert ours.state[p]["step"].item() == reference.state[q]["step"].item() == 12


@pytest.mark.parametrize("fp32_states", [True, False])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_bf16_params_match_torch_step_by_step(fp32_states: bool, grad_dtype: torch.dtype) -> None:
    """Each step starts torch's fp32 AdamW from our bf16 state; rounding its result to
    bf16 may differ from ours by one bf16 ulp, only where float32 results straddle a
    rounding boundary, and bf16 moments likewise."""
    params = make_params(torch.bfloat16)
    for p in params:
        p.grad_dtype = None  # allows the float32 grads of this parametrization
    ours = CPUAdam(params, **HYPER, fp32_optimizer_states=fp32_states)
    state_dtype = torch.float32 if fp32_states else torch.bfloat16
    mismatched = 0
    for step in range(10):
        grads = grads_for(params, step, grad_dtype)
        shadows = [torch.nn.Parameter(p.detach().float()) for p in params]
        reference = torch.optim.AdamW(shadows, **HYPER, foreach=False)
        for p, shadow, g in zip(params, shadows, grads):
            p.grad, shadow.grad = g, g.float()
            if step:
                reference.state[shadow] = {
                    "step": ours.state[p]["step"].clone(),
                    **{k: ours.state[p][k].float().clone() for k in ("exp_avg", "exp_avg_sq")},
                }
        ours.step()
        reference.step()
        for p, shadow in zip(params, shadows):
            assert ours.state[p]["exp_avg"].dtype == state_dtype
            assert_ulps(p, shadow.to(torch.bfloat16), 1, "bf16 param")
            mismatched += int((p != shadow.to(torch.bfloat16)).sum())
            expected = {k: reference.state[shadow][k].to(state_dtype) for k in ("exp_avg", "exp_avg_sq")}
            assert_close_in_ulps_of(ours.state[p]["exp_avg"], expected["exp_avg"], GRAD_SCALE, "exp_avg")
            assert_ulps(ours.state[p]["exp_avg_sq"], expected["exp_avg_sq"], 4 if fp32_states else 1, "exp_avg_sq")
    total = 10 * sum(p.numel() for p in params)
    assert mismatched < total * 1e-3, f"{mismatched} of {total} bf16 weights off by an ulp"


def test_bf16_grads_on_fp32_params_are_read_as_bf16() -> None:
    params = make_params()
    for p in params:
        p.grad_dtype = None  # torch's opt-in for a grad dtype other than the param's
    twins = clone_params(params)
    ours, reference = CPUAdam(params, **HYPER), torch.optim.AdamW(twins, **HYPER, foreach=False)
    for step in range(3):
        for p, q, g in zip(params, twins, grads_for(params, step, torch.bfloat16)):
            p.grad, q.grad = g, g.float()
            assert p.grad.dtype == torch.bfloat16
        ours.step()
        reference.step()
    for p, q in zip(params, twins):
        assert_close_in_ulps_of(p, q, 3 * HYPER["lr"], "param")


def test_groups_scheduler_closure_and_hyper_parameter_changes() -> None:
    params = make_params()
    twins = clone_params(params)

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:3], "weight_decay": 0.0, "lr": 3e-2}]

    ours = CPUAdam(groups(params), **HYPER)
    reference = torch.optim.AdamW(groups(twins), **HYPER, foreach=False)
    schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (ours, reference)]
    for step in range(12):
        if step == 4:
            for o, p in ((ours, params[3]), (reference, twins[3])):
                o.add_param_group({"params": [p], "lr": 5e-3})
        if step == 7:
            for o in (ours, reference):
                o.param_groups[0]["betas"] = (0.8, 0.95)
        grads = grads_for(params, step)

        def closure(ps=params, gs=grads):
            for p, g in zip(ps, gs):
                p.grad = g.clone()
            return 1.5

        assert ours.step(closure) == 1.5
        for q, g in zip(twins, grads):
            q.grad = g.clone()
        reference.step()
        for s in schedulers:
            s.step()
    assert ours.param_groups[0]["lr"] == reference.param_groups[0]["lr"] < HYPER["lr"]
    for p, q in zip(params, twins):
        assert_close_in_ulps_of(p, q, 12 * HYPER["lr"], "param")
    assert ours.state[params[3]]["step"].item() == 8


def test_params_without_grads_are_skipped() -> None:
    params = make_params()
    ours = CPUAdam(params, **HYPER)
    params[0].grad = torch.ones_like(params[0])
    before = [p.detach().clone() for p in params]
    ours.step()
    assert not torch.equal(params[0], before[0])
    assert all(torch.equal(p, b) for p, b in zip(params[1:], before[1:]))
    assert params[1] not in ours.state


def run(optimizer_factory, params, steps: range) -> None:
    optimizer = optimizer_factory(params)
    for step in steps:
        for p, g in zip(params, grads_for(params, step)):
            p.grad = g
        optimizer.step()
    return optimizer


@pytest.mark.parametrize("fp32_states", [True, False])
def test_state_dict_resume_is_exact(fp32_states: bool) -> None:
    def factory(ps):
        return CPUAdam(ps, **HYPER, fp32_optimizer_states=fp32_states, stochastic_rounding=True, seed=7)

    straight = make_params(torch.bfloat16)
    run(factory, straight, range(6))
    resumed = make_params(torch.bfloat16)
    first = run(factory, resumed, range(3))
    saved = first.state_dict()
    second = CPUAdam(resumed, lr=0.5, fp32_optimizer_states=fp32_states, stochastic_rounding=True)
    second.load_state_dict(saved)
    assert second.param_groups[0]["seed"] == first.param_groups[0]["seed"]
    for step in range(3, 6):
        for p, g in zip(resumed, grads_for(resumed, step)):
            p.grad = g
        second.step()
    for a, b in zip(straight, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("saved_fp32", "loaded_fp32"), [(True, False), (False, True)])
def test_state_dict_loads_across_state_dtypes(saved_fp32: bool, loaded_fp32: bool) -> None:
    params = make_params(torch.bfloat16)
    saver = run(lambda ps: CPUAdam(ps, **HYPER, fp32_optimizer_states=saved_fp32), params, range(2))
    saved = saver.state_dict()
    loader = CPUAdam(params, **HYPER, fp32_optimizer_states=loaded_fp32)
    loader.load_state_dict(saved)
    dtype = torch.float32 if loaded_fp32 else torch.bfloat16
    for i, p in enumerate(params):
        for key in ("exp_avg", "exp_avg_sq"):
            # Converted once, straight from what was saved (not through the bf16 param dtype).
            assert torch.equal(loader.state[p][key], saved["state"][i][key].to(dtype))
    assert loader.param_groups[0]["fp32_optimizer_states"] is loaded_fp32
    loader.step()


def test_adamw_state_dict_loads_both_ways() -> None:
    params, twins = make_params(), None
    twins = clone_params(params)
    torch_first = run(lambda ps: torch.optim.AdamW(ps, **HYPER, foreach=False), twins, range(3))
    ours = CPUAdam(params, lr=1.0)
    for p, q in zip(params, twins):
        p.data.copy_(q)
    ours.load_state_dict(torch_first.state_dict())
    assert ours.param_groups[0]["lr"] == HYPER["lr"] and ours.param_groups[0]["decoupled_weight_decay"]
    for step in range(3, 6):
        for p, q, g in zip(params, twins, grads_for(params, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        torch_first.step()
    for p, q in zip(params, twins):
        assert_close_in_ulps_of(p, q, 12 * HYPER["lr"], "after switching to CPUAdam")

    back = torch.optim.AdamW(twins, lr=1.0, foreach=False)
    back.load_state_dict(copy.deepcopy(ours.state_dict()))  # torch's load would share our step tensors
    for p, q, g in zip(params, twins, grads_for(params, 9)):
        p.grad, q.grad = g.clone(), g.clone()
    ours.step()
    back.step()
    for p, q in zip(params, twins):
        assert_close_in_ulps_of(p, q, 12 * HYPER["lr"], "after switching back to AdamW")


def test_torch_adam_state_dict_keeps_l2_mode() -> None:
    params = make_params()
    adam = run(lambda ps: torch.optim.Adam(ps, **HYPER, foreach=False), clone_params(params), range(1))
    ours = CPUAdam(params)
    ours.load_state_dict(adam.state_dict())
    assert ours.param_groups[0]["decoupled_weight_decay"] is False


def test_dtensor_params_step_their_local_shards(tmp_path) -> None:
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = make_params()
        sharded = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [Shard(0)])) for p in plain]
        ours, reference = CPUAdam(sharded, **HYPER), CPUAdam(plain, **HYPER)
        for p, q, g in zip(sharded, plain, grads_for(plain, 0)):
            p.grad = distribute_tensor(g.clone(), mesh, [Shard(0)])
            q.grad = g.clone()
        ours.step()
        reference.step()
        for p, q in zip(sharded, plain):
            assert torch.equal(p.to_local(), q)
            assert isinstance(ours.state[p]["exp_avg"], type(p))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"amsgrad": True}, "amsgrad"),
        ({"lr": -1.0}, "lr"),
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"weight_decay": -0.1}, "weight_decay"),
    ],
)
def test_bad_hyper_parameters_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CPUAdam(make_params(), **kwargs)


def test_sparse_grad_raises_clear_error() -> None:
    embedding = torch.nn.Embedding(10, 4, sparse=True)
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse=False"):
        CPUAdam(embedding.parameters()).step()


def _state_snapshot(optimizer: CPUAdam, params) -> list[torch.Tensor]:
    states = [optimizer.state[p] for p in params if p in optimizer.state]
    return [p.detach().clone() for p in params] + [
        s[k].clone() for s in states for k in ("step", "exp_avg", "exp_avg_sq")
    ]


def _double_param_in_group_1(groups) -> None:
    p = groups[1]["params"][0]
    p.data = p.data.double()


def _sparse_grad_in_the_second_call(groups) -> None:
    p = groups[0]["params"][1]  # a step behind: stepped in the group's second call
    p.grad = p.grad.to_sparse()


@pytest.mark.parametrize(
    ("spoil", "error", "match"),
    [
        (lambda groups: groups[1].update(lr=float("nan")), ValueError, "lr must be finite"),
        (lambda groups: groups[1].update(eps=float("inf")), ValueError, "eps must be finite"),
        (_double_param_in_group_1, RuntimeError, "Double"),
        (_sparse_grad_in_the_second_call, RuntimeError, "dense"),
    ],
    ids=["lr in a later group", "eps in a later group", "a later group's param", "a grad stepped in a later call"],
)
def test_a_step_that_raises_changes_no_param_state_or_count(spoil, error, match) -> None:
    params = make_params()
    optimizer = CPUAdam([{"params": params[:2]}, {"params": params[2:]}], **HYPER)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    optimizer.step()
    params[1].grad = None
    optimizer.step()  # params[1] now counts one step fewer: group 0 steps in two calls
    for p, g in zip(params, grads_for(params, 1)):
        p.grad = g
    spoil(optimizer.param_groups)
    before = _state_snapshot(optimizer, params)
    with pytest.raises(error, match=match):
        optimizer.step()
    for a, b in zip(_state_snapshot(optimizer, params), before):
        assert torch.equal(a, b)


# ---- torch.optim conventions ----


def _twin_steps(ours: CPUAdam, reference: torch.optim.Optimizer, ours_params, torch_params, steps: range) -> None:
    for step in steps:
        for p, q, g in zip(ours_params, torch_params, grads_for(ours_params, step)):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        reference.step()


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_default_weight_decay_is_the_replaced_optimizers(adamw_mode: bool) -> None:
    # CPUAdam() stands in for torch.optim.AdamW() (weight decay 1e-2), CPUAdam(adamw_mode=False) for Adam() (0).
    ours_params = make_params()
    torch_params = clone_params(ours_params)
    ours = CPUAdam(ours_params, adamw_mode=adamw_mode)
    reference = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(torch_params, foreach=False)
    assert ours.param_groups[0]["weight_decay"] == reference.param_groups[0]["weight_decay"]
    _twin_steps(ours, reference, ours_params, torch_params, range(3))
    for p, q in zip(ours_params, torch_params):
        assert_close_in_ulps_of(p, q, 3 * 1e-3, "param")


def test_maximize_climbs_as_torch_does() -> None:
    ours_params = make_params()
    torch_params = clone_params(ours_params)
    ours = CPUAdam(ours_params, **HYPER, maximize=True, foreach=False, fused=True)
    reference = torch.optim.AdamW(torch_params, **HYPER, maximize=True, foreach=False)
    _twin_steps(ours, reference, ours_params, torch_params, range(4))
    for p, q in zip(ours_params, torch_params):
        assert_close_in_ulps_of(p, q, 4 * HYPER["lr"], "param")


@pytest.mark.parametrize("option", ["capturable", "differentiable"])
def test_capturable_and_differentiable_are_refused(option: str) -> None:
    with pytest.raises(ValueError, match=option):
        CPUAdam(make_params(), **{option: True})


def test_a_state_dict_with_a_number_step_loads_and_steps() -> None:
    # torch < 1.12 and DeepSpeed keep the step as a plain number.
    params = make_params()
    twins = clone_params(params)
    ours, reference = CPUAdam(params, **HYPER), torch.optim.AdamW(twins, **HYPER, foreach=False)
    _twin_steps(ours, reference, params, twins, range(2))
    saved = copy.deepcopy(ours.state_dict())
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())
    loaded = CPUAdam(params, **HYPER)
    loaded.load_state_dict(saved)
    _twin_steps(loaded, reference, params, twins, range(2, 4))
    assert all(float(s["step"]) == 4 for s in loaded.state.values())
    for p, q in zip(params, twins):
        assert_close_in_ulps_of(p, q, 4 * HYPER["lr"], "param")


def test_state_dict_is_unchanged_by_load_deepcopy_and_pickle() -> None:
    import pickle

    params = make_params()
    ours = CPUAdam(params, **HYPER)
    for p, g in zip(params, grads_for(params, 0)):
        p.grad = g
    ours.step()
    original = ours.state_dict()
    loaded = CPUAdam(params, **HYPER)
    loaded.load_state_dict(copy.deepcopy(original))
    for other in (loaded, copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert other.state_dict()["param_groups"] == original["param_groups"]
