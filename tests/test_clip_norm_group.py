"""Clipping inside the step over plain tensors (``CPUAdam(max_grad_norm=..., norm_group=...)``): on several ranks
CPUAdam cannot tell replicas from parts, so it asks; norm_group=None clips by each rank's own norm (DDP's replicas),
a process group by the norm of every rank's part together. Under DeepSpeed, which hands CPUAdam parts and clips
itself, max_grad_norm is refused however DeepSpeed reaches CPUAdam's step (a subclass's, a wrapping optimizer's).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from conftest import assert_same_bits
from rank_spawn import run_ranks
from torch import nn

from cpu_adam import CPUAdam
from cpu_adam.clipping import clip_factor

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
MAX_GRAD_NORM = 0.05  # below every norm here: each case clips


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 5))


def grads_on(module: nn.Module, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)
    nn.functional.mse_loss(module(x), y).backward()
    return [p.grad.detach().clone() for p in module.parameters()]


def exact_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all grads in float64, rounded once to float32: what the norm inside the step must be."""
    return torch.linalg.vector_norm(torch.cat([g.double().reshape(-1) for g in grads])).float()


def copies(params: list[torch.Tensor], grads: list[torch.Tensor], factor: float = 1.0) -> list[nn.Parameter]:
    copied = [nn.Parameter(p.detach().clone()) for p in params]
    for p, g in zip(copied, grads):
        p.grad = g * factor
    return copied


def assert_clips_by(norm: torch.Tensor, params: list[torch.Tensor], grads: list[torch.Tensor], what: str, **kw) -> None:
    """CPUAdam(max_grad_norm, **kw) over copies of ``params`` with ``grads`` reads ``norm`` and steps as CPUAdam does
    on the grads multiplied by clip_grad_norm_'s factor for it."""
    ours, reference = copies(params, grads), copies(params, grads, clip_factor(norm, MAX_GRAD_NORM))
    optimizer = CPUAdam(ours, **HYPER, max_grad_norm=MAX_GRAD_NORM, **kw)
    optimizer.step()
    CPUAdam(reference, **HYPER).step()
    assert norm > MAX_GRAD_NORM, "the test means to clip"
    assert_same_bits(optimizer.grad_norm, norm, f"{what}: the norm")
    for p, q in zip(ours, reference):
        assert_same_bits(p.detach(), q.detach(), f"{what}: the weights")


def _norm_groups(rank: int, world_size: int) -> None:
    params = list(model().parameters())
    own_grads = grads_on(model(), seed=rank)  # each rank its own batch

    unsaid = copies(params, own_grads)
    with pytest.raises(ValueError, match="norm_group"):
        CPUAdam(unsaid, **HYPER, max_grad_norm=MAX_GRAD_NORM).step()
    assert all(torch.equal(p, q) for p, q in zip(unsaid, params)), "the refused step moved the weights"

    own_norm = exact_norm(own_grads)
    assert_clips_by(own_norm, params, own_grads, f"rank {rank}, norm_group=None", norm_group=None)
    norms = [torch.empty_like(own_norm) for _ in range(world_size)]
    dist.all_gather(norms, own_norm)
    assert len(set(map(float, norms))) == world_size, "the ranks' own norms must differ for the test to tell"

    # Every rank computes the whole model's grads on one batch and holds a part of them: its params of every
    # world_size-th place, as a partitioned optimizer would.
    whole_grads = grads_on(model(), seed=100)
    part = slice(rank, None, world_size)
    what = f"rank {rank}, its part over norm_group=WORLD"
    assert_clips_by(exact_norm(whole_grads), params[part], whole_grads[part], what, norm_group=dist.group.WORLD)


@pytest.mark.dist
def test_plain_tensors_on_ranks_clip_by_the_norm_group_said() -> None:
    run_ranks(_norm_groups, world_size=2, timeout_s=90.0)


def called_from_deepspeed(step: Callable[[], object]) -> None:
    """Calls ``step`` from a function of a module named as DeepSpeed's ZeRO-3 module is."""
    namespace = {"__name__": "deepspeed.runtime.zero.stage3"}
    exec("def _optimizer_step(step):\n    step()\n", namespace)
    namespace["_optimizer_step"](step)


class LoggingCPUAdam(CPUAdam):
    """A subclass's step() in between, as users write them (to log, to count)."""

    def step(self, closure=None):
        return super().step(closure)


class Wrapping(torch.optim.Optimizer):
    """An optimizer handed to DeepSpeed that steps CPUAdam inside its own step()."""

    def __init__(self, inner: CPUAdam) -> None:
        self.inner = inner
        super().__init__(inner.param_groups, {})

    def step(self, closure=None):
        return self.inner.step(closure)


def one_param() -> nn.Parameter:
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    return p


@pytest.mark.parametrize("how", ["plain", "subclass", "wrapped"])
def test_max_grad_norm_is_refused_under_deepspeed(how: str) -> None:
    p = one_param()
    make = LoggingCPUAdam if how == "subclass" else CPUAdam
    optimizer = make([p], max_grad_norm=1.0)
    stepped = Wrapping(optimizer) if how == "wrapped" else optimizer
    with pytest.raises(ValueError, match='"gradient_clipping"'):
        called_from_deepspeed(stepped.step)
    assert not optimizer.state and torch.equal(p, torch.ones(3)), "the refused step changed something"


def test_a_subclass_outside_deepspeed_clips() -> None:
    optimizer = LoggingCPUAdam([one_param()], max_grad_norm=1.0)
    optimizer.step()
    assert_same_bits(optimizer.grad_norm, torch.tensor(3.0).sqrt(), "the norm")
