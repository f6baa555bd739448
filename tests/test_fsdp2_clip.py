"""Clipping inside the step (``CPUAdam(max_grad_norm=...)``) against torch's ``clip_grad_norm_`` and
a step, in one process and on FSDP2 shards; torch's ``clip_grad_norm_`` on CPU DTensors; gradient
accumulation with and without ``set_requires_gradient_sync(False)``."""

from __future__ import annotations

import pytest
import torch
from rank_spawn import run_ranks
from test_fsdp2_shards import HYPER, assert_bitwise, plain_model, sharded_model
from torch import nn

from cpu_adam import CPUAdam

fsdp = pytest.importorskip("torch.distributed.fsdp")


def batch(step: int, rank: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g, dtype=dtype), torch.randn(8, 5, generator=g, dtype=dtype)


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("max_grad_norm", [0.05, 1e3], ids=["clips", "does-not-clip"])
def test_max_grad_norm_is_clip_grad_norm_then_the_step(max_grad_norm: float) -> None:
    ours_model, torch_model = plain_model(torch.float32), plain_model(torch.float32)
    ours = CPUAdam(ours_model.parameters(), **HYPER, max_grad_norm=max_grad_norm)
    theirs = CPUAdam(torch_model.parameters(), **HYPER)
    for step in range(3):
        x, y = batch(step)
        for model in (ours_model, torch_model):
            nn.functional.mse_loss(model(x), y).backward()
        grads = grads_of(ours_model)
        norm = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), max_grad_norm)
        ours.step()
        theirs.step()
        assert_bitwise(ours.grad_norm, norm, "the norm")
        assert all(torch.equal(p.grad, g) for p, g in zip(ours_model.parameters(), grads)), "the grads were rewritten"
        for p, q in zip(ours_model.parameters(), torch_model.parameters()):
            assert_bitwise(p.detach(), q.detach(), f"step {step} weights")
        ours.zero_grad()
        theirs.zero_grad()
    assert (norm > max_grad_norm) == (max_grad_norm == 0.05)  # the case is the one named


def test_the_norm_of_bf16_grads_is_torchs_to_bf16_precision() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n).bfloat16()) for n in (300_001, 4097, 7)]
    for p, scale in zip(params, (1e-3, 10.0, 1e4)):  # tensors whose norms differ by orders of magnitude
        p.grad = (torch.randn(p.shape) * scale).bfloat16()
    optimizer = CPUAdam(params, **HYPER, state_precision="bf16", max_grad_norm=1.0)
    optimizer.step()
    exact = torch.linalg.vector_norm(torch.cat([p.grad.double() for p in params]))
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for copy, p in zip(copies, params):
        copy.grad = p.grad.clone()
    theirs = torch.nn.utils.clip_grad_norm_(copies, 1.0)
    assert optimizer.grad_norm.dtype == torch.float32
    assert abs(float(optimizer.grad_norm) / float(exact) - 1) < 2.0**-8
    assert abs(float(optimizer.grad_norm) / float(theirs) - 1) < 2.0**-7


def test_max_grad_norm_is_checked() -> None:
    params = [nn.Parameter(torch.ones(3))]
    for bad, error in ((0.0, ValueError), (float("inf"), ValueError), ("1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_grad_norm must be"):
            CPUAdam(params, max_grad_norm=bad)
    optimizer = CPUAdam(params, max_grad_norm=1.0)
    optimizer.max_grad_norm = -1.0  # changed between steps: checked when used, before anything changes
    params[0].grad = torch.ones(3)
    with pytest.raises(ValueError, match="max_grad_norm must be"):
        optimizer.step()
    assert not optimizer.state and torch.equal(params[0], torch.ones(3))


def _clips_on_shards(rank: int, world_size: int) -> None:
    max_grad_norm = 0.05
    ours_model, torch_model = sharded_model(torch.float32), sharded_model(torch.float32)
    ours = CPUAdam(ours_model.parameters(), **HYPER, max_grad_norm=max_grad_norm)
    theirs = CPUAdam(torch_model.parameters(), **HYPER)
    pairs = list(zip(ours_model.parameters(), torch_model.parameters()))
    for step in range(3):
        nn.functional.mse_loss(ours_model(batch(step, rank)[0]), batch(step, rank)[1]).backward()
        for p, q in pairs:  # the same grads for both: only the clipping differs
            q.grad = p.grad.detach().clone()
        grads = grads_of(ours_model)
        # torch's own clipping on CPU DTensors: its all-reduce runs on the mesh's (gloo) group.
        norm = torch.nn.utils.clip_grad_norm_(torch_model.parameters(), max_grad_norm).full_tensor()
        ours.step()
        theirs.step()
        assert norm > max_grad_norm, "the test means to clip"
        assert_bitwise(ours.grad_norm, norm, f"rank {rank} step {step}: the norm")
        for (p, q), g in zip(pairs, grads):
            assert torch.equal(p.grad.to_local(), g.to_local()), "the grads were rewritten"
            assert_bitwise(p.to_local(), q.to_local(), f"rank {rank} step {step}: weights")
        ours.zero_grad()
        theirs.zero_grad()


def _accumulates(rank: int, world_size: int) -> None:
    """Four micro-batches a step, reduce-scattered each time or only on the last: the grads are one
    process's over all ranks' micro-batches (up to the order of the sums), and the step is bitwise
    CPUAdam's on the whole tensors with those grads."""
    micro = 4
    whole = plain_model(torch.float32)
    for every_micro_batch in (True, False):
        sharded = sharded_model(torch.float32)
        ours = CPUAdam(sharded.parameters(), **HYPER, max_grad_norm=1.0)
        reference = CPUAdam(plain_model(torch.float32).parameters(), **HYPER, max_grad_norm=1.0)
        for i in range(micro):
            sharded.set_requires_gradient_sync(every_micro_batch or i == micro - 1)
            x, y = batch(i, rank)
            (nn.functional.mse_loss(sharded(x), y) / micro).backward()
        whole.zero_grad()
        for r in range(world_size):  # every rank's micro-batches, as FSDP2 averages over the ranks
            for i in range(micro):
                x, y = batch(i, r)
                (nn.functional.mse_loss(whole(x), y) / (micro * world_size)).backward()
        for p, q in zip(sharded.parameters(), whole.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-7)
        reference_params = [p for g in reference.param_groups for p in g["params"]]
        for p, q in zip(sharded.parameters(), reference_params):
            q.grad = p.grad.full_tensor()
        ours.step()
        reference.step()
        for p, q in zip(sharded.parameters(), reference_params):
            assert_bitwise(p.full_tensor(), q.detach(), f"rank {rank}, sync every micro-batch {every_micro_batch}")


def _moves(rank: int, world_size: int) -> None:
    """What docs/cpu_adam.md says FSDP2 moves per step: the dtypes of the all-gathers (two a step) and
    of the reduce-scatter, by MixedPrecisionPolicy, and the grads' dtype on the host, which CPUAdam steps."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy

    bf16, fp32 = torch.bfloat16, torch.float32
    expected = [  # shards, policy, all-gather, reduce-scatter, host grads
        (fp32, None, fp32, fp32, fp32),
        (fp32, MixedPrecisionPolicy(param_dtype=bf16), bf16, bf16, fp32),
        (fp32, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), bf16, fp32, fp32),
        (bf16, None, bf16, bf16, bf16),
        (bf16, MixedPrecisionPolicy(reduce_dtype=fp32), bf16, fp32, bf16),
    ]
    seen: list[tuple[str, torch.dtype]] = []
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def logged_gather(output, input, *args, **kwargs):  # torch passes them by these names
        seen.append(("gather", input.dtype))
        return gather(output, input, *args, **kwargs)

    def logged_scatter(output, input, *args, **kwargs):
        seen.append(("scatter", input.dtype))
        return scatter(output, input, *args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = logged_gather, logged_scatter
    try:
        for dtype, policy, gathered, reduced, host in expected:
            model = sharded_model(dtype, mp_policy=policy)
            optimizer = CPUAdam(model.parameters(), **HYPER, stochastic_rounding=True)
            seen.clear()
            x, y = batch(0, rank, dtype)
            nn.functional.mse_loss(model(x), y).backward()
            assert sorted(set(seen)) == [("gather", gathered), ("scatter", reduced)], (dtype, policy, seen)
            assert [kind for kind, _ in seen].count("gather") == 2 * 3, "a gather per unit before forward and backward"
            assert all(p.grad.to_local().dtype == host for p in model.parameters()), (dtype, policy)
            optimizer.step()
    finally:
        dist.all_gather_single, dist.reduce_scatter_single = gather, scatter


def _clipping_and_accumulation(rank: int, world_size: int) -> None:
    _moves(rank, world_size)
    _clips_on_shards(rank, world_size)
    _accumulates(rank, world_size)


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_clipping_and_accumulation() -> None:
    if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_available():
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    run_ranks(_clipping_and_accumulation, world_size=2, timeout_s=180.0)
