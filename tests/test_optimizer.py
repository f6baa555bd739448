"""CPUAdam against torch.optim.AdamW and Adam: steps, groups, schedulers, closures, state dicts."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import failing_unless_checking, printed_groups, raw, ulp_distance

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
        return [
            {"params": ps[:2]},
            {"params": ps[2:3], "weight_decay": 0.0, "lr": 3e-2, "eps": 1e-6, "maximize": True},
        ]

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
        (lambda groups: groups[1].update(lr=float("nan")), ValueError, "Invalid learning rate: nan"),
        (lambda groups: groups[1].update(eps=float("inf")), ValueError, "Invalid epsilon value: inf"),
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


def test_a_kernel_call_that_raises_changes_nothing_and_its_retry_equals_a_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    from cpu_adam import _compiled_step

    def run(fail_at: int | None) -> list[torch.Tensor]:
        params = make_params()
        optimizer = CPUAdam(params, **HYPER)
        for step in range(4):
            for p, g in zip(params, grads_for(params, step)):
                p.grad = g
            if step == fail_at:
                before = _state_snapshot(optimizer, params)
                real = _compiled_step.adam_step
                monkeypatch.setattr(_compiled_step, "adam_step", failing_unless_checking(real))
                with pytest.raises(RuntimeError, match="simulated kernel failure"):
                    optimizer.step()
                monkeypatch.setattr(_compiled_step, "adam_step", real)
                assert all(torch.equal(a, b) for a, b in zip(_state_snapshot(optimizer, params), before))
            optimizer.step()  # the retry, on the same grads
        return _state_snapshot(optimizer, params)

    assert all(torch.equal(a, b) for a, b in zip(run(fail_at=2), run(fail_at=None)))


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


@pytest.mark.parametrize("option", ["amsgrad", "capturable", "differentiable"])
def test_amsgrad_capturable_and_differentiable_are_refused(option: str) -> None:
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


def with_grads(params, step: int) -> None:
    for p, g in zip(params, grads_for(params, step)):
        p.grad = g


def snapshot(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a step or a load could change: params and state bitwise, hyper-parameters as printed."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {
        "params": [raw(p) for p in params],
        "state": [
            {k: raw(v) if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
            for p in params
            if p in optimizer.state
        ],
        "groups": repr([{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]),
    }


def assert_same_snapshot(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["groups"] == after["groups"]
    assert len(before["params"]) == len(after["params"])
    assert all(torch.equal(a, b) for a, b in zip(before["params"], after["params"])), "a param changed"
    assert [sorted(s) for s in before["state"]] == [sorted(s) for s in after["state"]]
    for a, b in zip(before["state"], after["state"]):
        assert all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a), "state changed"


# ---- hyper-parameters: torch's exceptions, and checked wherever they come from ----

NAN, INF = float("nan"), float("inf")

ADAMW_REFUSES = [
    {"lr": -1},
    {"lr": -1.0},
    {"lr": NAN},
    {"lr": torch.tensor(-1.0)},
    {"lr": torch.tensor([1e-3, 1e-3])},
    {"eps": -1e-8},
    {"eps": NAN},
    {"betas": (1.0, 0.0)},
    {"betas": (0.9, 1.5)},
    {"betas": (NAN, 0.9)},
    {"weight_decay": -1},
    {"weight_decay": NAN},
    {"foreach": True, "fused": True},
    {"fused": True, "differentiable": True},
]


@pytest.mark.parametrize("kwargs", ADAMW_REFUSES, ids=repr)
def test_what_adamw_refuses_raises_adamws_exception_and_message(kwargs: dict) -> None:
    with pytest.raises(Exception) as theirs:
        torch.optim.AdamW(make_params(), **kwargs)
    with pytest.raises(Exception) as ours:
        CPUAdam(make_params(), **kwargs)
    assert type(ours.value) is type(theirs.value)
    assert str(ours.value).startswith(str(theirs.value)), "torch's message, then ours"
    assert "CPUAdam" in str(ours.value)


# (kwargs, what torch.optim.AdamW raises constructing or stepping, or None; what CPUAdam raises, and its match)
BEYOND_ADAMW = [
    ({"lr": INF}, None, ValueError, r"Invalid learning rate: inf \(CPUAdam: lr must be a finite"),
    ({"eps": INF}, None, ValueError, r"Invalid epsilon value: inf \(CPUAdam: eps must be a finite"),
    ({"weight_decay": INF}, None, ValueError, r"Invalid weight_decay value: inf \(CPUAdam"),
    ({"lr": "x"}, TypeError, TypeError, "CPUAdam: lr must be a number, got 'x'"),
    ({"lr": True}, None, TypeError, "CPUAdam: lr must be a number, got True"),
    ({"betas": None}, TypeError, TypeError, r"CPUAdam: betas must be a pair of numbers \(beta1, beta2\), got None"),
    ({"betas": ("a", 0.9)}, TypeError, TypeError, "betas must be a pair of numbers"),
    # IndexError and a failed unpacking at the first step are accidents of torch's code.
    ({"betas": (0.9,)}, IndexError, ValueError, r"betas must be a pair of numbers .*got \(0\.9,\)"),
    ({"betas": (0.9, 0.99, 0.5)}, ValueError, ValueError, "betas must be a pair of numbers"),
    # Tensor betas serve torch's capturable steps; the kernel takes numbers.
    ({"betas": (torch.tensor(0.9), torch.tensor(0.99))}, None, TypeError, "tensor betas are not supported"),
    ({"betas": (0.9, torch.tensor(0.99))}, ValueError, TypeError, "tensor betas are not supported"),
]


@pytest.mark.parametrize(("kwargs", "torch_raises", "error", "match"), BEYOND_ADAMW, ids=lambda v: repr(v)[:40])
def test_what_adamw_does_not_check_is_refused_clearly(kwargs, torch_raises, error, match) -> None:
    def adamw_outcome() -> type | None:
        try:
            params = make_params()
            with_grads(params, 0)
            torch.optim.AdamW(params, **kwargs).step()
        except Exception as e:
            return type(e)
        return None

    assert adamw_outcome() is torch_raises
    with pytest.raises(error, match=match):
        CPUAdam(make_params(), **kwargs)


@pytest.mark.parametrize(
    ("seed", "error", "match"),
    [
        ("x", TypeError, "CPUAdam: seed must be an integer, got 'x'"),
        (1.5, TypeError, "CPUAdam: seed must be an integer, got 1.5"),
        (2**64, ValueError, "CPUAdam: seed must fit in 64 bits"),
    ],
)
def test_the_seed_must_be_a_64_bit_integer(seed: Any, error: type, match: str) -> None:
    with pytest.raises(error, match=re.escape(match)):
        CPUAdam(make_params(), seed=seed)


@pytest.fixture
def two_groups() -> tuple[list[torch.nn.Parameter], CPUAdam]:
    """An optimizer over two param groups that has stepped twice."""
    params = make_params()
    optimizer = CPUAdam([{"params": params[:2]}, {"params": params[2:], "lr": 3e-2}], **HYPER)
    for step in range(2):
        with_grads(params, step)
        optimizer.step()
    with_grads(params, 2)
    return params, optimizer


BAD_VALUES = [
    ("lr", -1.0, ValueError, "Invalid learning rate: -1.0"),
    ("lr", NAN, ValueError, "Invalid learning rate: nan"),
    ("lr", INF, ValueError, "Invalid learning rate: inf"),
    ("lr", torch.tensor(-1.0), ValueError, "Invalid learning rate: -1.0"),
    ("betas", (0.9, 1.5), ValueError, "Invalid beta parameter at index 1: 1.5"),
    ("betas", None, TypeError, "betas must be a pair of numbers"),
    ("eps", INF, ValueError, "Invalid epsilon value: inf"),
    ("weight_decay", -0.1, ValueError, "Invalid weight_decay value: -0.1"),
    ("seed", "x", TypeError, "seed must be an integer"),
    ("amsgrad", True, ValueError, "set amsgrad False"),
    ("capturable", True, ValueError, "set capturable False"),
]


@pytest.mark.parametrize(("key", "value", "error", "match"), BAD_VALUES, ids=lambda v: repr(v)[:24])
@pytest.mark.parametrize("source", ["param group edit", "add_param_group", "load_state_dict"])
def test_bad_values_are_refused_wherever_they_come_from_before_anything_changes(
    two_groups, source: str, key: str, value: Any, error: type, match: str
) -> None:
    params, optimizer = two_groups
    if source == "param group edit":
        optimizer.param_groups[1][key] = value  # as a scheduler would; group 0 must not step either
        before = snapshot(optimizer)
        with pytest.raises(error, match=re.escape(match)):
            optimizer.step()
    elif source == "add_param_group":
        before = snapshot(optimizer)
        with pytest.raises(error, match=re.escape(match)):
            optimizer.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], key: value})
    else:
        saved = copy.deepcopy(optimizer.state_dict())
        saved["param_groups"][1][key] = value
        for state in saved["state"].values():  # would be loaded, if the load went ahead
            state["exp_avg"].fill_(7.0)
        before = snapshot(optimizer)
        with pytest.raises(error, match=re.escape(match)):
            optimizer.load_state_dict(saved)
    assert_same_snapshot(before, snapshot(optimizer))
    assert all(p.grad is not None for p in params)


def test_beta2_above_one_after_many_steps_is_refused_not_an_overflow(two_groups) -> None:
    # Python's 1.5 ** 5001 raises OverflowError; the range check refuses it first.
    _, optimizer = two_groups
    for state in optimizer.state.values():
        state["step"].fill_(5000.0)
    optimizer.param_groups[0]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1\.5"):
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    optimizer.param_groups[0]["betas"] = (0.9, 0.999)
    with pytest.raises(ValueError, match=r"Invalid beta parameter at index 1: 1\.5"):
        optimizer.load_state_dict(saved)


@pytest.mark.parametrize("step", [NAN, -1.0, 2.5, INF, torch.tensor(NAN), torch.tensor([1.0, 2.0]), "3"], ids=repr)
def test_damaged_step_counts_are_refused_at_load(two_groups, step: Any) -> None:
    _, optimizer = two_groups
    saved = copy.deepcopy(optimizer.state_dict())
    saved["state"][1]["step"] = step
    before = snapshot(optimizer)
    with pytest.raises(ValueError, match=r"CPUAdam\.load_state_dict: the state of param 1: a step count must be"):
        optimizer.load_state_dict(saved)
    assert_same_snapshot(before, snapshot(optimizer))


def test_a_tensor_lr_steps_as_the_float_lr_under_a_scheduler() -> None:
    # As torch accepts it (any 1-element tensor); schedulers change it in place. In float64 it
    # holds the float's value exactly.
    runs = []
    for lr in (
        HYPER["lr"],
        torch.tensor(HYPER["lr"], dtype=torch.float64),
        torch.tensor([HYPER["lr"]], dtype=torch.float64),
    ):
        params = make_params()
        optimizer = CPUAdam(params, **{**HYPER, "lr": lr})
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
        for step in range(5):
            with_grads(params, step)
            optimizer.step()
            scheduler.step()
        assert float(optimizer.param_groups[0]["lr"]) == HYPER["lr"] / 4
        runs.append(params)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


# ---- torch.optim conventions, over torch's AdamW configs ----


def adamw_configs() -> dict[str, dict[str, Any]]:
    """torch's AdamW configs for the CPU (torch.testing._internal.common_optimizers), with the
    implementation flags its tests add; amsgrad and differentiable are refused (tested above).
    Made anew for each test: a tensor lr is changed in place by schedulers."""
    return {
        "default": {},
        "non-default lr": {"lr": 0.01},
        "nonzero weight_decay": {"weight_decay": 0.1},
        "maximize": {"weight_decay": 0.1, "maximize": True},
        "tensor lr": {"lr": torch.tensor(0.001)},
        "foreach": {"foreach": True},
        "fused": {"fused": True},
    }


CONFIGS = list(adamw_configs())


def assert_same_state_dicts(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert repr(a["param_groups"]) == repr(b["param_groups"])
    assert a["state"].keys() == b["state"].keys()
    for i, state in a["state"].items():
        assert state.keys() == b["state"][i].keys()
        for key, value in state.items():
            assert torch.equal(raw(value), raw(b["state"][i][key])), f"state[{i}][{key!r}] differs"


def _assert_five_steps_as(torch_class: type, ours_options: dict[str, Any], options: dict[str, Any]) -> None:
    ours_params = make_params()
    torch_params = clone_params(ours_params)
    ours = CPUAdam(ours_params, **ours_options, **options)
    reference = torch_class(torch_params, **options)
    _twin_steps(ours, reference, ours_params, torch_params, range(5))
    scale = 5 * float(ours.param_groups[0]["lr"])
    for p, q in zip(ours_params, torch_params):
        assert_close_in_ulps_of(p, q, scale, "param")
        assert_close_in_ulps_of(ours.state[p]["exp_avg"], reference.state[q]["exp_avg"], GRAD_SCALE, "exp_avg")
        assert_ulps(ours.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"], 8, "exp_avg_sq")
        assert ours.state[p]["step"].item() == reference.state[q]["step"].item() == 5


def test_adam_l2_with_maximize_steps_as_torch_adam() -> None:
    # maximize is a grad scale of -1, which must not reach the L2 term
    _assert_five_steps_as(torch.optim.Adam, {"adamw_mode": False}, {"weight_decay": 0.1, "maximize": True})


@pytest.mark.parametrize("config", CONFIGS)
def test_configs_step_as_adamw(config: str) -> None:
    _assert_five_steps_as(torch.optim.AdamW, {}, adamw_configs()[config])


def test_step_hooks_run_in_torchs_order_and_can_be_removed() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    calls: list[str] = []
    params = make_params()
    ours, other = CPUAdam(params), torch.optim.SGD(clone_params(params))
    handles = [
        register_optimizer_step_pre_hook(lambda *_: calls.append("global pre")),
        register_optimizer_step_post_hook(lambda *_: calls.append("global post")),
    ]
    for optimizer in (ours, other):
        handles.append(optimizer.register_step_pre_hook(lambda *_: calls.append("pre")))
        handles.append(optimizer.register_step_post_hook(lambda *_: calls.append("post")))
    try:
        with_grads(params, 0)
        ours.step()
        assert calls == ["global pre", "pre", "post", "global post"]
        other.step()
        assert calls == 2 * ["global pre", "pre", "post", "global post"]
    finally:
        for handle in handles:
            handle.remove()
    ours.step()
    assert len(calls) == 8
    # A pre hook may replace the arguments: here it hands step() a closure.
    ours.register_step_pre_hook(lambda optimizer, args, kwargs: (args, {"closure": lambda: 2.5}))
    assert ours.step() == 2.5


def test_state_dict_hooks() -> None:
    params = make_params()
    optimizer = CPUAdam(params)
    optimizer.register_state_dict_pre_hook(lambda o: o.state.__setitem__("marker", 1))

    def post_hook(o, state_dict):
        state_dict["ran_pre_hook"] = state_dict["state"].pop("marker", None) == 1
        return state_dict

    optimizer.register_state_dict_post_hook(post_hook)
    state_dict = optimizer.state_dict()
    assert state_dict["ran_pre_hook"] and "marker" not in state_dict["state"]
    # A state entry that is no param's (torch's load hooks in its tests add some) loads too.
    with_grads(params, 0)
    optimizer.step()
    state_dict["state"]["marker"] = 2
    optimizer.load_state_dict(state_dict)
    assert optimizer.state["marker"] == 2


def test_load_state_dict_hooks_see_the_whole_state_dict_and_the_loaded_optimizer() -> None:
    params = make_params(torch.bfloat16)
    saver = CPUAdam(params, lr=1e-3)
    with_grads(params, 0)
    saver.step()
    saved = saver.state_dict()
    loader = CPUAdam(params, fp32_optimizer_states=False)
    seen: dict[str, Any] = {}

    def set_lr(lr: float):
        def hook(optimizer, state_dict):
            seen.setdefault("moments in the pre hook", "exp_avg" in state_dict["state"][0])
            state_dict["param_groups"][0]["lr"] = lr

        return hook

    def post_hook(optimizer) -> None:
        seen["moment dtype in the post hook"] = optimizer.state[params[0]]["exp_avg"].dtype

    loader.register_load_state_dict_pre_hook(set_lr(2e-3))
    loader.register_load_state_dict_post_hook(post_hook)
    loader.load_state_dict(saved)
    assert loader.param_groups[0]["lr"] == 2e-3
    assert seen == {"moments in the pre hook": True, "moment dtype in the post hook": torch.bfloat16}
    loader.register_load_state_dict_pre_hook(set_lr(3e-3), prepend=True)  # runs first: the other one wins
    loader.load_state_dict(saved)
    assert loader.param_groups[0]["lr"] == 2e-3
    loader.register_load_state_dict_pre_hook(
        lambda o, sd: {**sd, "param_groups": [{**sd["param_groups"][0], "lr": 4e-3}]}
    )
    loader.load_state_dict(saved)  # a returned state dict is the one loaded
    assert loader.param_groups[0]["lr"] == 4e-3


@pytest.mark.parametrize("config", CONFIGS)
def test_repr_lists_param_groups_as_torch_does(config: str) -> None:
    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "weight_decay": 0.5, "betas": (0.8, 0.9)}]

    ours = CPUAdam(groups(make_params()), **adamw_configs()[config])
    theirs = torch.optim.AdamW(groups(make_params()), **adamw_configs()[config])
    for mine, torchs, group in zip(printed_groups(ours), printed_groups(theirs), ours.param_groups):
        assert list(mine) == sorted(mine)
        assert mine.keys() == group.keys() - {"params"}
        shared = mine.keys() & torchs.keys()
        assert shared >= {"lr", "betas", "eps", "weight_decay", "maximize", "amsgrad", "decoupled_weight_decay"}
        assert {k: mine[k] for k in shared} == {k: torchs[k] for k in shared}


@pytest.mark.parametrize("config", CONFIGS)
def test_state_dict_is_deterministic_across_load_deepcopy_and_pickle(config: str) -> None:
    import pickle

    params = make_params()
    original = CPUAdam(params, **adamw_configs()[config], stochastic_rounding=True)
    for step in range(3):
        with_grads(params, step)
        original.step()
    saved = copy.deepcopy(original.state_dict())
    loaded_params = clone_params(params)
    loaded = CPUAdam(loaded_params, **adamw_configs()[config], stochastic_rounding=True)
    loaded.load_state_dict(saved)
    assert_same_state_dicts(saved, original.state_dict())  # loading did not change what was loaded
    copies = [copy.deepcopy(original), pickle.loads(pickle.dumps(original))]
    public = {k for k in vars(original) if not k.startswith("_")}
    assert all({k for k in vars(c) if not k.startswith("_")} == public for c in copies)
    others = [loaded, *copies]
    for other in others:
        assert_same_state_dicts(original.state_dict(), other.state_dict())
    for step in range(3, 6):  # and they go on alike
        for optimizer in (original, *others):
            with_grads([p for g in optimizer.param_groups for p in g["params"]], step)
            optimizer.step()
    for other in others:
        assert_same_state_dicts(original.state_dict(), other.state_dict())
        other_params = [p for g in other.param_groups for p in g["params"]]
        assert all(torch.equal(a, b) for a, b in zip(params, other_params))


def test_named_parameters_are_saved_and_loaded_as_torch_does() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    ours, theirs = CPUAdam(model.named_parameters()), torch.optim.AdamW(model.named_parameters())
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert ours.state_dict()["param_groups"][0]["param_names"] == names
    assert theirs.state_dict()["param_groups"][0]["param_names"] == names
    ours.load_state_dict(theirs.state_dict())


def test_zero_grad_keeping_zeros_steps_as_adamw_and_setting_none_skips() -> None:
    ours_params = make_params()
    torch_params = clone_params(ours_params)
    ours = CPUAdam(ours_params, **HYPER)
    reference = torch.optim.AdamW(torch_params, **HYPER, foreach=False)
    _twin_steps(ours, reference, ours_params, torch_params, range(1))
    grads = [p.grad for p in ours_params]
    for optimizer in (ours, reference):
        optimizer.zero_grad(set_to_none=False)
    assert all(p.grad is g and not g.any() for p, g in zip(ours_params, grads))
    ours.step()
    reference.step()
    for p, q in zip(ours_params, torch_params):  # decay, and moments that decay: a step all the same
        assert_close_in_ulps_of(p, q, 2 * HYPER["lr"], "param")
        assert ours.state[p]["step"].item() == reference.state[q]["step"].item() == 2
    ours.zero_grad()
    assert all(p.grad is None for p in ours_params)
    before = snapshot(ours)
    ours.step()
    assert_same_snapshot(before, snapshot(ours))


def test_steps_without_grads_or_with_zero_grads_change_nothing() -> None:
    # torch's test_step_is_noop_when_params_have_no_grad and _for_zero_grads (AdamW: lr 1e-5, no decay).
    params = [torch.randn(2, 3, requires_grad=False) for _ in range(2)]
    before = [p.clone() for p in params]
    optimizer = CPUAdam(params)
    assert optimizer.step(lambda: 1.0) == 1.0
    assert not optimizer.state and all(torch.equal(a, b) for a, b in zip(params, before))

    param = torch.nn.Parameter(torch.randn(5, 1))
    empty, scalar = torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.randn(()))
    before = raw(param)
    optimizer = CPUAdam([param, empty, scalar], lr=1e-5, weight_decay=0.0)
    for p in (param, empty, scalar):
        p.grad = torch.zeros_like(p)
    optimizer.step()
    assert torch.equal(raw(param), before)
    assert [s["step"].item() for s in optimizer.state.values()] == [1.0, 1.0, 1.0]


def test_a_warmup_from_lr_0_steps_as_adamw_from_its_first_grads() -> None:
    """A schedule that starts at lr 0 (HF's linear warmup) takes a real first step: its grads reach the moments and
    it is counted, as in AdamW. Only lr 0 with all-zero grads is torch.distributed.checkpoint's state
    initialisation, which counts nothing; taken for it, the first grads were lost and the count was one short."""
    ours_params = make_params()
    torch_params = clone_params(ours_params)
    ours = CPUAdam(ours_params, **HYPER)
    reference = torch.optim.AdamW(torch_params, **HYPER, foreach=False)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: min(1.0, step / 3)) for o in (ours, reference)]
    assert ours.param_groups[0]["lr"] == reference.param_groups[0]["lr"] == 0.0
    for step in range(5):
        _twin_steps(ours, reference, ours_params, torch_params, range(step, step + 1))
        for scheduler in schedulers:
            scheduler.step()
    for p, q in zip(ours_params, torch_params):
        assert ours.state[p]["step"].item() == reference.state[q]["step"].item() == 5
        assert_close_in_ulps_of(ours.state[p]["exp_avg"], reference.state[q]["exp_avg"], GRAD_SCALE, "exp_avg")
        assert_ulps(ours.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"], 8, "exp_avg_sq")
        assert_close_in_ulps_of(p, q, 4 * HYPER["lr"], "param")


# ---- torch.compile ----


@pytest.mark.slow
@pytest.mark.parametrize("lr", ["float", "tensor"])
def test_compiled_step_is_bitwise_the_eager_step(lr: str) -> None:
    from torch._dynamo.testing import CompileCounterWithBackend

    def build() -> tuple[list[torch.nn.Parameter], CPUAdam]:
        params = make_params(torch.bfloat16)
        group_lr = torch.tensor(3e-2) if lr == "tensor" else 3e-2
        groups = [
            {"params": params[:2]},
            {"params": params[2:], "lr": group_lr, "maximize": True, "weight_decay": 0.0, "betas": (0.8, 0.95)},
        ]
        first_lr = torch.tensor(HYPER["lr"]) if lr == "tensor" else HYPER["lr"]
        return params, CPUAdam(groups, **{**HYPER, "lr": first_lr}, stochastic_rounding=True, seed=5)

    torch._dynamo.reset()
    eager_params, eager = build()
    compiled_params, compiled = build()
    counter = CompileCounterWithBackend("inductor")

    @torch.compile(fullgraph=True, backend=counter)
    def train_step() -> None:
        compiled.step()

    for step in range(6):
        for i, (p, q, g) in enumerate(zip(eager_params, compiled_params, grads_for(eager_params, step))):
            p.grad, q.grad = (None, None) if (step, i) == (3, 1) else (g.clone(), g.clone())
        eager.step()
        train_step()
        assert all(torch.equal(raw(p), raw(q)) for p, q in zip(eager_params, compiled_params)), f"step {step}"
        if lr == "tensor":  # as torch's schedulers change a tensor lr: in place, no recompilation
            for optimizer in (eager, compiled):
                optimizer.param_groups[1]["lr"].mul_(0.5)
    assert_same_state_dicts(eager.state_dict(), compiled.state_dict())
    assert compiled.state[compiled_params[1]]["step"].item() == 5  # it had no grad once
    assert counter.frame_count == 2  # the graph, and the one for the step where a grad was missing


def test_a_compiled_step_refuses_bad_values_before_anything_changes() -> None:
    # Values that change between calls are symbols while traced: the step's op checks them when it
    # runs, every group before it steps any, and raises torch's exception even under fullgraph.
    params = make_params()
    groups = [{"params": params[:2], "lr": torch.tensor(1e-3)}, {"params": params[2:], "lr": torch.tensor(1e-3)}]
    optimizer = CPUAdam(groups, **{k: v for k, v in HYPER.items() if k != "lr"})
    train_step = torch.compile(optimizer.step, fullgraph=True, backend="aot_eager")
    with_grads(params, 0)
    train_step()

    def set_group(**values: Any) -> Callable[[dict[str, Any]], None]:
        return lambda group: group.update(values)

    cases = [
        (lambda group: group["lr"].fill_(-1.0), lambda group: group["lr"].fill_(1e-3), r"Invalid learning rate: -1\.0"),
        (set_group(betas=(0.9, 1.5)), set_group(betas=HYPER["betas"]), r"Invalid beta parameter at index 1: 1\.5"),
        (set_group(eps=float("inf")), set_group(eps=HYPER["eps"]), r"Invalid epsilon value: inf"),
    ]
    optimizer.param_groups[1]["betas"] = (0.9, 0.98)  # a second value: betas are symbols from now on
    train_step()
    for edit, undo, match in cases:
        edit(optimizer.param_groups[1])
        before = snapshot(optimizer)
        with pytest.raises(ValueError, match=match + r" \(CPUAdam param group 1 \(compiled step\)"):
            train_step()
        assert_same_snapshot(before, snapshot(optimizer))
        undo(optimizer.param_groups[1])
