"""The adam_step op: every ISA bitwise equal to scalar, scalar within a derived
bound of a float64 Adam, bf16 rounding equal to torch's, and its errors."""

from __future__ import annotations

import itertools
import random
import re
import threading
import time
import warnings

import pytest
import torch
from conftest import DTYPES, FP32_UNIT_ROUNDOFF, LAYOUTS, assert_same_bits, flushed, raw, vector_isas

from cpu_adam import CPUAdam, _compiled_step, _threads, ops, quant8
from cpu_adam.reference import adam_reference

# Around every vector width (8, 16) and tail, the 4096-element thread block, and
# one size that spans both threads (the kernel splits from 32K elements up).
SIZES = [0, 1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 1000, 4097, 100003]
HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}


def make_tuple(n: int, layout: tuple[str, str, str], seed: int) -> list[torch.Tensor]:
    """param, grad, exp_avg, exp_avg_sq with magnitudes over many binades."""
    g = torch.Generator().manual_seed(seed)
    p_dtype, g_dtype, s_dtype = (DTYPES[k] for k in layout)
    scale = torch.exp2(torch.randint(-20, 4, (n,), generator=g).float())
    param = torch.randn(n, generator=g).to(p_dtype)
    grad = (torch.randn(n, generator=g) * scale).to(g_dtype)
    exp_avg = (torch.randn(n, generator=g) * scale * 0.1).to(s_dtype)
    exp_avg_sq = (torch.randn(n, generator=g) * scale).square().to(s_dtype)
    return [param, grad, exp_avg, exp_avg_sq]


def run_step(isa: str, tensors: list[torch.Tensor], with_out: bool, **kwargs) -> list[torch.Tensor]:
    param, grad, exp_avg, exp_avg_sq = (t.clone() for t in tensors)
    out = [torch.full_like(param, float("nan"), dtype=torch.bfloat16)] if with_out else None
    with ops.force_isa(isa):
        ops.adam_step([param], [grad], [exp_avg], [exp_avg_sq], bf16_outs=out, **kwargs)
    return [param, exp_avg, exp_avg_sq] + (out or [])


@pytest.mark.parametrize("layout", LAYOUTS, ids="-".join)
@pytest.mark.parametrize("vector_isa", vector_isas())
def test_every_isa_matches_scalar_bitwise(vector_isa: str, layout: tuple[str, str, str]) -> None:
    variants = [
        {"step": 1, "weight_decay": 0.0, "adamw_mode": True, "with_out": False},
        {"step": 3, "weight_decay": 0.1, "adamw_mode": True, "with_out": True, "grad_scale": 0.37},
        {"step": 7, "weight_decay": 0.1, "adamw_mode": False, "with_out": True, "bias_correction": False},
        {"step": 2, "weight_decay": 0.0, "adamw_mode": True, "with_out": True, "stochastic_rounding": True, "seed": 9},
    ]
    for n in SIZES:
        tensors = make_tuple(n, layout, seed=n)
        for v in variants:
            kwargs = {**HYPER, **v}
            with_out = kwargs.pop("with_out")
            expected = run_step("scalar", tensors, with_out, **kwargs)
            actual = run_step(vector_isa, tensors, with_out, **kwargs)
            for name, a, e in zip(("param", "exp_avg", "exp_avg_sq", "out"), actual, expected):
                assert_same_bits(a, e, f"{vector_isa} n={n} {v} {name}")


def bound_fp32_step(p, g, m, v, *, lr, beta1, beta2, eps, step):
    """Per-element bound on |float32 kernel - float64 Adam| for one AdamW step.

    Every float32 operation, and every rounding of a constant to float32, adds at
    most one unit roundoff u relative to its result; summing them along the
    chain (magnitudes taken from the float64 run) gives the bound.
    """
    u = FP32_UNIT_ROUNDOFF
    p64, m64, v64 = adam_reference(p, g, m, v, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps)
    g, m = g.double(), m.double()
    err_m = 4 * u * (m.abs() + g.abs())  # g - m, * (1 - beta1) and its constant, + m
    rel_v = 5 * u  # beta2, (1 - beta2), three products and a sum, all of one sign
    denom = v64.sqrt() / (1 - beta2**step) ** 0.5 + eps
    rel_denom = rel_v / 2 + 4 * u  # sqrt, the 1/sqrt(bc2) constant and product, + eps
    step_size = lr / (1 - beta1**step)
    update = step_size * m64 / denom
    err_update = update.abs() * (rel_denom + 3 * u) + step_size * err_m / denom
    err_p = p.double().abs() * 2 * u + p64.abs() * u + err_update
    return (p64, m64, v64), (err_p, err_m + m64.abs() * u, v64 * (rel_v + u))


@pytest.mark.parametrize("step", [1, 10, 1000])
def test_scalar_within_derived_bound_of_float64(step: int) -> None:
    n = 100003
    tensors = make_tuple(n, ("f32", "f32", "f32"), seed=step)
    hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8}
    actual = run_step("scalar", tensors, False, step=step, **hyper)
    expected, bounds = bound_fp32_step(*tensors, step=step, **hyper)
    for name, a, e, b in zip(("param", "exp_avg", "exp_avg_sq"), actual, expected, bounds):
        err = (a.double() - e).abs()
        assert (err <= b).all(), f"{name}: worst excess {(err - b).max().item():.3g}"
        # The bound is not vacuous: float32 rounding error is visible against it.
        assert err.max() > 0


@pytest.mark.parametrize("adamw_mode", [True, False])
@pytest.mark.parametrize("bias_correction", [True, False])
def test_modes_follow_reference(adamw_mode: bool, bias_correction: bool) -> None:
    tensors = make_tuple(4097, ("f32", "f32", "f32"), seed=1)
    hyper = {"lr": 1e-2, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.5, "step": 4}
    flags = {"adamw_mode": adamw_mode, "bias_correction": bias_correction}
    actual = run_step("scalar", tensors, False, **hyper, **flags)
    expected = adam_reference(*tensors, **hyper, **flags)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a.double(), e, rtol=1e-5, atol=1e-7)
    # The modes are really different: the other mode misses by far more.
    other = adam_reference(*tensors, **hyper, adamw_mode=not adamw_mode, bias_correction=bias_correction)
    assert (other[0] - actual[0].double()).abs().max() > 1e-5


@pytest.mark.parametrize("grad_dtype", ["f32", "bf16"])
@pytest.mark.parametrize("decay", [{}, {"weight_decay": 0.1, "adamw_mode": False}], ids=["no decay", "L2 decay"])
def test_grad_scale_equals_prescaled_grads(isa: str, grad_dtype: str, decay: dict) -> None:
    # The scale multiplies the grad alone: L2 mode adds weight_decay * p to the scaled grad.
    param, grad, exp_avg, exp_avg_sq = make_tuple(1000, ("f32", grad_dtype, "f32"), seed=3)
    scale = 0.123
    kwargs = {**HYPER, "step": 2, **decay}
    folded = run_step(isa, [param, grad, exp_avg, exp_avg_sq], False, grad_scale=scale, **kwargs)
    prescaled = run_step(isa, [param, grad.float() * scale, exp_avg, exp_avg_sq], False, **kwargs)
    for a, e in zip(folded, prescaled):
        assert_same_bits(a, e, "grad_scale")


def special_float32_values() -> torch.Tensor:
    """Random bit patterns over the whole range, plus denormals, ties, infinities, NaNs."""
    g = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (50000,), generator=g, dtype=torch.int64)
    upper = torch.randint(0, 2**16, (4000,), generator=g, dtype=torch.int64) << 16
    ties = upper | 0x8000  # exactly halfway: even and odd bf16 neighbours
    near_ties = torch.cat([upper | 0x7FFF, upper | 0x8001])
    denormals = torch.randint(1, 2**23, (4000,), generator=g, dtype=torch.int64)
    edges = torch.tensor([0, 2**31, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 1])
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0xFFC00001, 0x7FFFFFFF])
    all_bits = torch.cat([random_bits, ties, near_ties, denormals, denormals | 2**31, edges, nans])
    all_bits = torch.where(all_bits >= 2**31, all_bits - 2**32, all_bits)
    return all_bits.to(torch.int32).view(torch.float32)


def test_bf16_output_rounds_like_torch(isa: str) -> None:
    values = special_float32_values()
    param = values.clone()
    zeros = torch.zeros_like(param)
    out = torch.empty_like(param, dtype=torch.bfloat16)
    # lr = 0 and zero moments leave the param as it is: the output is its rounding.
    ops.adam_step(
        [param],
        [zeros],
        [zeros.clone()],
        [zeros.clone()],
        bf16_outs=[out],
        step=1,
        lr=0.0,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
    )
    # Denormals are flushed to zero by the kernel's first multiply; all else stays.
    assert_same_bits(param, flushed(values), "param unchanged")
    assert_same_bits(out, flushed(values).to(torch.bfloat16), f"{isa} bf16 rounding")
    assert out[values.isnan()].isnan().all()


def test_bf16_state_stores_round_like_torch(isa: str) -> None:
    values = special_float32_values()
    values = values[values.isfinite()]
    exp_avg = torch.zeros_like(values, dtype=torch.bfloat16)
    exp_avg_sq = torch.zeros_like(exp_avg)
    # With beta1 = 0 the new exp_avg is 0 + (grad - 0) * 1: the grad (denormals flushed,
    # -0 turned +0 by the sum), rounded once to bf16.
    ops.adam_step(
        [torch.zeros_like(values)], [values], [exp_avg], [exp_avg_sq], step=1, lr=0.0, beta1=0.0, beta2=0.999, eps=1e-8
    )
    assert_same_bits(exp_avg, (flushed(values) + 0.0).to(torch.bfloat16), f"{isa} bf16 moment rounding")


def test_denormal_results_are_flushed_and_the_caller_mode_restored(isa: str) -> None:
    grad = torch.full((1000,), 3e-19)
    # Without flushing, (1 - beta2) * g * g (about 9e-41, in the kernel's order) is denormal, not 0.
    unflushed = (1 - HYPER["beta2"]) * grad * grad
    assert ((unflushed > 0) & (unflushed < torch.finfo(torch.float32).tiny)).all()
    param, exp_avg, exp_avg_sq = torch.ones(1000), torch.zeros(1000), torch.zeros(1000)
    ops.adam_step([param], [grad], [exp_avg], [exp_avg_sq], step=1, **HYPER)
    # The kernel flushes it to zero; the first moment, far from underflow, stays.
    assert (exp_avg_sq == 0).all() and (exp_avg > 0).all()
    # The caller's own float math still keeps denormals.
    assert (torch.full((4,), 1e-30) * 1e-10 > 0).all()


def test_output_may_alias_bf16_grad(isa: str) -> None:
    param, grad, exp_avg, exp_avg_sq = make_tuple(4097, ("f32", "bf16", "f32"), seed=5)
    separate_out = run_step(isa, [param, grad, exp_avg, exp_avg_sq], True, step=1, **HYPER)
    p, m, v, buffer = (t.clone() for t in (param, exp_avg, exp_avg_sq, grad))
    ops.adam_step([p], [buffer], [m], [v], bf16_outs=[buffer], step=1, **HYPER)
    for a, e in zip((p, m, v, buffer), separate_out):
        assert_same_bits(a, e, "aliased output")


def test_list_of_tensors_equals_one_call_each(isa: str) -> None:
    sizes = [0, 5, 4096, 4097, 70000, 33]
    layouts = [("f32", "f32", "f32"), ("bf16", "bf16", "bf16"), ("f32", "bf16", "bf16")]
    tuples = [make_tuple(n, layouts[i % 3], seed=i) for i, n in enumerate(sizes)]
    one_by_one = [run_step(isa, t, True, step=5, **HYPER) for t in tuples]
    batched = [[t.clone() for t in tu] for tu in tuples]
    outs = [torch.empty_like(tu[0], dtype=torch.bfloat16) for tu in batched]
    ops.adam_step(*(list(x) for x in zip(*batched)), bf16_outs=outs, step=5, **HYPER)
    for (p, _, m, v), out, expected in zip(batched, outs, one_by_one):
        for a, e in zip((p, m, v, out), expected):
            assert_same_bits(a, e, "batched")


@pytest.mark.parametrize("layout", [("f32", "f32", "f32"), ("bf16", "bf16", "bf16")], ids="-".join)
def test_thread_count_does_not_change_bits(layout: tuple[str, str, str]) -> None:
    tensors = make_tuple(3 * 32768 + 5, layout, seed=11)
    kwargs = {**HYPER, "step": 3, "stochastic_rounding": True, "seed": 4}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run_step(ops.active_isa(), tensors, True, **kwargs)
    finally:
        torch.set_num_threads(threads)
    multi = run_step(ops.active_isa(), tensors, True, **kwargs)
    for a, e in zip(multi, single):
        assert_same_bits(a, e, "threads")


@pytest.mark.parametrize(("cores", "local_ranks", "warns"), [(8, "1", True), (8, "4", True), (8, "8", False)])
def test_single_thread_warns_once_with_the_fix(
    monkeypatch: pytest.MonkeyPatch, cores: int, local_ranks: str, warns: bool
) -> None:
    monkeypatch.setattr(_threads, "_warned", False)
    monkeypatch.setattr(_threads, "_judged", False)
    monkeypatch.setattr(_threads, "usable_cores", lambda: cores)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_ranks)
    threads = torch.get_num_threads()
    tensors = [[small()] for _ in range(4)]
    try:
        torch.set_num_threads(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ops.adam_step(*tensors, step=1, **HYPER)
            ops.adam_step(*tensors, step=1, **HYPER)
    finally:
        torch.set_num_threads(threads)
    messages = [str(w.message) for w in caught if "1 thread" in str(w.message)]
    if warns:
        assert len(messages) == 1 and f"set_num_threads({cores // int(local_ranks)})" in messages[0]
    else:
        assert messages == []


def test_threads_are_judged_on_the_first_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # The judgement reads the CPU affinity (a system call): not on every step.
    judged = []
    monkeypatch.setattr(_threads, "_judged", False)
    monkeypatch.setattr(_threads, "usable_cores", lambda: judged.append(True) or 1)
    tensors = [[small()] for _ in range(4)]
    for _ in range(3):
        ops.adam_step(*tensors, step=1, **HYPER)
    assert judged == [True]


def test_steps_run_on_every_thread() -> None:
    # Without OpenMP in the build, at::parallel_for silently runs on one thread.
    threads = torch.get_num_threads()
    assert ops.threads_for(1 << 24) == threads
    assert ops.threads_for(1000) == 1  # below the grain, one thread is faster


def test_non_contiguous_tensors_are_updated_in_place(isa: str) -> None:
    base = make_tuple(64 * 50, ("f32", "f32", "f32"), seed=2)
    expected = run_step(isa, [t.view(64, 50).t().contiguous() for t in base], True, step=2, **HYPER)
    views = [t.clone().view(64, 50).t() for t in base]  # transposed: not contiguous
    out = torch.empty(64, 50, dtype=torch.bfloat16).t()
    ops.adam_step([views[0]], [views[1]], [views[2]], [views[3]], bf16_outs=[out], step=2, **HYPER)
    assert not views[0].is_contiguous()
    for a, e in zip((views[0], views[2], views[3], out), expected):
        assert_same_bits(a.contiguous(), e, "non-contiguous")


def test_gil_is_released_while_the_kernel_runs() -> None:
    # Steps are to run on a worker thread while the main thread runs autograd. Equal inputs take
    # every element down the same path, about lr a step, and the kernel writes each thread's
    # elements in order: so a first element below the last one, read after it, means this thread
    # ran Python in the middle of a step, which a step holding the GIL never lets it do.
    n = 1 << 25
    param, grad, exp_avg, exp_avg_sq = torch.zeros(n), torch.ones(n), torch.zeros(n), torch.zeros(n)
    ops.adam_step(*([torch.zeros(1)] for _ in range(4)), step=1, **HYPER)  # load first: compiling holds the GIL
    stop = threading.Event()

    def step_until_stopped() -> None:
        for step in itertools.count(1):
            if stop.is_set():
                return
            ops.adam_step([param], [grad], [exp_avg], [exp_avg_sq], step=step, **HYPER)

    worker = threading.Thread(target=step_until_stopped)
    worker.start()
    deadline = time.monotonic() + 3.0  # a busy machine may keep this thread off the CPU for many steps
    seen_mid_step = False
    try:
        while not seen_mid_step and time.monotonic() < deadline:
            first = param[0].item()
            seen_mid_step = first < param[-1].item()
    finally:
        stop.set()
        worker.join()
    assert seen_mid_step, "the main thread never ran while a step was under way: the op holds the GIL"


# ---- errors: each names the problem and the fix ----


def small(dtype=torch.float32, n=8):
    return torch.zeros(n, dtype=dtype)


@pytest.mark.parametrize(
    ("tensors", "match"),
    [
        (lambda: [small(), small(torch.float16), small(), small()], "float32 and bfloat16"),
        (lambda: [small(torch.float64), small(), small(), small()], "float32 and bfloat16"),
        (lambda: [small(torch.complex64), small(), small(), small()], "complex tensors .* torch.optim.AdamW"),
        (lambda: [small(), small(n=9), small(), small()], "elements"),
        (lambda: [small(), small(), small(), small(torch.bfloat16)], "one dtype"),
        (lambda: [torch.zeros(8, device="meta"), small(), small(), small()], "CPU"),
        (lambda: [small(), small().to_sparse(), small(), small()], "dense"),
    ],
)
def test_bad_tensors_raise_clear_errors(tensors, match: str) -> None:
    p, g, m, v = tensors()
    with pytest.raises((RuntimeError, ValueError), match=match):
        ops.adam_step([p], [g], [m], [v], step=1, **HYPER)


def test_aliased_tensors_are_rejected() -> None:
    p, g, m = small(), small(), small()
    with pytest.raises(RuntimeError, match="share memory"):
        ops.adam_step([p], [g], [m], [m], step=1, **HYPER)
    with pytest.raises(RuntimeError, match="share memory"):
        ops.adam_step([p, p], [g, g], [small(), small()], [small(), small()], step=1, **HYPER)
    bf16_grad = small(torch.bfloat16, 16)
    with pytest.raises(RuntimeError, match="share memory"):  # output overlapping half of its grad
        ops.adam_step([small(n=8)], [bf16_grad[:8]], [small()], [small()], bf16_outs=[bf16_grad[4:12]], step=1, **HYPER)


def test_bad_arguments_raise_clear_errors() -> None:
    with pytest.raises(RuntimeError, match="same length"):
        ops.adam_step([small()], [], [small()], [small()], step=1, **HYPER)
    with pytest.raises(RuntimeError, match="bfloat16"):
        ops.adam_step([small()], [small()], [small()], [small()], bf16_outs=[small()], step=1, **HYPER)
    with pytest.raises(ValueError, match="step counts from 1"):
        ops.adam_step([small()], [small()], [small()], [small()], step=0, **HYPER)
    with pytest.raises(RuntimeError, match="unknown ISA"), ops.force_isa("sse9"):
        pass


# ---- the op is the boundary: all or nothing, version counters, valid edge cases ----


def test_backward_after_step_fails_as_with_torch_adamw() -> None:
    def saved_graph(optimizer_cls) -> None:
        w = torch.nn.Parameter(torch.randn(8))
        optimizer = optimizer_cls([w], lr=0.1)
        loss = (w * w).sum()  # saves w for its backward
        w.grad = torch.ones(8)
        optimizer.step()
        loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation") as torch_error:
        saved_graph(torch.optim.AdamW)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as our_error:
        saved_graph(CPUAdam)
    assert type(our_error.value) is type(torch_error.value)


def test_empty_lists_are_a_no_op_and_generators_are_read_once() -> None:
    ops.adam_step([], [], [], [], step=1, **HYPER)
    p, g, m, v = small(), small() + 1, small(), small()
    ops.adam_step((t for t in [p]), (t for t in [g]), (t for t in [m]), (t for t in [v]), step=1, **HYPER)
    assert (p != 0).all()


@pytest.mark.parametrize(
    "bad",
    [lambda: small(n=1).expand(8), lambda: torch.zeros(10).as_strided((8,), (1,)).as_strided((3, 3), (1, 1))],
    ids=["expanded", "overlapping"],
)
def test_a_tensor_overlapping_itself_is_refused_and_nothing_is_written(bad) -> None:
    good = [small(), small() + 1, small(), small()]
    before = [t.clone() for t in good]
    p = bad()
    tensors = [torch.zeros(p.numel()) for _ in range(3)]
    with pytest.raises(RuntimeError, match="overlaps itself"):
        ops.adam_step(
            [good[0], p], [good[1], tensors[0]], [good[2], tensors[1]], [good[3], tensors[2]], step=1, **HYPER
        )
    assert all(torch.equal(a, b) for a, b in zip(good, before)), "a refused step wrote the first tuple"


def test_a_tiny_eps_keeps_a_zero_grad_step_at_zero() -> None:
    # eps below 2^-126 would be flushed to 0 with the denormals: 0/0 where torch leaves the param alone.
    p = torch.ones(64)
    ops.adam_step(
        [p], [torch.zeros(64)], [torch.zeros(64)], [torch.zeros(64)], step=1, lr=0.1, beta1=0.9, beta2=0.999, eps=1e-40
    )
    w = torch.nn.Parameter(torch.ones(64))
    w.grad = torch.zeros(64)
    torch.optim.Adam([w], lr=0.1, eps=1e-40).step()
    assert torch.equal(p, w.detach())


@pytest.mark.parametrize("state", ["f32", "bf16"])
def test_the_l2_term_is_rounded_once_as_torchs(isa: str, state: str) -> None:
    # g = -fl(p * wd): rounding the product first cancels g to 0, which torch's one rounding does not.
    p = torch.randn(4099, generator=torch.Generator().manual_seed(3))
    wd = 0.1
    g = -(p * wd)
    expected = g.add(p, alpha=wd)  # what torch.optim.Adam adds to the grad
    assert bool((expected != 0).all())
    m, v = torch.zeros(p.numel(), dtype=DTYPES[state]), torch.zeros(p.numel(), dtype=DTYPES[state])
    # beta1 = 0: the first moment becomes the grad the step used, exactly (rounded to the state's dtype).
    ops.adam_step(
        [p.clone()], [g], [m], [v], step=1, lr=1e-3, beta1=0.0, beta2=0.999, eps=0.0, weight_decay=wd, adamw_mode=False
    )
    assert_same_bits(m, expected.to(m.dtype), f"{isa}: the first moment")


def test_adam_with_l2_and_eps_0_steps_as_torch_where_the_grad_cancels_the_decay() -> None:
    p = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    wd, lr = 0.1, 1e-3
    ours, theirs = p.clone().requires_grad_(), p.clone().requires_grad_()
    grad = -(p * wd)
    optimizers = [
        CPUAdam([ours], lr=lr, eps=0.0, weight_decay=wd, adamw_mode=False),
        torch.optim.Adam([theirs], lr=lr, eps=0.0, weight_decay=wd, foreach=False),
    ]
    for t, optimizer in zip((ours, theirs), optimizers):
        t.grad = grad.clone()
        optimizer.step()
    assert bool(ours.isfinite().all()), "0 / 0 where torch's grad is not 0"
    torch.testing.assert_close(ours, theirs, rtol=2**-22, atol=0)


def test_a_failed_cpuadam_step_changes_no_count(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.nn.Parameter(torch.randn(8))
    optimizer = CPUAdam([w], lr=0.1)
    w.grad = torch.ones(8)
    optimizer.step()

    def failing(*args, **kwargs) -> None:
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(_compiled_step, "adam_step", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        optimizer.step()
    assert float(optimizer.state[w]["step"]) == 1


# ---- the raw op is the boundary too: scalars, devices, memory ----

OP_SCALARS = {
    "lr": 1e-2,
    "beta1": 0.9,
    "beta2": 0.999,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "adamw_mode": True,
    "bias_correction1": 0.5,
    "bias_correction2": 0.25,
    "grad_scale": 1.0,
    "stochastic_rounding": False,
    "seed": 0,
    "step": 1,
    "counter_offsets": [],
    "state_scales": [],
}


def raw_step(tensors: list[list[torch.Tensor]], outs: list[torch.Tensor] | None = None, **scalars) -> None:
    """torch.ops.cpu_adam.adam_step_ as other code calls it, past the Python wrapper's checks."""
    ops._ops()  # loaded and the fakes registered, as any caller of the package has them
    torch.ops.cpu_adam.adam_step_(*tensors, outs or [], **{**OP_SCALARS, **scalars})


def two_tuples() -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [[torch.randn(n, generator=g) for n in (8, 5)] for _ in range(4)]


def snapshot(tensors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [t.clone() for ts in tensors for t in ts]


def assert_unchanged(tensors: list[list[torch.Tensor]], before: list[torch.Tensor]) -> None:
    for t, b in zip((t for ts in tensors for t in ts), before):
        assert_same_bits(t, b, "a refused step wrote")


@pytest.mark.parametrize(
    ("scalars", "message"),
    [
        ({"lr": float("nan")}, "lr must be finite and >= 0, got nan"),
        ({"lr": -1e-3}, "lr must be finite and >= 0, got -0.001"),
        ({"lr": float("inf")}, "lr must be finite and >= 0, got inf"),
        ({"lr": 1e39}, "lr / bias_correction1 is 2e+39, beyond float32's range"),
        ({"beta1": 1.0}, "beta1 must be in [0, 1), got 1"),
        ({"beta1": -0.5}, "beta1 must be in [0, 1), got -0.5"),
        ({"beta2": float("nan")}, "beta2 must be in [0, 1), got nan"),
        ({"eps": -1e-8}, "eps must be finite and >= 0, got -1e-08"),
        ({"eps": float("inf")}, "eps must be finite and >= 0, got inf"),
        ({"eps": 1e300}, "eps is 1e+300, beyond float32's range"),
        ({"weight_decay": -0.01}, "weight_decay must be finite and >= 0, got -0.01"),
        ({"weight_decay": float("nan")}, "weight_decay must be finite and >= 0, got nan"),
        ({"weight_decay": 4e40}, "1 - lr * weight_decay is -4e+38, beyond float32's range"),
        ({"weight_decay": 1e39, "adamw_mode": False}, "weight_decay is 1e+39, beyond float32's range"),
        ({"grad_scale": float("-inf")}, "grad_scale must be finite, got -inf"),
        ({"grad_scale": 1e39}, "grad_scale is 1e+39, beyond float32's range"),
        ({"bias_correction1": 0.0}, "bias_correction1 must be finite and > 0, got 0"),
        ({"bias_correction1": float("nan")}, "bias_correction1 must be finite and > 0, got nan"),
        ({"bias_correction2": -0.5}, "bias_correction2 must be finite and > 0, got -0.5"),
        ({"bias_correction2": 1e-300}, "1 / sqrt(bias_correction2) is 1e+150, beyond float32's range"),
        ({"step": 0}, "step counts from 1 (the step being taken), got 0"),
    ],
)
def test_bad_scalars_are_refused_by_name_before_anything_is_written(scalars: dict, message: str) -> None:
    tensors = two_tuples()
    before = snapshot(tensors)
    with pytest.raises(ValueError, match=re.escape(f"cpu_adam: {message}")):
        raw_step(tensors, **scalars)
    assert_unchanged(tensors, before)


def test_scalars_at_the_ends_of_their_ranges_are_accepted() -> None:
    edges = {"lr": 0.0, "beta1": 0.0, "beta2": 0.0, "eps": 0.0, "weight_decay": 0.0, "bias_correction1": 1.0}
    params, grads, _, _ = two_tuples()
    moments = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    before = [p.clone() for p in params]
    raw_step([params, grads, *moments], **edges, grad_scale=-2.0)
    # lr = 0 leaves the params; with beta1 = beta2 = 0 the moments become the scaled grad and its square.
    for p, g, m, v, b in zip(params, grads, *moments, before):
        assert torch.equal(p, b)
        assert torch.equal(m, g * -2.0) and torch.equal(v, (g * -2.0) * (g * -2.0))


@pytest.mark.parametrize("role", range(4))
def test_a_meta_tensor_among_cpu_tensors_is_refused(role: int) -> None:
    tensors = two_tuples()
    before = snapshot(tensors)
    cpu_tensor, tensors[role][1] = tensors[role][1], torch.empty(5, device="meta")
    names = ("params", "grads", "exp_avgs", "exp_avg_sqs")
    with pytest.raises(RuntimeError, match=rf"on cpu but {names[role]}\[1\] is on meta; every tensor of a step"):
        raw_step(tensors)
    tensors[role][1] = cpu_tensor
    assert_unchanged(tensors, before)


def test_meta_and_fake_tensors_trace_without_effect() -> None:
    meta = [[torch.empty(8, device="meta")] for _ in range(4)]
    raw_step(meta)  # model init on the meta device, torch.compile's tracing: no-ops

    @torch.compile(backend="eager", fullgraph=True)
    def compiled_step(p, g, m, v):
        ops.adam_step([p], [g], [m], [v], step=1, **HYPER)

    p, g, m, v = (torch.ones(8) for _ in range(4))
    compiled_step(p, g, m, v)
    assert (p < 1).all() and (m > 0).all()


def test_sparse_tensors_reaching_the_op_are_refused_by_name() -> None:
    tensors = two_tuples()
    before = snapshot(tensors)
    dense, tensors[1][0] = tensors[1][0], tensors[1][0].to_sparse()
    with pytest.raises(RuntimeError, match=r"cpu_adam: grads\[0\] is a Sparse tensor on cpu; the kernel updates dense"):
        raw_step(tensors)
    tensors[1][0] = dense
    assert_unchanged(tensors, before)


def test_empty_lists_reaching_the_op_are_a_no_op_with_checked_scalars() -> None:
    raw_step([[], [], [], []])
    with pytest.raises(ValueError, match="lr must be finite"):
        raw_step([[], [], [], []], lr=float("nan"))


ROLES = ("param", "grad", "exp_avg", "exp_avg_sq", "out")


def fresh_tuples(shapes: list[tuple[int, ...]]) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        [torch.randn(s, generator=g) for s in shapes],
        [torch.randn(s, generator=g) for s in shapes],
        [torch.randn(s, generator=g) * 0.1 for s in shapes],
        [torch.randn(s, generator=g).square() for s in shapes],
        [torch.zeros(s, dtype=torch.bfloat16) for s in shapes],
    ]


def with_views(views: tuple[torch.Tensor, ...], places: tuple[tuple[str, int], ...]) -> list[list[torch.Tensor]]:
    """Two tuples of fresh tensors, with each view in its (role, tuple) place holding that place's values."""
    shapes = [(3,), (3,)]
    for view, (_, i) in zip(views, places):
        shapes[i] = view.shape
    tensors = fresh_tuples(shapes)
    for view, (role, i) in zip(views, places):
        view.copy_(tensors[ROLES.index(role)][i])
        tensors[ROLES.index(role)][i] = view
    return tensors


# (name, views of one float32 buffer of 256 elements, the (role, tuple) place of each)
DISJOINT_VIEWS = [
    ("interleaved params", lambda b: (b[0::2], b[1::2]), (("param", 0), ("param", 1))),
    ("a param interleaved with its exp_avg", lambda b: (b[0::2], b[1::2]), (("param", 0), ("exp_avg", 0))),
    ("a grad interleaved with its param", lambda b: (b[1::2], b[0::2]), (("grad", 0), ("param", 0))),
    (
        "interleaved columns",
        lambda b: (b.view(8, 32)[:, 0::2], b.view(8, 32)[:, 1::2]),
        (("exp_avg", 0), ("exp_avg_sq", 1)),
    ),
    ("column blocks", lambda b: (b.view(16, 16)[:, :5], b.view(16, 16)[:, 5:]), (("param", 0), ("param", 1))),
    ("strides 3 and 5", lambda b: (b[0:10:3], b[2:13:5]), (("param", 0), ("exp_avg", 1))),
    (
        "bf16 outputs between float32 params",
        lambda b: (b[0::2], b.view(torch.bfloat16)[2::4]),
        (("param", 0), ("out", 0)),
    ),
]

OVERLAPPING_VIEWS = [
    ("shifted by one stride", lambda b: (b[0:16:2], b[2:18:2]), (("param", 0), ("param", 1))),
    ("strides 2 and 3 from one start", lambda b: (b[0::2], b[0::3]), (("param", 0), ("exp_avg_sq", 1))),
    (
        "column blocks sharing a column",
        lambda b: (b.view(16, 16)[:, :6], b.view(16, 16)[:, 5:]),
        (("param", 0), ("param", 1)),
    ),
    (
        "a bf16 output over 2 bytes of a param",
        lambda b: (b[0:8], b.view(torch.bfloat16)[15:23]),
        (("param", 0), ("out", 0)),
    ),
    ("one view as a param and its exp_avg", lambda b: (b[0::2], b[0::2]), (("param", 0), ("exp_avg", 0))),
    ("a grad under another tuple's param", lambda b: (b[0:8], b[4:12]), (("grad", 0), ("param", 1))),
]


def step_two_tuples(tensors: list[list[torch.Tensor]]) -> None:
    raw_step(tensors[:4], tensors[4], stochastic_rounding=True, counter_offsets=[0, 1 << 20])


@pytest.mark.parametrize(("make_views", "places"), [c[1:] for c in DISJOINT_VIEWS], ids=[c[0] for c in DISJOINT_VIEWS])
def test_disjoint_views_of_one_buffer_step_as_separate_tensors(make_views, places) -> None:
    buffer = torch.randn(256, generator=torch.Generator().manual_seed(0))
    tensors = with_views(make_views(buffer), places)
    separate = [[t.clone(memory_format=torch.contiguous_format) for t in ts] for ts in tensors]
    expected_buffer = buffer.clone()
    step_two_tuples(separate)
    for view, (role, i) in zip(make_views(expected_buffer), places):
        if role != "grad":
            view.copy_(separate[ROLES.index(role)][i])

    step_two_tuples(tensors)
    for role, ts, expected in zip(ROLES, tensors, separate):
        for i, (t, e) in enumerate(zip(ts, expected)):
            assert_same_bits(t.contiguous(), e, f"{role}[{i}]")
    assert_same_bits(buffer, expected_buffer, "the buffer, gaps between the views included")


@pytest.mark.parametrize(
    ("make_views", "places"), [c[1:] for c in OVERLAPPING_VIEWS], ids=[c[0] for c in OVERLAPPING_VIEWS]
)
def test_overlapping_views_are_refused_and_nothing_is_written(make_views, places) -> None:
    buffer = torch.randn(256, generator=torch.Generator().manual_seed(0))
    tensors = with_views(make_views(buffer), places)
    before = [[t.clone() for t in ts] for ts in tensors]
    buffer_before = buffer.clone()
    with pytest.raises(RuntimeError, match="share memory"):
        step_two_tuples(tensors)
    for ts, bs in zip(tensors, before):
        for t, b in zip(ts, bs):
            assert_same_bits(t, b, "a refused step wrote")
    assert_same_bits(buffer, buffer_before, "a refused step wrote into the buffer")


def random_view(buffer: torch.Tensor, rng: random.Random) -> torch.Tensor | None:
    """A float32 or bfloat16 as_strided view of the byte buffer whose elements each have their own memory."""
    items = buffer.view(rng.choice([torch.float32, torch.bfloat16]))
    shape = [rng.randint(1, 7) for _ in range(rng.randint(0, 3))]
    strides = [rng.choice([1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 40]) for _ in shape]
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    dims = sorted((s, n) for s, n in zip(strides, shape) if n > 1)
    below = 0  # what the smaller dims span
    for s, n in dims:
        if s <= below or span > items.numel():
            return None
        below += (n - 1) * s
    return items.as_strided(shape, strides, rng.randint(0, items.numel() - span))


def byte_addresses(t: torch.Tensor) -> set[int]:
    offsets = torch.zeros((), dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n) * s
    starts = t.data_ptr() + offsets.flatten() * t.element_size()
    return {int(a) + k for a in starts for k in range(t.element_size())}


def test_the_overlap_check_agrees_with_the_address_sets() -> None:
    # Random strided views, the second often with the first's strides: refused exactly when they share a byte.
    rng = random.Random(0)
    outcomes = {"share bytes": 0, "interleave": 0, "apart": 0}
    while min(outcomes.values()) < 200:
        buffer = torch.zeros(256, dtype=torch.uint8)
        a, b = random_view(buffer, rng), random_view(buffer, rng)
        if a is None or b is None:
            continue
        if rng.random() < 0.5 and a.dim() > 0:  # the first's layout elsewhere in the buffer
            items = buffer.view(a.dtype)
            span = 1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride()))
            b = items.as_strided(a.shape, a.stride(), rng.randint(0, items.numel() - span))
        addresses = byte_addresses(a), byte_addresses(b)
        shares = bool(addresses[0] & addresses[1])
        moments = [[torch.zeros(a.shape), torch.zeros(b.shape)] for _ in range(3)]
        try:
            torch.ops.cpu_adam.check_adam_step([a, b], *moments, [], **OP_SCALARS)
            refused = False
        except RuntimeError as error:
            assert "share memory" in str(error)
            refused = True
        layouts = (
            f"{tuple(a.shape)}, {a.stride()} at {a.data_ptr()} and {tuple(b.shape)}, {b.stride()} at {b.data_ptr()}"
        )
        assert refused == shares, f"{layouts}: {'refused' if refused else 'accepted'}"
        spans_meet = max(map(min, addresses)) <= min(map(max, addresses))
        outcomes["share bytes" if shares else "interleave" if spans_meet else "apart"] += 1


@pytest.mark.parametrize("rows", [1024, 16384])
def test_views_with_unrelated_strides_are_told_apart_or_refused_as_too_intricate(rows: int) -> None:
    # Rows of 4 from a (rows, 8) view and rows of 4 from a (rows / 2, 16) view of one buffer never
    # meet, but only row by row can tell: past a fixed amount of that work the step is refused.
    buffer = torch.randn(rows * 8, generator=torch.Generator().manual_seed(0))
    views = buffer.view(rows, 8)[:, :4], buffer.view(rows // 2, 16)[:, 4:8]
    tensors = with_views(views, (("param", 0), ("param", 1)))
    before = buffer.clone()
    if rows == 1024:
        step_two_tuples(tensors)
        assert not torch.equal(buffer, before)
        return
    with pytest.raises(RuntimeError, match="too intricate to prove they share no memory"):
        step_two_tuples(tensors)
    assert_same_bits(buffer, before, "a refused step wrote into the buffer")


@pytest.mark.parametrize("variant", ops.PROBE_VARIANTS)
@pytest.mark.parametrize(
    ("param", "grad", "state"),
    [(torch.float32, torch.bfloat16, torch.uint8), (torch.bfloat16, torch.float32, torch.float32)],
)
def test_bandwidth_probe_moves_every_byte(isa: str, variant: str, param, grad, state) -> None:
    """Every byte of params, moments and scales read and written back plus one, the output filled,
    the grads only read: in every variant and ISA, at sizes around vector widths and blocks, on
    aligned tensors (streaming stores) and offset views (plain stores instead)."""
    for n, offset in [(0, 0), (1, 0), (63, 1), (64, 0), (257, 3), (4097, 0), (4097, 1)]:
        g = torch.Generator().manual_seed(n)
        tensors = [torch.randn(n + offset, generator=g).to(d)[offset:] for d in (param, grad)]
        tensors += [
            torch.randint(0, 256, (n + offset,), generator=g, dtype=torch.uint8).view(-1)[offset:].to(state)
            if state == torch.uint8
            else torch.randn(n + offset, generator=g)[offset:]
            for _ in range(2)
        ]
        scales = [torch.randn(2, -(-n // 256), generator=g)] if state == torch.uint8 else None
        out = torch.zeros(n, dtype=torch.bfloat16)
        before = [t.clone() for t in tensors] + ([scales[0].clone()] if scales else [])
        with ops.force_isa(isa):
            ops.bandwidth_probe(*([t] for t in tensors), bf16_outs=[out], state_scales=scales, variant=variant)
        written = [tensors[0], tensors[2], tensors[3], *(scales or [])]
        for new, old in zip(written, [before[0], before[2], before[3], *before[4:]]):
            expected = (old.contiguous().view(torch.uint8).int() + 1).remainder(256).to(torch.uint8)
            assert torch.equal(new.contiguous().view(torch.uint8), expected), f"n={n}, offset={offset}"
        assert torch.equal(tensors[1], before[1])
        assert (out.view(torch.uint8) == 0x3F).all()


def test_bandwidth_probe_refuses_unknown_variant() -> None:
    t = torch.zeros(4)
    with pytest.raises(ValueError, match="plain, prefetched"):
        ops.bandwidth_probe([t], [t.clone()], [t.clone()], [t.clone()], variant="fast")


PREVIEW_LAYOUTS = [*LAYOUTS, ("f32", "bf16", "q8"), ("bf16", "bf16", "q8")]


def _preview_case(n: int, layout: tuple[str, str, str], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(param, grad, exp_avg, exp_avg_sq) and the 8-bit block scales (none for float states)."""
    if layout[2] != "q8":
        return make_tuple(n, layout, seed), []
    param, grad, exp_avg, exp_avg_sq = make_tuple(n, (*layout[:2], "f32"), seed)
    codes_m, codes_v, scales = quant8.quantize_moments(exp_avg, exp_avg_sq.abs())
    return [param, grad, codes_m, codes_v], [scales]


@pytest.mark.parametrize("layout", PREVIEW_LAYOUTS, ids="-".join)
def test_a_preview_writes_the_steps_bf16_weights_and_nothing_else(isa: str, layout: tuple[str, str, str]) -> None:
    variants = [
        {"step": 3, "weight_decay": 0.1, "grad_scale": 0.37},
        {"step": 7, "weight_decay": 0.1, "adamw_mode": False},
        {"step": 2, "stochastic_rounding": True, "seed": 9},
    ]
    for n in (1, 17, 129, 4097, 70001):
        tensors, scales = _preview_case(n, layout, seed=n)
        for v in variants:
            kwargs = {**HYPER, **v, "state_scales": [s.clone() for s in scales] or None}
            stepped = [t.clone() for t in tensors]
            out = torch.full_like(tensors[0], float("nan"), dtype=torch.bfloat16)
            ops.adam_step(*([t] for t in stepped), bf16_outs=[out], **kwargs)
            previewed = [t.clone() for t in tensors]
            preview_out = torch.full_like(out, float("nan"))
            versions = [t._version for t in previewed]
            kwargs["state_scales"] = [s.clone() for s in scales] or None
            ops.adam_step(*([t] for t in previewed), bf16_outs=[preview_out], preview=True, **kwargs)
            assert_same_bits(preview_out, out, f"{isa} n={n} {v}")
            for name, before, after in zip(("param", "grad", "exp_avg", "exp_avg_sq"), tensors, previewed):
                assert torch.equal(raw(before), raw(after)), f"a preview wrote {name}"
            assert [t._version for t in previewed] == versions, "a preview bumps only the outputs' versions"
            assert all(torch.equal(a, b) for a, b in zip(kwargs["state_scales"] or [], scales))
            if n == 70001:
                assert not torch.equal(raw(stepped[2]), raw(tensors[2])), "the step itself moves the moments"


def test_a_preview_needs_an_output_for_each_param() -> None:
    p, g, m, v = make_tuple(8, ("f32", "f32", "f32"), 0)
    with pytest.raises(ValueError, match="one per param"):
        ops.adam_step([p], [g], [m], [v], step=1, preview=True, **HYPER)


@pytest.mark.parametrize("layout", PREVIEW_LAYOUTS, ids="-".join)
def test_a_step_then_the_next_ones_preview_equals_the_two_calls(isa: str, layout: tuple[str, str, str]) -> None:
    # One pass over the state for both: the step's state, and the next step's bf16 weights written
    # over the step's own grads, bitwise as a step followed by a preview.
    variants = [
        ({"step": 3, "weight_decay": 0.1, "grad_scale": 0.37}, {"lr": 2e-2, "grad_scale": 1.0}),
        ({"step": 7, "weight_decay": 0.1, "adamw_mode": False}, {"lr": 1e-2, "weight_decay": 0.1, "adamw_mode": False}),
        ({"step": 2, "stochastic_rounding": True, "seed": 9}, {"lr": 1e-2}),
    ]
    for n in (1, 17, 129, 4097, 70001):
        tensors, scales = _preview_case(n, layout, seed=n)
        next_grad = (tensors[1].float() * -0.5 + 1e-3).to(tensors[1].dtype)
        for v, nxt in variants:
            kwargs = {**HYPER, **v}
            bf16_grads = tensors[1].dtype == torch.bfloat16
            expected = [t.clone() for t in tensors]
            expected_scales = [s.clone() for s in scales] or None
            ops.adam_step(*([t] for t in expected), state_scales=expected_scales, **kwargs)
            expected_out = torch.full_like(tensors[0], float("nan"), dtype=torch.bfloat16)
            then_kwargs = {**kwargs, **nxt, "step": kwargs["step"] + 1}
            ops.adam_step(
                *([t] for t in expected[:1]),
                [next_grad],
                *([t] for t in expected[2:]),
                bf16_outs=[expected_out],
                state_scales=[s.clone() for s in expected_scales] if expected_scales else None,
                preview=True,
                **then_kwargs,
            )
            fused = [t.clone() for t in tensors]
            fused_scales = [s.clone() for s in scales] or None
            out = fused[1] if bf16_grads else torch.full_like(expected_out, float("nan"))  # over its own grads
            then = ops.NextStep([next_grad], **{k: then_kwargs[k] for k in ops.NextStep._fields if k in then_kwargs})
            ops.adam_step(*([t] for t in fused), bf16_outs=[out], state_scales=fused_scales, then=then, **kwargs)
            assert_same_bits(out, expected_out, f"{isa} n={n} {v} next weights")
            for name, a, e in zip(
                ("param", "exp_avg", "exp_avg_sq"), (fused[0], *fused[2:]), (expected[0], *expected[2:])
            ):
                assert torch.equal(raw(a), raw(e)), f"{isa} n={n} {v}: {name}"
            assert all(torch.equal(a, b) for a, b in zip(fused_scales or [], expected_scales or []))


def test_the_next_steps_grads_may_not_be_an_output() -> None:
    p, g, m, v = make_tuple(8, ("f32", "bf16", "f32"), 0)
    out = torch.zeros(8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="share memory"):
        ops.adam_step([p], [g], [m], [v], bf16_outs=[out], step=1, then=ops.NextStep([out], step=2, **HYPER), **HYPER)


@pytest.mark.parametrize("layout", PREVIEW_LAYOUTS, ids="-".join)
def test_a_step_bumps_the_version_of_every_tensor_it_writes_and_no_grad(layout: tuple[str, str, str]) -> None:
    tensors, scales = _preview_case(64, layout, seed=1)
    out = torch.zeros(64, dtype=torch.bfloat16)
    before = [t._version for t in (*tensors, out, *scales)]
    ops.adam_step(*([t] for t in tensors), bf16_outs=[out], state_scales=scales or None, step=1, **HYPER)
    after = [t._version for t in (*tensors, out, *scales)]
    bumped = [a > b for a, b in zip(after, before)]
    assert bumped == [True, False, True, True, True] + [True] * len(scales), "param, grad, moments, output, scales"


@pytest.mark.parametrize("beta1", [0.0, 0.3, 0.5, 0.51, 0.9])
def test_the_first_moment_follows_torchs_two_sided_lerp(isa: str, beta1: float) -> None:
    # torch computes grad - (grad - m) * (1 - weight) from a weight of 0.5 up: beta1 = 0 gives the grad,
    # and beta1 = 0 with torch.optim.AdamW gives it too.
    g = torch.Generator().manual_seed(3)
    for n in (1, 17, 4097):
        param, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
        exp_avg, exp_avg_sq = torch.randn(n, generator=g), torch.rand(n, generator=g)
        # torch's lerp rule, one rounding per operation (its own kernel may fuse a multiply-add)
        weight = torch.tensor(1 - beta1, dtype=torch.float32)
        from_grad = weight >= 0.5
        expected = grad - (grad - exp_avg) * (1 - weight) if from_grad else exp_avg + (grad - exp_avg) * weight
        ops.adam_step([param], [grad], [exp_avg], [exp_avg_sq], step=2, lr=1e-3, beta1=beta1, beta2=0.99, eps=1e-8)
        assert_same_bits(exp_avg, expected, f"{isa} beta1={beta1} n={n}")
        if beta1 == 0.0:
            assert torch.equal(exp_avg, grad)
