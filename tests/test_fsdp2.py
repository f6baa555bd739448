"""CPUAdam as the optimizer of an FSDP2 model whose sharded params and grads live on the CPU.

Two ranks on gloo. fully_shard(..., offload_policy=CPUOffloadPolicy(pin_memory=False)) gives
DTensor params and grads whose local shards CPUAdam steps; torch.optim.AdamW(foreach=False)
on the same setup is the reference.
"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from conftest import ulp_distance
from rank_spawn import run_ranks
from torch import nn

from cpu_adam import CPUAdam

pytestmark = [pytest.mark.dist, pytest.mark.slow]

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_available():
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
FP32_UNIT_ROUNDOFF = 2.0**-24


def build_model() -> nn.Module:
    """The same initial weights on every rank (fully_shard keeps each rank's slice of them).
    33 rows do not split evenly over 2 ranks, so the padded last shard is exercised too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 9))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 9, generator=g)


def forward_backward(model: nn.Module, rank: int, step: int) -> float:
    x, y = batch(rank, step)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.item()


def train(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, steps: Iterable[int]) -> list[float]:
    losses = []
    for step in steps:
        losses.append(forward_backward(model, rank, step))
        optimizer.step()
        optimizer.zero_grad()
    return losses


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    assert isinstance(t, DTensor), f"expected an FSDP2 DTensor, got {type(t).__name__}"
    return t.to_local()


def assert_within(actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str) -> None:
    """8 float32 ulps of |expected| + scale, where scale bounds the terms that cancel."""
    bound = 8 * FP32_UNIT_ROUNDOFF * (expected.double().abs() + scale)
    excess = (actual.double() - expected.double()).abs() - bound
    assert excess.max() <= 0, f"{what}: off by {excess.max().item():.3g} beyond 8 ulps"


def _matches_adamw(rank: int, world_size: int) -> None:
    ours_model, torch_model = build_model(), build_model()
    ours = CPUAdam(ours_model.parameters(), **HYPER)
    reference = torch.optim.AdamW(torch_model.parameters(), **HYPER, foreach=False)
    pairs = list(zip(ours_model.parameters(), torch_model.parameters()))
    steps, largest_grad = 6, 0.0
    for step in range(steps):
        forward_backward(ours_model, rank, step)
        forward_backward(torch_model, rank, step)
        for p, q in pairs:
            if step == 0:  # identical setups: the first reduce-scattered grads are identical
                assert torch.equal(local(p.grad), local(q.grad))
            # From the second step the weights differ by ulps, and so would the grads; the
            # reference steps on our grads so that only the optimizers' arithmetic differs.
            local(q.grad).copy_(local(p.grad))
            largest_grad = max(largest_grad, local(p.grad).abs().max().item())
        ours.step()
        reference.step()
        ours.zero_grad()
        reference.zero_grad()
    # The bounds of test_optimizer.py's CPUAdam-vs-AdamW check, for the same reason: the
    # kernel multiplies by 1/sqrt(bias_correction2) where torch divides, and rounds in a
    # different order, so each step's update (|update| <= about lr) differs by a few ulps;
    # over `steps` steps weights stay within 8 ulps of |p| + steps * lr.
    for p, q in pairs:
        assert local(p).dtype == torch.float32 and local(p).device.type == "cpu"
        assert_within(local(p), local(q), steps * HYPER["lr"], f"rank {rank} param")
        mine, theirs = ours.state[p], reference.state[q]
        assert local(mine["exp_avg"]).dtype == torch.float32
        # m = m + (g - m) * (1 - beta1) cancels terms as large as the grads.
        assert_within(local(mine["exp_avg"]), local(theirs["exp_avg"]), largest_grad, f"rank {rank} exp_avg")
        # v sums non-negative terms: no cancellation, a few ulps of v itself.
        worst = ulp_distance(local(mine["exp_avg_sq"]), local(theirs["exp_avg_sq"])).max().item()
        assert worst <= 8, f"rank {rank} exp_avg_sq: {worst} ulps apart"
        assert mine["step"].item() == theirs["step"].item() == steps


def test_fsdp2_cpu_offload_matches_torch_adamw() -> None:
    run_ranks(_matches_adamw)


def _bf16_states_train(rank: int, world_size: int) -> None:
    model = build_model()
    optimizer = CPUAdam(model.parameters(), **HYPER, fp32_optimizer_states=False)
    # One fixed batch per rank: memorizing it must bring the loss down steadily.
    losses = train(model, optimizer, rank, [0] * 20)
    for p in model.parameters():
        assert local(p).dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            state = local(optimizer.state[p][key])
            assert state.dtype == torch.bfloat16, f"{key} is {state.dtype}"
            assert state.shape == local(p).shape
    assert losses[-1] < 0.6 * losses[0], f"rank {rank}: loss went {losses[0]:.4f} -> {losses[-1]:.4f}"


def test_fsdp2_bf16_states_train() -> None:
    run_ranks(_bf16_states_train)
