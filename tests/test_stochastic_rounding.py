"""Stochastic rounding of bf16 weight stores: unbiased, reproducible, and safe at the edges."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import assert_same_bits

from cpu_adam import CPUAdam, ops

N = 1 << 16
STEPS = 40
LR = 1e-4  # far below half a bf16 ulp of the weights (2**-9 just below 1.0)


def train(dtype: torch.dtype, stochastic_rounding: bool) -> torch.Tensor:
    weights = torch.nn.Parameter(torch.full((N,), 0.75, dtype=dtype))
    optimizer = CPUAdam([weights], lr=LR, stochastic_rounding=stochastic_rounding, seed=1234)
    g = torch.Generator().manual_seed(0)
    for _ in range(STEPS):
        # Grads of one sign with a spread of sizes: Adam's update then varies per element.
        weights.grad = (torch.rand(N, generator=g) + 0.5).to(dtype)
        optimizer.step()
    return weights.detach()


def test_stochastic_rounding_follows_the_fp32_trajectory_on_average() -> None:
    reference = train(torch.float32, stochastic_rounding=False).double()
    nearest = train(torch.bfloat16, stochastic_rounding=False)
    stochastic = train(torch.bfloat16, stochastic_rounding=True).double()

    assert (nearest == 0.75).all(), "updates below half an ulp must be lost by round-to-nearest"
    drift = 0.75 - reference.mean().item()
    assert drift > 0.5 * STEPS * LR
    # Each store adds an independent zero-mean error of at most one ulp (2**-8 here,
    # variance <= ulp**2 / 4); STEPS of them per element, averaged over N elements.
    ulp = 2.0**-8
    sigma = math.sqrt(STEPS * ulp**2 / 4 / N)
    error = abs(stochastic.mean().item() - reference.mean().item())
    assert error < 6 * sigma, f"mean off by {error:.3g}, 6 sigma = {6 * sigma:.3g}, drift {drift:.3g}"
    # And per element, the weights spread over the neighbouring bf16 values.
    assert stochastic.unique().numel() > 1


def test_stochastic_rounding_is_reproducible_and_seeded(isa: str) -> None:
    def run(seed: int, step: int) -> torch.Tensor:
        param = torch.linspace(-3, 3, 10007).to(torch.bfloat16)
        grad = torch.linspace(1, -1, 10007).to(torch.bfloat16)
        state = [torch.zeros(10007), torch.zeros(10007)]
        ops.adam_step(
            [param],
            [grad],
            *([s] for s in state),
            step=step,
            lr=1e-3,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            stochastic_rounding=True,
            seed=seed,
        )
        return param

    first = run(seed=5, step=1)
    assert_same_bits(run(seed=5, step=1), first, "same seed and step")
    assert not torch.equal(run(seed=6, step=1), first)


def decay_only_sr_step(param: torch.Tensor, lr: float, weight_decay: float, seed: int) -> None:
    """One stochastically rounded step with zero grads and moments: only p * (1 - lr * wd) acts."""
    zeros = [torch.zeros_like(param) for _ in range(3)]
    ops.adam_step(
        [param],
        [zeros[0]],
        [zeros[1]],
        [zeros[2]],
        step=1,
        lr=lr,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=weight_decay,
        stochastic_rounding=True,
        seed=seed,
    )


def test_stochastic_rounding_picks_one_of_the_two_neighbours() -> None:
    start = torch.linspace(1, 2, 4099).to(torch.bfloat16)
    param = start.clone()
    # Decoupled weight decay alone: p * (1 - 0.3 * 0.01), which falls between bf16 values.
    decay_only_sr_step(param, lr=0.3, weight_decay=0.01, seed=3)
    exact = start.float() * (1 - 0.3 * 0.01)
    # Positive floats: dropping the low 16 bits gives the bf16 value below, +1 the one above.
    below_bits = exact.view(torch.int32) >> 16
    below = below_bits.to(torch.int16).view(torch.bfloat16)
    above = (below_bits + 1).to(torch.int16).view(torch.bfloat16)
    assert ((param == below) | (param == above)).all()
    assert (param == below).any() and (param == above).any()


def test_nan_inf_and_the_bf16_maximum() -> None:
    bf16_max = torch.finfo(torch.bfloat16).max
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), bf16_max, -bf16_max, 0.0, -0.0])
    param = values.to(torch.bfloat16).repeat(100)
    decay_only_sr_step(param, lr=0.0, weight_decay=0.0, seed=1)
    # Representable values store as themselves; NaN stays NaN.
    assert_same_bits(param, values.to(torch.bfloat16).repeat(100), "specials")

    # Just past the bf16 maximum (p * 1.001: a first Adam step moves a param by lr against its
    # grad): the two neighbours are the maximum and infinity, as round-to-nearest's overflow to inf.
    near_max = torch.full((1000,), bf16_max, dtype=torch.bfloat16)
    moments = [torch.zeros(1000), torch.zeros(1000)]
    ops.adam_step(
        [near_max],
        [-torch.ones(1000)],
        *([m] for m in moments),
        step=1,
        lr=bf16_max * 1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        stochastic_rounding=True,
        seed=1,
    )
    assert not near_max.isnan().any()
    assert ((near_max == bf16_max) | (near_max == float("inf"))).all()


@pytest.mark.parametrize("threads", [1, 2])
def test_same_bits_with_any_thread_count(threads: int) -> None:
    def run() -> torch.Tensor:
        param = torch.randn(200003, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        grad = torch.randn(200003, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        _sr_step([param], [grad])
        return param

    before = torch.get_num_threads()
    reference = run()
    try:
        torch.set_num_threads(threads)
        result = run()
    finally:
        torch.set_num_threads(before)
    assert_same_bits(result, reference, f"{threads} threads")


def _sr_step(params: list[torch.Tensor], grads: list[torch.Tensor], **kwargs) -> None:
    ops.adam_step(
        params,
        grads,
        [torch.zeros(p.numel()) for p in params],
        [torch.zeros(p.numel()) for p in params],
        step=1,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        stochastic_rounding=True,
        seed=7,
        **kwargs,
    )


@pytest.mark.parametrize("split", [2, 4096, 10_000])
def test_counter_offsets_make_the_bits_independent_of_how_tensors_are_split(split: int) -> None:
    g = torch.Generator().manual_seed(0)
    whole = torch.randn(20_000, generator=g).to(torch.bfloat16)
    grad = torch.randn(20_000, generator=g).to(torch.bfloat16)
    parts = [whole[:split].clone(), whole[split:].clone()]
    _sr_step(parts, [grad[:split], grad[split:]], counter_offsets=[0, split])
    _sr_step([whole], [grad])
    assert_same_bits(torch.cat(parts), whole, f"split at {split}")
    shifted = whole.clone()
    _sr_step([shifted], [grad], counter_offsets=[2])
    assert not torch.equal(shifted, whole), "another offset must give other bits"


def test_odd_counter_offsets_are_refused() -> None:
    with pytest.raises(RuntimeError, match="even"):
        _sr_step([torch.zeros(4, dtype=torch.bfloat16)], [torch.zeros(4)], counter_offsets=[1])


def test_offload_stochastic_rounding_does_not_depend_on_the_bucket_size() -> None:
    from offload_helpers import batches, lm_loss, make_model

    from cpu_adam import OffloadOptimizer

    def train(bucket_size: int) -> list[torch.Tensor]:
        model = make_model(0)
        opt = OffloadOptimizer(
            model.parameters(),
            master_weights_dtype=torch.bfloat16,
            stochastic_rounding=True,
            seed=3,
            bucket_size=bucket_size,
        )
        for tokens in batches(3):
            lm_loss(model, tokens).backward()
            opt.step()
        return [m.clone() for m in opt.master_weights()]

    for a, b in zip(train(1024), train(1 << 20)):
        assert_same_bits(a, b, "bucket sizes 1024 and 2^20")
