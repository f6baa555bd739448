"""Clipping inside the step (``CPUAdam(max_grad_norm=...)``) against the float64 norm of the grads and a
step on grads multiplied by clip_grad_norm_'s factor, in one process and on FSDP2 shards (HSDP too); the
norm against torch's ``clip_grad_norm_`` on CPU DTensors; gradient accumulation with and without
``set_requires_gradient_sync(False)``."""

from __future__ import annotations

import pytest
import torch
from rank_spawn import run_ranks
from test_fsdp2_shards import HYPER, assert_bitwise, plain_model, sharded_model
from torch import nn

from cpu_adam import CPUAdam
from cpu_adam.clipping import clip_factor
from cpu_adam.fsdp2.norm import total_norm

fsdp = pytest.importorskip("torch.distributed.fsdp")


def batch(step: int, rank: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g, dtype=dtype), torch.randn(8, 5, generator=g, dtype=dtype)


def grads_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def exact_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all grads in float64, rounded once to float32: what the norm inside the step must be."""
    return torch.linalg.vector_norm(torch.cat([g.detach().double().reshape(-1) for g in grads])).float()


def clipped_by(factor: float, grads: list[torch.Tensor]) -> None:
    for g in grads:
        g.mul_(factor)


@pytest.mark.parametrize("max_grad_norm", [0.05, 1e3], ids=["clips", "does-not-clip"])
def test_max_grad_norm_clips_by_the_exact_norm_then_steps(max_grad_norm: float) -> None:
    ours_model, reference_model = plain_model(torch.float32), plain_model(torch.float32)
    ours = CPUAdam(ours_model.parameters(), **HYPER, max_grad_norm=max_grad_norm)
    reference = CPUAdam(reference_model.parameters(), **HYPER)
    for step in range(3):
        x, y = batch(step)
        for model in (ours_model, reference_model):
            nn.functional.mse_loss(model(x), y).backward()
        grads = grads_of(ours_model)
        norm = exact_norm(grads)
        torch_norm = torch.nn.utils.get_total_norm(grads)  # clip_grad_norm_'s
        clipped_by(clip_factor(norm, max_grad_norm), [p.grad for p in reference_model.parameters()])
        ours.step()
        reference.step()
        assert_bitwise(ours.grad_norm, norm, "the norm")
        assert abs(float(ours.grad_norm) / float(torch_norm) - 1) < 2.0**-20, "torch's float32 norm, to its rounding"
        assert all(torch.equal(p.grad, g) for p, g in zip(ours_model.parameters(), grads)), "the grads were rewritten"
        for p, q in zip(ours_model.parameters(), reference_model.parameters()):
            assert_bitwise(p.detach(), q.detach(), f"step {step} weights")
        ours.zero_grad()
        reference.zero_grad()
    assert (norm > max_grad_norm) == (max_grad_norm == 0.05)  # the case is the one named


def test_the_norm_covers_every_param_group() -> None:
    """Decay and no-decay groups, as GPT recipes make them: the norm is over both."""
    model = plain_model(torch.float32)
    matrices = [p for p in model.parameters() if p.dim() == 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = CPUAdam([{"params": matrices}, {"params": vectors, "weight_decay": 0.0}], **HYPER, max_grad_norm=1.0)
    nn.functional.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
    optimizer.step()
    assert_bitwise(optimizer.grad_norm, exact_norm([p.grad for p in model.parameters()]), "the norm of both groups")


def test_the_norm_of_bf16_grads_is_the_exact_norm() -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n).bfloat16()) for n in (300_001, 4097, 7)]
    for p, scale in zip(params, (1e-3, 10.0, 1e4)):  # tensors whose norms differ by orders of magnitude
        p.grad = (torch.randn(p.shape) * scale).bfloat16()
    optimizer = CPUAdam(params, **HYPER, state_precision="bf16", max_grad_norm=1.0)
    optimizer.step()
    copies = [nn.Parameter(p.detach().clone()) for p in params]
    for copy, p in zip(copies, params):
        copy.grad = p.grad.clone()
    theirs = torch.nn.utils.clip_grad_norm_(copies, 1.0)  # each bf16 grad's norm rounded to bf16
    assert optimizer.grad_norm.dtype == torch.float32
    assert_bitwise(optimizer.grad_norm, exact_norm([p.grad for p in params]), "the norm of bf16 grads")
    assert abs(float(optimizer.grad_norm) / float(theirs) - 1) < 2.0**-7


def test_the_norm_does_not_depend_on_the_thread_count() -> None:
    grads = [torch.randn(n) for n in (1 << 20, 3 * (1 << 16) + 5, 1)]
    threads = torch.get_num_threads()
    norms = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            norms.append(total_norm(grads))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(norm, norms[0]) for norm in norms), norms


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
    """On FSDP2 shards (and HSDP's 2 x 2 at 4 ranks): the norm is the float64 norm of the whole grads, the step that
    of grads multiplied by clip_grad_norm_'s factor; torch's clip_grad_norm_ on the same DTensors agrees to float32."""
    max_grad_norm = 0.05
    for replicas in (1, 2) if world_size == 4 else (1,):
        ours_model, reference_model = sharded_model(torch.float32, replicas), sharded_model(torch.float32, replicas)
        ours = CPUAdam(ours_model.parameters(), **HYPER, max_grad_norm=max_grad_norm)
        reference = CPUAdam(reference_model.parameters(), **HYPER)
        pairs = list(zip(ours_model.parameters(), reference_model.parameters()))
        for step in range(3):
            nn.functional.mse_loss(ours_model(batch(step, rank)[0]), batch(step, rank)[1]).backward()
            for p, q in pairs:  # the same grads for both: only the clipping differs
                q.grad = p.grad.detach().clone()
            grads = grads_of(ours_model)
            norm = exact_norm([g.full_tensor() for g in grads])
            # torch's own norm on CPU DTensors: its all-reduce runs on the mesh's (gloo) group.
            torch_norm = torch.nn.utils.get_total_norm(grads)  # clip_grad_norm_'s
            clipped_by(clip_factor(norm, max_grad_norm), [q.grad for _, q in pairs])
            ours.step()
            reference.step()
            what = f"rank {rank} step {step}, {replicas} replicas"
            assert norm > max_grad_norm, "the test means to clip"
            assert_bitwise(ours.grad_norm, norm, f"{what}: the norm")
            assert abs(float(ours.grad_norm) / float(torch_norm.full_tensor()) - 1) < 2.0**-20, what
            for (p, q), g in zip(pairs, grads):
                assert torch.equal(p.grad.to_local(), g.to_local()), "the grads were rewritten"
                assert_bitwise(p.to_local(), q.to_local(), f"{what}: weights")
            ours.zero_grad()
            reference.zero_grad()


def _accumulates(rank: int, world_size: int) -> None:
    """Four micro-batches a step, reduce-scattered each time or only on the last: the grads are one
    process's over all ranks' micro-batches (up to the order of the sums), and the step is bitwise
    CPUAdam's on the whole tensors with those grads."""
    micro = 4
    whole = plain_model(torch.float32)
    for every_micro_batch in (True, False):
        sharded = sharded_model(torch.float32)
        ours = CPUAdam(sharded.parameters(), **HYPER, max_grad_norm=1.0)
        # the whole grads on every rank: replicas, as DDP keeps them
        reference = CPUAdam(plain_model(torch.float32).parameters(), **HYPER, max_grad_norm=1.0, norm_group=None)
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


@pytest.mark.dist
@pytest.mark.slow
def test_fsdp2_clipping_over_hsdp() -> None:
    if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_available():
        pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)")
    run_ranks(_clips_on_shards, world_size=4, timeout_s=180.0)
