"""CPUAdam with state_precision="8bit": against torch.optim.AdamW, the precision arguments, and
state dicts saved as codes and converted between precisions."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor

from cpu_adam import CPUAdam, OffloadOptimizer, ops, quant8


def train(optimizer_for, steps: int = 30) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
    start = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(256, 64), torch.randn(256, 8)
    optimizer = optimizer_for(model.parameters())
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return model, optimizer, start


def test_cpu_adam_8bit_follows_adamw() -> None:
    """One step's direction m / sqrt(v) carries a relative error of at most 2^-4 (half a step of
    m's 3 mantissa bits) + 2^-5 (the root's 4 bits), 9.4%, for values within 14 binades of their
    block's largest; those errors are unbiased roundings, so over T steps the displacement from the
    start stays within 10% of AdamW's in L2 (measured: 4-6% at T = 30). Elementwise, each step moves
    a weight by at most about lr, so |p_8bit - p_adamw| <= T lr is the hard bound; we require half
    of it (measured: 0.27 T lr)."""
    steps, lr = 30, 1e-3
    ours, optimizer, start = train(lambda ps: CPUAdam(ps, lr=lr, state_precision="8bit"), steps)
    theirs, _, _ = train(lambda ps: torch.optim.AdamW(ps, lr=lr), steps)
    for a, b, p0 in zip(ours.parameters(), theirs.parameters(), start):
        assert (a - b).abs().max() <= 0.5 * steps * lr
        assert (a - b).norm() <= 0.10 * (b - p0).norm()
        assert not torch.equal(a, b)  # 8-bit states really are in use
    state = optimizer.state[next(ours.parameters())]
    assert state["exp_avg"].dtype == torch.uint8 and state["state_scales"].shape == (2, 32)


def test_8bit_moments_follow_slow_changes_on_average() -> None:
    """With beta2 = 0.999, sqrt(v) moves about 0.05% a step, a few percent of half a code step:
    codes rounded to nearest would stay put, and the bias correction would then shrink the v the
    step uses (v_hat / E[g^2] measured 0.48 after 300 steps, 0.26 after 3000, on such grads).
    Rounded stochastically, both moments stay unbiased: on stationary grads of known mean and
    variance, spread over three decades within every block, their bias-corrected averages over
    4096 elements match E[g] and E[g^2] (the averages' own noise: about 0.3%)."""
    n, steps, beta1, beta2 = 4096, 1000, 0.9, 0.999
    g = torch.Generator().manual_seed(0)
    sigma = torch.logspace(-4, -1, n)[torch.randperm(n, generator=g)]
    mean = 0.5 * sigma
    weights = torch.nn.Parameter(torch.zeros(n))
    optimizer = CPUAdam([weights], lr=0.0, betas=(beta1, beta2), state_precision="8bit", seed=1)
    for _ in range(steps):
        weights.grad = mean + sigma * torch.randn(n, generator=g)
        optimizer.step()
    state = optimizer.state[weights]
    m, v = quant8.dequantize_moments(state["exp_avg"], state["exp_avg_sq"], state["state_scales"])
    v_ratio = (v / (1 - beta2**steps) / (sigma**2 + mean**2)).mean().item()
    m_ratio = (m / (1 - beta1**steps) / mean).mean().item()
    assert abs(v_ratio - 1) < 0.03, v_ratio
    assert abs(m_ratio - 1) < 0.03, m_ratio


@pytest.mark.parametrize("optimizer_class", [CPUAdam, OffloadOptimizer])
def test_the_default_seed_is_not_drawn(optimizer_class: type) -> None:
    """Data-parallel replicas seeded per rank must round their codes alike, and building an
    optimizer must not shift the user's random stream."""
    for rank in (0, 1):
        torch.manual_seed(rank)
        before = torch.random.get_rng_state()
        params = [torch.nn.Parameter(torch.zeros(300, dtype=torch.bfloat16))]
        optimizer = optimizer_class(params, state_precision="8bit")
        assert torch.equal(torch.random.get_rng_state(), before)
        seed = optimizer.seed if isinstance(optimizer, OffloadOptimizer) else optimizer.param_groups[0]["seed"]
        assert seed == 0


def test_precision_arguments() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert CPUAdam(p, fp32_optimizer_states=False).defaults["state_precision"] == "bf16"
    assert CPUAdam(p, state_precision="bf16", fp32_optimizer_states=False).defaults["state_precision"] == "bf16"
    with pytest.raises(ValueError, match="means"):
        CPUAdam(p, state_precision="8bit", fp32_optimizer_states=True)
    with pytest.raises(ValueError, match="state_precision"):
        CPUAdam(p, state_precision="int4")


def moments_of(optimizer: torch.optim.Optimizer) -> list[dict[str, Tensor]]:
    return [{k: v for k, v in s.items() if k != "step"} for s in optimizer.state.values()]


def test_state_dict_round_trips_and_converts() -> None:
    model, eight, _ = train(lambda ps: CPUAdam(ps, state_precision="8bit"), steps=3)
    saved = copy.deepcopy(eight.state_dict())
    again = CPUAdam(model.parameters(), state_precision="8bit")
    again.load_state_dict(saved)
    for a, b in zip(moments_of(again), moments_of(eight)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # 8-bit into fp32 and bf16: dequantized
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        wide = CPUAdam(model.parameters(), state_precision=precision)
        wide.load_state_dict(saved)
        for a, b in zip(moments_of(wide), moments_of(eight)):
            m, v = quant8.dequantize_moments(b["exp_avg"], b["exp_avg_sq"], b["state_scales"])
            assert set(a) == {"exp_avg", "exp_avg_sq"}
            assert torch.equal(a["exp_avg"], m.to(dtype)) and torch.equal(a["exp_avg_sq"], v.to(dtype))
        assert wide.param_groups[0]["state_precision"] == precision
        # and back: quantized again, to the very same values (a code's value encodes to itself; a
        # block whose largest value rounded down to the largest code may now take the lower scale)
        back = CPUAdam(model.parameters(), state_precision="8bit")
        back.load_state_dict(wide.state_dict())
        if precision == "fp32":
            for a, b in zip(moments_of(back), moments_of(eight)):
                ours = quant8.dequantize_moments(a["exp_avg"], a["exp_avg_sq"], a["state_scales"])
                theirs = quant8.dequantize_moments(b["exp_avg"], b["exp_avg_sq"], b["state_scales"])
                assert all(torch.equal(x, y) for x, y in zip(ours, theirs))
    # torch AdamW into 8-bit: quantized, and steps on
    _, adamw, _ = train(lambda ps: torch.optim.AdamW(ps), steps=3)
    loaded = CPUAdam(model.parameters(), state_precision="8bit")
    loaded.load_state_dict(adamw.state_dict())
    for a, b in zip(moments_of(loaded), moments_of(adamw)):
        codes = quant8.quantize_moments(b["exp_avg"], b["exp_avg_sq"])
        assert all(torch.equal(x, y) for x, y in zip((a["exp_avg"], a["exp_avg_sq"], a["state_scales"]), codes))
    assert loaded.param_groups[0]["state_precision"] == "8bit"


@pytest.mark.parametrize("stochastic_rounding", [True, False])
def test_compiled_8bit_step_is_bitwise_the_eager_step(stochastic_rounding: bool) -> None:
    """The 8-bit group is the second: its codes' random bits come from its own place in the counter
    space, with or without stochastic rounding of the params."""

    def build() -> tuple[list[torch.nn.Parameter], CPUAdam]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16)) for n in (4097, 300)]
        groups = [{"params": params[:1], "state_precision": "fp32"}, {"params": params[1:]}]
        return params, CPUAdam(groups, lr=1e-2, state_precision="8bit", stochastic_rounding=stochastic_rounding, seed=5)

    torch._dynamo.reset()
    (eager_params, eager), (compiled_params, compiled) = build(), build()
    train_step = torch.compile(compiled.step, fullgraph=True)
    for step in range(4):
        for p, q in zip(eager_params, compiled_params):
            grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step)).to(p.dtype)
            p.grad, q.grad = grad.clone(), grad.clone()
        eager.step()
        train_step()
        for p, q in zip(eager_params, compiled_params):
            assert torch.equal(p, q), f"step {step}"
            for key, value in eager.state[p].items():
                assert torch.equal(value, compiled.state[q][key]), f"{key}, step {step}"
    assert eager.state[eager_params[1]]["exp_avg"].dtype == torch.uint8
    assert eager.state[eager_params[0]]["exp_avg"].dtype == torch.float32


def test_8bit_codes_draw_the_bits_of_each_params_place() -> None:
    """Without stochastic_rounding too, a param's codes draw the random bits of its place in its
    group's counter space: here the second param of the second group."""
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (100, 300, 700)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    start = [p.detach().clone() for p in params]
    optimizer = CPUAdam([{"params": params[:1]}, {"params": params[1:]}], lr=1e-2, state_precision="8bit", seed=9)
    optimizer.step()

    def codes_at(offset: int) -> Tensor:
        p, m, u = start[2].clone(), torch.zeros(700, dtype=torch.uint8), torch.zeros(700, dtype=torch.uint8)
        scales = torch.ones(2, quant8.blocks(700))
        ops.adam_step(
            [p], [params[2].grad], [m], [u], state_scales=[scales], counter_offsets=[offset], seed=9, step=1,
            lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
        )  # fmt: skip
        return m

    place = ops.group_counter_base(1) + 512  # after the group's first param, 300 elements on 256-element places
    assert torch.equal(optimizer.state[params[2]]["exp_avg"], codes_at(place))
    assert not torch.equal(codes_at(place), codes_at(0))  # the place matters
