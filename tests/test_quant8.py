"""8-bit moments in the kernel: its codes against cpu_adam.quant8 (given the kernel's random bits)
and a float64 reference, every ISA against scalar, special values, and the op's refusals."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DTYPES, flushed, raw, vector_isas
from random_bits import code_bits
from torch import Tensor

from cpu_adam import ops, quant8
from cpu_adam.reference import adam_reference

SIZES = [0, 1, 15, 16, 17, 255, 256, 257, 511, 4095, 4096, 4097, 70001]
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
FP32_ULP = 2.0**-24


def q8_tuple(n: int, param: str, grad: str, seed: int) -> list[Tensor]:
    """param, grad, exp_avg codes, exp_avg_sq codes, scales: moments of a run in progress."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g).to(DTYPES[param])
    grad_values = torch.randn(n, generator=g) * torch.logspace(-6, 0, n if n else 1)[:n]
    exp_avg = grad_values * torch.randn(n, generator=g) * 0.3
    exp_avg_sq = grad_values**2 * torch.rand(n, generator=g)
    return [p, grad_values.to(DTYPES[grad]), *quant8.quantize_moments(exp_avg, exp_avg_sq)]


def q8_step(isa: str, tensors: list[Tensor], threads: int = 1, out: bool = False, **kwargs) -> list[Tensor]:
    """One step on copies; returns the updated copies (and the bf16 output, where asked)."""
    p, g, m, u, scales = (t.clone() for t in tensors)
    outs = [torch.empty(p.shape, dtype=torch.bfloat16)] if out else None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with ops.force_isa(isa):
            ops.adam_step([p], [g], [m], [u], state_scales=[scales], bf16_outs=outs, **{**HYPER, "step": 5, **kwargs})
    finally:
        torch.set_num_threads(previous)
    return [p, m, u, scales, *(outs or [])]


@pytest.mark.parametrize("isa", vector_isas())
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("param", "grad", "stochastic", "out"),
    [
        ("f32", "f32", False, False),
        ("f32", "bf16", False, True),
        ("bf16", "f32", True, False),
        ("bf16", "bf16", False, True),
        ("bf16", "bf16", True, True),
    ],
)
def test_every_isa_matches_scalar(isa: str, threads: int, param: str, grad: str, stochastic: bool, out: bool) -> None:
    for n in SIZES:
        tensors = q8_tuple(n, param, grad, seed=n)
        kwargs = {"stochastic_rounding": stochastic, "seed": 7, "grad_scale": 0.5, "weight_decay": 0.1}
        expected = q8_step("scalar", tensors, threads, out, **kwargs)
        actual = q8_step(isa, tensors, threads, out, **kwargs)
        for a, e in zip(actual, expected):
            assert torch.equal(raw(a), raw(e)), f"{isa}, n={n}, {threads} threads"


def test_threads_split_on_scale_blocks() -> None:
    tensors = q8_tuple(70001, "bf16", "f32", seed=3)
    assert ops.threads_for(70001) >= 1
    one, two = (q8_step("scalar", tensors, threads, stochastic_rounding=True) for threads in (1, 2))
    for a, b in zip(one, two):
        assert torch.equal(raw(a), raw(b))


def test_codes_round_trip_exactly(isa: str) -> None:
    """A step that changes no moment (g = 0, 1 - beta rounding to 1e-12) gives back its codes and
    scales bit for bit: decoding is exact and encoding a code's own value returns it."""
    g = torch.Generator().manual_seed(0)
    n = 4097
    m = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    m[m == 0x80] = 0  # -0 decodes to -0, and -0 + 0 is +0: code 0
    u = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    m[::256], u[::256] = 0x7F, 0xFF  # each block holds its largest code: its scale stays
    scales = torch.pow(2.0, torch.randint(-40, 40, (2, quant8.blocks(n)), generator=g).float())
    tensors = [torch.zeros(n), torch.zeros(n), m, u, scales]
    still = {"lr": 0.0, "beta1": 1 - 1e-12, "beta2": 1 - 1e-12, "bias_correction": False}
    _, m2, u2, scales2 = q8_step(isa, tensors, **still)
    assert torch.equal(m2, m) and torch.equal(u2, u) and torch.equal(scales2, scales)


def test_scales_below_the_smallest_decode_as_saved(isa: str) -> None:
    """Version 0.2 saved scales down to 2^-126; such blocks decode through the general path and
    are encoded again at 2^-112, as quant8 encodes the decoded values with the same random bits."""
    g = torch.Generator().manual_seed(4)
    n = 512
    m = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    m = (m & 0x80) | (m & 0x7F).clamp(min=8)  # normal codes only: the blocks a fast path would take
    u = torch.randint(1, 256, (n,), generator=g, dtype=torch.uint8)
    scales = torch.tensor([[2.0**-120, 2.0**-126], [1.0, 1.0]])
    tensors = [torch.zeros(n), torch.zeros(n), m, u, scales]
    still = {"lr": 0.0, "beta1": 1 - 1e-12, "beta2": 1 - 1e-12, "bias_correction": False, "seed": 2}
    _, m2, u2, scales2 = q8_step(isa, tensors, **still)
    saved = flushed(quant8.decode(m, scales[0], root=False).float()) + 0.0  # flushed -0 + 0 is +0
    m_random, _ = code_bits(seed=2, step=5, counters=torch.arange(n))
    expected, expected_scales = quant8.encode(saved, root=False, random16=m_random)
    assert torch.equal(m2, expected) and torch.equal(scales2[0], expected_scales)
    assert (scales2[0] == 2.0**-112).all() and torch.equal(u2, u)
    assert (m2 != 0).sum() > n // 4  # values of the 2^-120 block survive, now at the smallest scale


def test_rounding_is_unbiased_up_to_a_blocks_largest_value() -> None:
    """Averaged over steps (fresh random bits each), decoded moments equal the values they encode,
    a block's largest included: values above the largest code take the next scale instead of
    saturating (which would bias 1.96 down to 1.875). With beta1 = beta2 = 0 a step encodes g and
    |g|; a code step is at most 1/8 of the value, so one rounding's error has sd <= 1/16 of it,
    and the mean of 400 stays within 0.32% (1 sd): we allow 2% per element, 0.2% on average."""
    g = torch.Generator().manual_seed(6)
    n, steps = 512, 400
    grad = (torch.rand(n, generator=g) + 0.05) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    grad[0], grad[256] = 1.96, -1.97
    tensors = [torch.zeros(n), grad, torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
    m_sum, u_sum = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for step in range(1, steps + 1):
        hyper = {"lr": 0.0, "beta1": 0.0, "beta2": 0.0, "bias_correction": False, "step": step}
        _, m, u, scales = q8_step("scalar", [*tensors, torch.ones(2, 2)], **hyper)
        m_sum += quant8.decode(m, scales[0], root=False)
        u_sum += quant8.decode(u, scales[1], root=True)
    for mean, expected in ((m_sum / steps, grad.double()), (u_sum / steps, grad.double().abs())):
        error = (mean - expected).abs() / expected.abs()
        assert error.max() < 0.02 and error.mean() < 0.002, (error.max(), error.mean())


def test_kernel_encodes_like_quant8(isa: str) -> None:
    """From zero moments with beta1 = beta2 = 0 the new moments are g and sqrt(g * g) in float32,
    exactly: the kernel's codes and scales must be quant8's rounded with the same random bits, bit
    for bit, special values included."""
    g = torch.Generator().manual_seed(1)
    n = 256 * 40
    magnitudes = torch.pow(2.0, torch.randint(-60, 60, (n // 256, 1), generator=g).float())
    grad = (torch.randn(n // 256, 256, generator=g) * magnitudes).reshape(-1)
    codes_and_between = torch.tensor([1.0625, 1.1875, 1.9375, 1.96875, 2.0**-14 * 7.5, 2.0**-14 * 0.5, 2.0**-18])
    grad[2560:2816] = torch.rand(256, generator=g) * 1.99  # a block with scale 1
    grad[2560:2567] = codes_and_between  # the saturation edge, the evenly spaced region
    grad[256:512] = 0.0
    grad[600] = math.nan
    grad[900] = math.inf
    grad[1100] = 1e-45 * 2**20  # tiny next to its block
    grad[1400:1656] = 1e-30  # g * g underflows
    grad[1792:2048] = torch.rand(256, generator=g) * 2.0**-118  # below the smallest scale, 2^-112
    grad[1800] = 0.0
    grad[3840:4096] = 2.0**-40  # roots far below their block's largest: a positive root never rounds to 0
    grad[3840] = 1.0
    grad[4096:4608] = torch.rand(512, generator=g)
    grad[4096] = 1.99  # above both largest codes: the next scale
    grad[4352] = 1.9  # above m's largest code (1.875), below the root's (1.9375)
    # The largest scales, 2^127 and 2^126, each block with small values next to its largest.
    for block, largest in ((12, 3.0e38), (13, 1.0e38)):
        values = torch.randn(256, generator=g) * torch.pow(2.0, torch.randint(90, 126, (256,), generator=g).float())
        values[7], values[99], values[150] = largest, -0.75 * largest, 2.0**-100
        grad[256 * block : 256 * (block + 1)] = values
    zeros = torch.zeros(n, dtype=torch.uint8)
    tensors = [torch.zeros(n), grad, zeros, zeros, torch.ones(2, quant8.blocks(n))]
    _, m, u, scales = q8_step(isa, tensors, lr=0.0, beta1=0.0, beta2=0.0, bias_correction=False)
    m_random, u_random = code_bits(seed=0, step=5, counters=torch.arange(n))
    m_codes, m_scale = quant8.encode(grad, root=False, random16=m_random)
    u_codes, u_scale = quant8.encode(flushed(grad * grad).sqrt(), root=True, random16=u_random)
    assert torch.equal(m, m_codes[:n]) and torch.equal(u, u_codes[:n])
    assert torch.equal(raw(scales), raw(torch.stack([m_scale, u_scale])))
    assert scales[:, 2:4].isnan().all() and (scales[:, 1] == 1).all()  # nan, inf blocks; the zero block
    assert (u[1400:1656] == 0).all()  # underflowed: v is 0
    assert scales[0, 12] == 2.0**127 and scales[0, 13] == 2.0**126 and scales[0, 7] == 2.0**-112
    assert (u[3841:4096] == 1).all() and (scales[:, 16] == 2).all() and scales[:, 17].tolist() == [2, 1]
    assert (m[256 * 12 : 256 * 14] & 0x7F).unique().numel() > 20  # codes across the range
    nearest, _ = quant8.encode(grad, root=False)
    assert (m != nearest[:n]).float().mean() > 0.2  # stochastic: many codes are not the nearest


@pytest.mark.parametrize("step", [1, 50])
def test_scalar_follows_float64_reference(step: int) -> None:
    """Decode, Adam in float64, encode with the kernel's random bits: the kernel's float32 Adam
    differs from it by at most delta = 2^-21 (2 |m| + |g|) for m and 2^-21 u for the root (a few
    float32 roundings, each 2^-24 relative to its operands). With the same random bits, a kernel
    code may differ from the reference's only by one step, and only where the reference value lies
    within delta of the point between those two codes where that element's random bits switch from
    one to the other."""
    n = 70001
    p, grad, m_codes, u_codes, scales = q8_tuple(n, "f32", "f32", seed=step)
    p1, m1, u1, scales1 = q8_step("scalar", [p, grad, m_codes, u_codes, scales], step=step, seed=9)
    m0, v0 = quant8.dequantize_moments(m_codes, u_codes, scales)
    ref_p, ref_m, ref_v = adam_reference(p, grad, m0, v0, step=step, **HYPER)
    ref_u = ref_v.sqrt()
    m_random, u_random = code_bits(seed=9, step=step, counters=torch.arange(n))
    m_ref_codes, m_ref_scale = quant8.encode(ref_m, root=False, random16=m_random)
    u_ref_codes, u_ref_scale = quant8.encode(ref_u, root=True, random16=u_random)
    torch.testing.assert_close(p1.double(), ref_p, rtol=1e-6, atol=1e-9)
    assert torch.equal(scales1, torch.stack([m_ref_scale, u_ref_scale]))  # no block max near a power of two here

    def check(codes: Tensor, ref_codes: Tensor, scale: Tensor, ref: Tensor, random16: Tensor, delta: Tensor) -> int:
        root = ref_codes is u_ref_codes
        differ = (codes != ref_codes[:n]).nonzero().reshape(-1)
        ours, theirs = codes[differ].to(torch.int64), ref_codes[differ].to(torch.int64)
        assert ((ours - theirs).abs() == 1).all()  # neighbours, same sign
        padded = torch.zeros(quant8.blocks(n) * 256, dtype=torch.uint8)
        padded[:n] = torch.minimum(codes, ref_codes[:n])
        low = quant8.decode(padded, scale, root=root)[:n][differ]
        padded[:n] = torch.maximum(codes, ref_codes[:n])
        high = quant8.decode(padded, scale, root=root)[:n][differ]
        # The point from which these bits round up: x >= low + (1 - r / 2^16) (high - low), in
        # magnitudes (for m the sign is shared).
        switch = low.abs() + (1 - random16[differ] / 2**16) * (high.abs() - low.abs())
        assert ((ref[differ].abs() - switch).abs() <= delta[differ]).all()
        return int(differ.numel())

    m_delta = 2.0**-21 * (2 * m0.double().abs() + grad.double().abs())
    m_differ = check(m1, m_ref_codes, scales1[0], ref_m, m_random, m_delta)
    u_differ = check(u1, u_ref_codes, scales1[1], ref_u, u_random, 2.0**-21 * ref_u)
    assert m_differ + u_differ <= n // 1000  # switch points are rare: the bound is not what passes the test


def test_special_values_stay_in_their_blocks() -> None:
    n = 1024
    p, grad, m, u, scales = q8_tuple(n, "f32", "f32", seed=5)
    grad[300] = math.nan
    grad[700] = 1e18  # huge: v = 1e33 still finite
    p1, m1, u1, scales1 = q8_step("scalar", [p, grad, m, u, scales])
    assert scales1[:, 1].isnan().all() and p1[300].isnan()
    assert p1[256:512].isnan().sum() == 1  # the NaN moments show up on the next step only
    assert scales1[:, [0, 2, 3]].isfinite().all() and p1[~p1.isnan()].isfinite().all()
    _, _, _, scales2 = q8_step("scalar", [p1, torch.zeros(n), m1, u1, scales1])
    assert scales2[:, 1].isnan().all() and scales2[:, [0, 2, 3]].isfinite().all()
    zeros = [torch.zeros(n), torch.zeros(n), torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]
    pz, mz, uz, sz = q8_step("scalar", [*zeros, torch.ones(2, 4)])
    assert (pz == 0).all() and (mz == 0).all() and (uz == 0).all() and (sz == 1).all()


def test_positive_root_never_rounds_to_zero() -> None:
    u = torch.tensor([1.0] + [2.0**-30] * 255)
    codes, _ = quant8.encode(u, root=True)
    assert (codes[1:] == 1).all()


# ---- refusals ----


def refused_step(match: str, *, scales: list[Tensor] | None, moments_dtype: torch.dtype = torch.uint8) -> None:
    n = 300
    p, g = torch.zeros(n), torch.zeros(n)
    m, u = torch.zeros(n, dtype=moments_dtype), torch.zeros(n, dtype=moments_dtype)
    before = [t.clone() for t in (p, m, u, *(scales or []))]
    with pytest.raises(RuntimeError, match=match):
        ops.adam_step([p], [g], [m], [u], state_scales=scales, step=1, **HYPER)
    for a, b in zip((p, m, u, *(scales or [])), before):
        assert torch.equal(a, b)


def test_refuses_wrong_scales() -> None:
    refused_step(r"shape \[2, 1\]|\[2, 2\]", scales=[torch.ones(2, 1)])
    refused_step(r"float32 of shape", scales=[torch.ones(2, 2, dtype=torch.float64)])
    refused_step(r"float32 of shape", scales=[torch.ones(4)])
    refused_step(r"need their state_scales", scales=None)
    refused_step(r"need their state_scales", scales=[torch.ones(2, 2)], moments_dtype=torch.float32)
    refused_step(r"one tensor per param", scales=[torch.ones(2, 2), torch.ones(2, 2)])


def test_refuses_mixing_and_shared_scales() -> None:
    p, g = [torch.zeros(300), torch.zeros(300)], [torch.zeros(300), torch.zeros(300)]
    m = [torch.zeros(300, dtype=torch.uint8), torch.zeros(300)]
    u = [torch.zeros(300, dtype=torch.uint8), torch.zeros(300)]
    with pytest.raises(RuntimeError, match="cannot mix"):
        ops.adam_step(p, g, m, u, state_scales=[torch.ones(2, 2), torch.ones(2, 2)], step=1, **HYPER)
    codes = [torch.zeros(300, dtype=torch.uint8) for _ in range(4)]
    shared = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="share memory"):
        ops.adam_step(p, g, codes[:2], codes[2:], state_scales=[shared, shared], step=1, **HYPER)
    with pytest.raises(RuntimeError, match="dtype"):
        ops.adam_step(
            [torch.zeros(300, dtype=torch.uint8)], g[:1], codes[:1], codes[1:2], state_scales=[shared], step=1, **HYPER
        )


def test_bumps_scale_versions() -> None:
    p, g, m, u, scales = q8_tuple(300, "f32", "f32", seed=0)
    version = scales._version
    ops.adam_step([p], [g], [m], [u], state_scales=[scales], step=1, **HYPER)
    assert scales._version > version


@pytest.mark.parametrize("offset", [0, 2**32 - 100, 2**32 - 256 * 3 - 2])
def test_same_step_as_float_states_then_encoded(isa: str, offset: int) -> None:
    """The 8-bit step is the float32-state step on the decoded moments, followed by the encode:
    params (stochastic rounding included, with the 32-bit counter wrapping inside a block, where
    the float kernel splits its segment) bit for bit, and codes equal to quant8's of the new m and
    sqrt(v), rounded with the kernel's random bits (their key changes where the counter wraps)."""
    n = 4097
    p, grad, m_codes, u_codes, scales = q8_tuple(n, "bf16", "f32", seed=11)
    kwargs = {"stochastic_rounding": True, "seed": 3, "counter_offsets": [offset], "step": 4}
    p8, m8, u8, scales8 = q8_step(isa, [p, grad, m_codes, u_codes, scales], **kwargs)
    m, v = quant8.dequantize_moments(m_codes, u_codes, scales)
    pf = p.clone()
    with ops.force_isa(isa):
        ops.adam_step([pf], [grad], [m], [v], **{**HYPER, **kwargs})
    assert torch.equal(raw(p8), raw(pf))
    m_random, u_random = code_bits(seed=3, step=4, counters=torch.arange(n) + offset)
    m_expected, m_scale = quant8.encode(m, root=False, random16=m_random)
    u_expected, u_scale = quant8.encode(v.sqrt(), root=True, random16=u_random)
    assert torch.equal(m8, m_expected[:n]) and torch.equal(u8, u_expected[:n])
    assert torch.equal(raw(scales8), raw(torch.stack([m_scale, u_scale])))


@pytest.mark.parametrize("root", [False, True], ids=["exp_avg", "root"])
def test_stochastic_rounding_switches_exactly_at_each_elements_point(isa: str, root: bool) -> None:
    """With beta1 = beta2 = lr = 0 the new moments are g and |g| (from zero moments), encoded with
    the element's 16 random bits r: it rounds up exactly when r + the fraction of the code step below
    the value, in 2^-16 units, reaches 2^16. Values placed at that point round up; one 2^-16 step
    below, down. A threshold off by one 2^-16 step (one time in 65,536) fails here."""
    n, g = 256 * 16, torch.Generator().manual_seed(5)
    m_random, u_random = code_bits(seed=0, step=5, counters=torch.arange(n))
    random16 = (u_random if root else m_random).to(torch.float64)
    mantissa = 4 if root else 3
    table = quant8._magnitudes(mantissa)
    lo = torch.randint(16 << mantissa - 1, (16 << mantissa) - 1, (n,), generator=g)  # normal codes below the top
    step = table[lo + 1] - table[lo]
    switch = torch.where(random16 > 0, 2.0**16 - random16, 2.0**16)  # r = 0 never rounds up from below
    at = table[lo] + step * switch / 2.0**16
    below = at - step / 2.0**16
    sign = 1.0 if root else torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    for values, up in ((at, True), (below, False)):
        grad = (values * sign).to(torch.float32)
        grad[::256] = 1.5  # an exact code, each block's largest: scale 1
        assert torch.equal(grad.double(), (values * sign).where(torch.arange(n) % 256 != 0, 1.5)), "exact in float32"
        assert torch.equal(flushed(grad * grad).sqrt(), grad.abs()), "the root is |g| exactly"
        zeros = torch.zeros(n, dtype=torch.uint8)
        tensors = [torch.zeros(n), grad, zeros, zeros, torch.ones(2, quant8.blocks(n))]
        _, m, u, scales = q8_step(isa, tensors, lr=0.0, beta1=0.0, beta2=0.0, bias_correction=False)
        codes = (u if root else m & 0x7F).to(torch.int64)
        assert (scales[int(root)] == 1).all()  # the other moment's may differ
        expected = torch.where((random16 > 0) | torch.tensor(not up), lo + int(up), lo + 1)
        expected[::256] = int(torch.searchsorted(table, torch.tensor(1.5, dtype=torch.float64)))
        wrong = (codes != expected).nonzero().flatten()
        where = "at" if up else "below"
        assert wrong.numel() == 0, f"{where} the switch point: {wrong.numel()} codes wrong, e.g. {wrong[:5]}"
        if not root:
            assert torch.equal(m >= 0x80, grad < 0)


def test_a_blocks_fast_and_general_paths_give_the_same_codes_and_steps(isa: str) -> None:
    # Blocks whose codes and new values all lie in the codes' normal range decode and encode by the fast paths; the
    # same blocks with one element of another kind (an evenly spaced code, a grad of zero) by the general ones. Every
    # other element of a block must come out the same either way: params, codes, and the blocks' scales.
    n = 8 * 256
    g = torch.Generator().manual_seed(11)
    magnitudes = 1 + torch.rand(n, generator=g)  # within a factor 2 in a block: far from the evenly spaced codes
    signs = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    p, grad = torch.randn(n, generator=g), signs * magnitudes * 1e-3
    avg_codes, root_codes, scales = quant8.quantize_moments(signs * magnitudes * 1e-4, (magnitudes * 1e-3) ** 2)
    fast = [p, grad, avg_codes, root_codes, scales]
    assert bool(((avg_codes & 0x7F) >= 8).all()) and bool((root_codes >= 16).all()), "the fast paths' blocks"
    odd = list(range(3, n, 256))  # one element in every block
    general = [t.clone() for t in fast]
    general[1][odd] = 0.0  # its new moments decay toward zero: evenly spaced codes
    general[2][odd] = 2  # an evenly spaced code of exp_avg
    general[3][odd] = 5  # and of the root
    others = torch.ones(n, dtype=torch.bool)
    others[odd] = False
    for stochastic in (False, True):
        a, b = (q8_step(isa, t, stochastic_rounding=stochastic, seed=5) for t in (fast, general))
        for name, x, y in zip(("param", "exp_avg codes", "root codes"), a[:3], b[:3]):
            assert torch.equal(raw(x[others]), raw(y[others])), f"{name}: the paths disagree"
        assert torch.equal(a[3], b[3]), "block scales"
        assert bool(((b[1][odd] & 0x7F) < 8).all()), "the odd elements took the general path"
