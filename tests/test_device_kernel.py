"""The device kernel (Triton) against the host kernel, bit for bit, and its flushing against exact arithmetic.

On a machine without a GPU the kernels run in Triton's interpreter on CPU tensors: the same source a
GPU compiles, each float32 operation rounded once. Where CUDA exists, the same comparisons run on it.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any

import pytest
import torch
from conftest import DTYPES, raw

from cpu_adam import ops, quant8

triton = pytest.importorskip("triton", reason="the device kernel is written in Triton")
tl = pytest.importorskip("triton.language")

from cpu_adam import device_kernel  # noqa: E402
from cpu_adam.device_kernel import kernels, launch  # noqa: E402
from cpu_adam.device_kernel.floats import div, fma, mul, sub  # noqa: E402

STATES = {**DTYPES, "q8": torch.uint8}
LAYOUTS = [(p, g, s) for p in DTYPES for g in DTYPES for s in STATES]
SIZES = [1, 2, 7, 255, 256, 257, 1000, 4097, 9001]
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
VARIANTS = {
    "adamw+scale+out": {"step": 3, "weight_decay": 0.1, "grad_scale": 0.37, "with_out": True},
    "l2+no_bias_correction": {"step": 7, "weight_decay": 0.1, "adamw_mode": False, "bias_correction": False},
    "stochastic+beta1=0": {"step": 2, "stochastic_rounding": True, "seed": 9, "beta1": 0.0, "with_out": True},
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


def make_tuple(n: int, layout: tuple[str, str, str], seed: int, tiny: bool = False) -> dict[str, Any]:
    """param, grad and moments over many binades; ``tiny``: around the float32 underflow, where flushing decides."""
    g = torch.Generator().manual_seed(seed)
    low, high = (-70, -55) if tiny else (-20, 4)
    scale = torch.exp2(torch.randint(low, high, (n,), generator=g).float())
    p_dtype, g_dtype, s_dtype = (STATES[k] for k in layout)
    m = torch.randn(n, generator=g) * scale * 0.1
    v = (torch.randn(n, generator=g) * scale).square()
    grad = torch.randn(n, generator=g) * scale
    if tiny:  # some exact zeros, and denormals the kernels must read as zeros
        grad[::7] = 0.0
        v[1::5] = torch.finfo(torch.float32).tiny * torch.rand(v[1::5].shape, generator=g)
    tensors = {"param": torch.randn(n, generator=g).to(p_dtype), "grad": grad.to(g_dtype)}
    if s_dtype == torch.uint8:
        tensors["exp_avg"], tensors["exp_avg_sq"], tensors["scales"] = quant8.quantize_moments(m, v)
    else:
        tensors["exp_avg"], tensors["exp_avg_sq"] = m.to(s_dtype), v.to(s_dtype)
    return tensors


def step(kernel: Any, tensors: dict[str, Any], device: str, with_out: bool, **kwargs: Any) -> dict[str, torch.Tensor]:
    t = {k: v.clone().to(device) for k, v in tensors.items()}
    if with_out:
        t["out"] = torch.full_like(t["param"], float("nan"), dtype=torch.bfloat16)
    kernel(
        [t["param"]],
        [t["grad"]],
        [t["exp_avg"]],
        [t["exp_avg_sq"]],
        bf16_outs=[t["out"]] if with_out else None,
        state_scales=[t["scales"]] if "scales" in t else None,
        **kwargs,
    )
    return {k: v.cpu() for k, v in t.items() if k != "grad"}


def assert_same(device_result: dict[str, torch.Tensor], host_result: dict[str, torch.Tensor], what: str) -> None:
    for name, expected in host_result.items():
        actual = device_result[name]
        differ = raw(actual) != raw(expected)
        assert not differ.any(), f"{what}: {name} differs in {int(differ.sum())} bytes"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
def test_every_layout_and_size_steps_as_the_host_kernel_bitwise(device: str, layout: tuple[str, str, str]) -> None:
    for n in SIZES:
        for name, variant in VARIANTS.items():
            kwargs = {**HYPER, **variant}
            with_out = kwargs.pop("with_out", False)
            tensors = make_tuple(n, layout, seed=n)
            host = step(ops.adam_step, tensors, "cpu", with_out, **kwargs)
            dev = step(device_kernel.adam_step, tensors, device, with_out, before_rounding=False, **kwargs)
            assert_same(dev, host, f"n={n} {name}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "layout", [("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("f32", "bf16", "q8")], ids="-".join
)
def test_values_at_the_underflow_are_flushed_as_the_host_flushes_them(
    device: str, layout: tuple[str, str, str]
) -> None:
    # grads near 2^-64: g * g * (1 - beta2) and v * beta2 land on both sides of 2^-126
    for seed in range(4):
        tensors = make_tuple(20000, layout, seed=seed, tiny=True)
        for kwargs in ({"step": 1, "eps": 1e-30}, {"step": 9, "eps": 0.0, "weight_decay": 1e-30, "adamw_mode": False}):
            kwargs = {**HYPER, **kwargs}
            host = step(ops.adam_step, tensors, "cpu", True, **kwargs)
            dev = step(device_kernel.adam_step, tensors, device, True, before_rounding=False, **kwargs)
            assert_same(dev, host, f"seed {seed} {kwargs}")


@pytest.mark.parametrize("layout", [("bf16", "bf16", "bf16"), ("bf16", "f32", "q8")], ids="-".join)
def test_random_bits_across_the_2_to_the_32_counter_boundary_are_the_hosts(layout: tuple[str, str, str]) -> None:
    tensors = make_tuple(3000, layout, seed=5)
    for offset in (2**32 - 1000, 2**32 - 256, 7 * 2**32 + 2**20):  # the boundary mid-block, on a block, far away
        kwargs = {**HYPER, "step": 4, "stochastic_rounding": True, "seed": 11, "counter_offsets": [offset]}
        host = step(ops.adam_step, tensors, "cpu", True, **kwargs)
        dev = step(device_kernel.adam_step, tensors, "cpu", True, before_rounding=False, **kwargs)
        assert_same(dev, host, f"offset {offset}")


def test_several_tensors_in_one_call_draw_the_bits_of_their_places() -> None:
    shapes = [(33, 17), (4097,), (5,)]
    tensors = [make_tuple(math.prod(s), ("bf16", "bf16", "q8"), seed=i) for i, s in enumerate(shapes)]

    def run(kernel: Any, **extra: Any) -> list[torch.Tensor]:
        t = [{k: v.clone() for k, v in x.items()} for x in tensors]
        lists = [[x[k] for x in t] for k in ("param", "grad", "exp_avg", "exp_avg_sq", "scales")]
        kernel(*lists[:4], state_scales=lists[4], step=2, stochastic_rounding=True, seed=3, **HYPER, **extra)
        return [raw(x[k]) for x in t for k in ("param", "exp_avg", "exp_avg_sq", "scales")]

    host, dev = run(ops.adam_step), run(device_kernel.adam_step, before_rounding=False)
    assert all(torch.equal(a, b) for a, b in zip(dev, host))


@triton.jit
def _div_by_reciprocal(a, b, BEFORE_ROUNDING: tl.constexpr):
    return a * tl.math.div_rn(1.0, b)  # rounds twice


def test_a_kernel_with_one_rounding_changed_fails_the_comparison(monkeypatch: pytest.MonkeyPatch) -> None:
    # The comparison can fail: an update whose product rounds differently (a fused multiply-add) is caught.
    tensors = make_tuple(4097, ("f32", "f32", "f32"), seed=1)
    host = step(ops.adam_step, tensors, "cpu", False, **HYPER, step=3)

    monkeypatch.setattr(kernels, "div", _div_by_reciprocal)
    monkeypatch.setattr(launch, "_namespaces", {})
    monkeypatch.setattr(launch, "_twins", {})
    dev = step(device_kernel.adam_step, tensors, "cpu", False, before_rounding=False, **HYPER, step=3)
    assert any(not torch.equal(raw(dev[k]), raw(host[k])) for k in host)


def test_tensors_it_cannot_step_are_refused_with_the_reason() -> None:
    p, g = torch.zeros(8), torch.zeros(8)
    with pytest.raises(ValueError, match="contiguous"):
        device_kernel.adam_step([torch.zeros(8, 2)[:, 0]], [g], [p.clone()], [p.clone()], step=1, **HYPER)
    with pytest.raises(TypeError, match="moments of param 0"):
        device_kernel.adam_step([p], [g], [p.clone()], [p.to(torch.bfloat16)], step=1, **HYPER)
    with pytest.raises(ValueError, match="has 4 elements"):
        device_kernel.adam_step([p], [torch.zeros(4)], [p.clone()], [p.clone()], step=1, **HYPER)
    with pytest.raises(ValueError, match="beta2 must be in"):
        device_kernel.adam_step([p], [g], [p.clone()], [p.clone()], step=1, **{**HYPER, "beta2": 1.5})


# -- the flushing rules, op by op, against exact arithmetic ------------------------------------------------------

SMALLEST_NORMAL = Fraction(1, 2**126)


def _rounded(x: Fraction) -> Fraction:
    """x rounded to 24 significant bits, ties to even, with an unbounded exponent."""
    if x == 0:
        return x
    sign, x = (-1 if x < 0 else 1), abs(x)
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    ulp = Fraction(2) ** (e - 23)
    q, r = divmod(x, ulp)
    q += 1 if r > ulp / 2 or (r == ulp / 2 and q % 2) else 0
    return sign * q * ulp


def _flushed_exactly(exact: Fraction, zero_sign: float, before_rounding: bool) -> float:
    rounded = _rounded(exact)
    tiny = abs(exact if before_rounding else rounded) < SMALLEST_NORMAL
    if exact == 0 or tiny:
        return math.copysign(0.0, zero_sign if exact == 0 else float(exact))
    return float(rounded)


@triton.jit
def _one_op(a_ptr, b_ptr, c_ptr, out_ptr, n, OP: tl.constexpr, BEFORE_ROUNDING: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    a, b, c = tl.load(a_ptr + i, mask=mask), tl.load(b_ptr + i, mask=mask), tl.load(c_ptr + i, mask=mask)
    if OP == 0:
        r = mul(a, b, BEFORE_ROUNDING)
    elif OP == 1:
        r = div(a, b, BEFORE_ROUNDING)
    elif OP == 2:
        r = fma(a, b, c, BEFORE_ROUNDING)
    else:
        r = sub(a, b)
    tl.store(out_ptr + i, r, mask=mask)


def _operands(op: str, count: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normal operands whose exact result lies within a few ulps of 2^-126, on both sides, and some zeros."""
    g = torch.Generator().manual_seed(seed)
    tiny = torch.finfo(torch.float32).tiny
    exponents = (
        torch.randint(-124, -119, (count,), generator=g)
        if op == "sub"
        else torch.randint(-60, 0, (count,), generator=g)
    )
    a = (1 + torch.rand(count, generator=g)) * torch.exp2(exponents.float())
    a = a * torch.where(torch.rand(count, generator=g) < 0.5, -1.0, 1.0)
    c = torch.zeros(count)
    near = tiny * (1 + (torch.randint(-64, 64, (count,), generator=g).float() * 2**-24))
    if op == "mul":
        b = near / a.abs()  # a * b within a few ulps of 2^-126 after b's rounding; b normal as |a| < 1
    elif op == "div":
        b = a.abs() / near
    elif op == "fma":
        b = (1 + torch.rand(count, generator=g)) * 2.0**-60
        c = (near - a.double() * b.double()).float()  # cancels all but a residue near 2^-126
    else:
        b = a - near
    a[::11] = 0.0
    return a, b, c


@pytest.mark.parametrize(
    "before_rounding", [False, True], ids=["x86: tiny after rounding", "ARM: tiny before rounding"]
)
@pytest.mark.parametrize("op", ["mul", "div", "fma", "sub"])
def test_each_operation_flushes_as_the_hosts_architecture_does(op: str, before_rounding: bool) -> None:
    a, b, c = _operands(op, 4000, seed=len(op))
    out = torch.empty_like(a)
    code = ["mul", "div", "fma", "sub"].index(op)
    kernel = launch.for_device(_one_op, a.device)
    kernel[(1,)](a, b, c, out, a.numel(), OP=code, BEFORE_ROUNDING=before_rounding, BLOCK=4096)
    expected, flushed_count = [], 0
    for x, y, z in zip(a.tolist(), b.tolist(), c.tolist()):
        fx, fy, fz = Fraction(x), Fraction(y), Fraction(z)
        exact = {"mul": fx * fy, "div": fx / fy, "fma": fx * fy + fz, "sub": fx - fy}[op]
        zero_sign = {"mul": x * y, "div": x / y}.get(op, 0.0 if exact == 0 else float(exact))
        value = _flushed_exactly(exact, zero_sign, before_rounding)
        flushed_count += value == 0 and exact != 0
        expected.append(value)
    expected = torch.tensor(expected, dtype=torch.float32)
    assert raw(out).equal(raw(expected)), f"{int((raw(out) != raw(expected)).sum())} bytes differ"
    assert 0 < flushed_count < a.numel(), "the operands straddle the underflow"


def test_the_two_rules_differ_where_a_result_rounds_up_to_the_smallest_normal() -> None:
    # (1 - 2^-23) * 2^-126 (1 + 2^-23) = 2^-126 (1 - 2^-46): just below 2^-126, rounding up to it.
    a = torch.tensor([1 - 2.0**-23])
    b = torch.tensor([2.0**-126 * (1 + 2.0**-23)])
    exact = Fraction(a.item()) * Fraction(b.item())
    assert exact < SMALLEST_NORMAL and _rounded(exact) == SMALLEST_NORMAL
    results = []
    for before in (False, True):
        out = torch.empty(1)
        launch.for_device(_one_op, a.device)[(1,)](a, b, a, out, 1, OP=0, BEFORE_ROUNDING=before, BLOCK=16)
        results.append(out.item())
    assert results == [2.0**-126, 0.0]
