"""CPUAdam as DeepSpeed's client optimizer: ZeRO-1/2 with offload_optimizer on the CPU.

Two ranks on gloo with DeepSpeed's CPU accelerator. DeepSpeed hands the client optimizer one
flat fp32 tensor per param group (this rank's partition) whose .grad it fills; the reference is
the same engine with torch.optim.AdamW(foreach=False) as the client optimizer.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import ulp_distance
from rank_spawn import run_ranks
from torch import nn

from cpu_adam import CPUAdam

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Not imported here: DeepSpeed picks its accelerator once, at import, and the ranks (which
# import this module) must pick the CPU first; see build_engine.
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install deepspeed)", allow_module_level=True)

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
FP32_UNIT_ROUNDOFF = 2.0**-24
STEPS = 5


def ds_config(stage: int, bf16: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": bf16},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": False}},
        # A client optimizer with offload: DeepSpeed would otherwise insist on its own CPU Adam.
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at init (about a minute
    on 2 cores, once per machine) that only its inference all-reduce uses; training goes
    through torch.distributed. These tests skip that build where DeepSpeed has the hook."""
    # By module path: the attribute deepspeed.comm.torch is the torch package itself.
    backend = importlib.import_module("deepspeed.comm.torch")
    if hasattr(backend, "build_shm_op"):
        backend.build_shm_op = lambda: None


def build_engine(optimizer_class: type[torch.optim.Optimizer], stage: int, bf16: bool = False, **kwargs):
    # On a GPU machine DeepSpeed would pick CUDA; these tests mean gloo and CPU tensors.
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    skip_shm_comm_build()
    torch.manual_seed(0)  # the same initial weights on every rank and in both engines
    model = nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 9))
    optimizer = optimizer_class(model.parameters(), **HYPER, **kwargs)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage, bf16))
    return engine


def client_flats(engine) -> list[torch.Tensor]:
    """The flat fp32 partitions DeepSpeed gave its client optimizer, one per param group."""
    return [p for group in engine.optimizer.optimizer.param_groups for p in group["params"]]


def batch(rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch per rank: memorizing it must bring the loss down within a few steps."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(8, 12, generator=g).to(dtype), torch.randn(8, 9, generator=g).to(dtype)


def train_step(engine, rank: int, dtype: torch.dtype = torch.float32) -> float:
    x, y = batch(rank, dtype)
    loss = nn.functional.mse_loss(engine(x).float(), y.float())
    engine.backward(loss)
    engine.step()
    return loss.item()


class TorchAdamWOnGivenGrads(torch.optim.AdamW):
    """torch's AdamW that steps on grads handed to it rather than its own.

    From the second step the two engines' weights differ by ulps, and so would their grads;
    stepping the reference on CPUAdam's grads leaves only the optimizers' arithmetic to differ.
    """

    given: list[torch.Tensor]
    own: list[torch.Tensor]

    def step(self, closure=None):
        flats = [p for group in self.param_groups for p in group["params"]]
        self.own = [p.grad.clone() for p in flats]
        for p, g in zip(flats, self.given):
            p.grad.copy_(g)
        return super().step(closure)


class CPUAdamKeepingGrads(CPUAdam):
    """CPUAdam that keeps a copy of the grads DeepSpeed hands it, for the reference to use.

    (DeepSpeed calls step() once per param group; the models here have one group.)
    """

    seen: list[torch.Tensor]

    def step(self, closure=None):
        self.seen = [p.grad.clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str) -> None:
    """8 float32 ulps of |expected| + scale, where scale bounds the terms that cancel."""
    bound = 8 * FP32_UNIT_ROUNDOFF * (expected.double().abs() + scale)
    excess = (actual.double() - expected.double()).abs() - bound
    assert excess.max() <= 0, f"{what}: off by {excess.max().item():.3g} beyond 8 ulps"


def assert_ranks_agree(engine) -> None:
    """ZeRO-1/2 keep full weights on every rank: after the all-gather they must be identical."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks hold different weights"


def _matches_adamw(rank: int, world_size: int, stage: int) -> None:
    ours_engine = build_engine(CPUAdamKeepingGrads, stage)
    torch_engine = build_engine(TorchAdamWOnGivenGrads, stage)
    ours, reference = ours_engine.optimizer.optimizer, torch_engine.optimizer.optimizer
    assert isinstance(ours, CPUAdam), f"DeepSpeed replaced the client optimizer with {type(ours).__name__}"
    losses, largest_grad = [], 0.0
    for step in range(STEPS):
        losses.append(train_step(ours_engine, rank))
        reference.given = ours.seen
        train_step(torch_engine, rank)
        if step == 0:  # identical engines: identical first grads
            assert all(torch.equal(a, b) for a, b in zip(reference.own, ours.seen)), "the first grads differ"
        largest_grad = max(largest_grad, *(g.abs().max().item() for g in ours.seen))
    assert losses[-1] < losses[0], f"rank {rank}: loss went {losses[0]:.4f} -> {losses[-1]:.4f}"
    # The same bounds as tests/test_fsdp2.py (and test_optimizer.py): each step's update
    # (|update| <= about lr) differs from torch's by a few ulps, so weights stay within
    # 8 ulps of |p| + STEPS * lr; exp_avg cancels terms as large as the grads; exp_avg_sq
    # adds non-negative terms and stays within a few ulps of itself.
    for p, q in zip(client_flats(ours_engine), client_flats(torch_engine)):
        assert p.dtype == torch.float32 and p.device.type == "cpu" and p.dim() == 1
        assert_within(p, q, STEPS * HYPER["lr"], f"rank {rank} flat fp32 partition")
        mine, theirs = ours.state[p], reference.state[q]
        assert_within(mine["exp_avg"], theirs["exp_avg"], largest_grad, f"rank {rank} exp_avg")
        worst = ulp_distance(mine["exp_avg_sq"], theirs["exp_avg_sq"]).max().item()
        assert worst <= 8, f"rank {rank} exp_avg_sq: {worst} ulps apart"
        assert mine["step"].item() == theirs["step"].item() == STEPS
    assert_ranks_agree(ours_engine)


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_deepspeed_zero_offload_matches_torch_adamw(stage: int) -> None:
    run_ranks(_matches_adamw, stage, timeout_s=150)


def _bf16_model_bf16_states_train(rank: int, world_size: int) -> None:
    engine = build_engine(CPUAdam, stage=2, bf16=True, fp32_optimizer_states=False)
    optimizer = engine.optimizer.optimizer
    losses = [train_step(engine, rank, torch.bfloat16) for _ in range(STEPS)]
    assert losses[-1] < 0.8 * losses[0], f"rank {rank}: loss went {losses[0]:.4f} -> {losses[-1]:.4f}"
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    for flat in client_flats(engine):
        # DeepSpeed keeps the fp32 master partition; CPUAdam keeps its moments in bf16.
        assert flat.dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            assert optimizer.state[flat][key].dtype == torch.bfloat16
    assert_ranks_agree(engine)


def test_deepspeed_bf16_model_with_bf16_states_trains() -> None:
    run_ranks(_bf16_model_bf16_states_train, timeout_s=150)
