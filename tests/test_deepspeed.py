"""CPUAdam as DeepSpeed's client optimizer: ZeRO-1/2 with offload_optimizer on the CPU, and ZeRO-3 with
offload_optimizer and offload_param, as DeepSpeed runs models larger than the GPU.

Two ranks on gloo with DeepSpeed's CPU accelerator. DeepSpeed hands the client optimizer flat fp32 tensors, this
rank's partition, whose .grad it fills: one per param group under ZeRO-1/2; under ZeRO-3 one per sub-group, each
put alone in its param group for a step() call of its own. The references are the same engine with torch's AdamW
(foreach=False) or DeepSpeedCPUAdam as the client optimizer, stepping on the grads CPUAdam was given.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from conftest import assert_same_bits, ulp_distance
from rank_spawn import run_ranks
from torch import nn

from cpu_adam import CPUAdam

pytestmark = [pytest.mark.dist, pytest.mark.slow]

# Not imported here: DeepSpeed picks its accelerator once, at import, and the ranks (which
# import this module) must pick the CPU first; see build_engine.
if importlib.util.find_spec("deepspeed") is None:
    pytest.skip("deepspeed is not installed (pip install deepspeed)", allow_module_level=True)

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
FP32_UNIT_ROUNDOFF = 2.0**-24
STEPS = 6  # even: a resumed run saves after half of them
SUB_GROUP_SIZE = 300  # elements of a rank's partition: ZeRO-3 cuts model()'s into 3 sub-groups, 3 step() calls
CLIP = 1.0
TARGET_SCALE = 4.0  # large enough targets that the grads' norm stays above CLIP: the clipping tests clip
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": torch.uint8}


def example_config(stage: int) -> dict:
    """The config of examples/ (as the docs show it) for this stage: ZeRO-3's, or ZeRO-2's for stages 1 and 2."""
    name = "deepspeed_cpu_adam_zero3.json" if stage == 3 else "deepspeed_cpu_adam.json"
    config = json.loads((EXAMPLES / name).read_text())
    config["zero_optimization"]["stage"] = stage
    return config


def ds_config(stage: int, bf16: bool = False, gradient_clipping: float = 0.0) -> dict:
    """The example's config at the tests' scale; gradient_clipping 0 is DeepSpeed's default, no clipping."""
    config = example_config(stage)
    config.update(train_micro_batch_size_per_gpu=8, gradient_clipping=gradient_clipping, bf16={"enabled": bf16})
    if stage == 3:
        config["zero_optimization"]["sub_group_size"] = SUB_GROUP_SIZE
    return config


def skip_shm_comm_build() -> None:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce at init (about a minute
    on 2 cores, once per machine) that only its inference all-reduce uses; training goes
    through torch.distributed. These tests skip that build where DeepSpeed has the hook."""
    # By module path: the attribute deepspeed.comm.torch is the torch package itself.
    backend = importlib.import_module("deepspeed.comm.torch")
    if hasattr(backend, "build_shm_op"):
        backend.build_shm_op = lambda: None


def model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in every engine
    return nn.Sequential(nn.Linear(12, 48), nn.Tanh(), nn.Linear(48, 32), nn.Tanh(), nn.Linear(32, 9))


def build_engine(
    optimizer_class: type[torch.optim.Optimizer],
    stage: int,
    bf16: bool = False,
    gradient_clipping: float = 0.0,
    **kwargs,
):
    # On a GPU machine DeepSpeed would pick CUDA; these tests mean gloo and CPU tensors.
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    skip_shm_comm_build()
    module = model()
    optimizer = optimizer_class(module.parameters(), **HYPER, **kwargs)
    config = ds_config(stage, bf16, gradient_clipping)
    engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    if stage == 3:
        assert len(client_flats(engine)) == 3, "the ZeRO-3 tests mean 3 sub-groups: 3 step() calls per step"
    return engine


def client_flats(engine) -> list[torch.Tensor]:
    """The flat fp32 partitions DeepSpeed steps with its client optimizer, in DeepSpeed's order (ZeRO-3 takes
    its sub-groups out of the client's param groups between step() calls)."""
    if engine.zero_optimization_stage() == 3:
        return engine.optimizer.fp32_partitioned_groups_flat
    return engine.optimizer.single_partition_of_fp32_groups


def local_weights(engine) -> list[torch.Tensor]:
    """The model's weights as this rank holds them: whole under ZeRO-1/2, its partitions under ZeRO-3."""
    return [getattr(p, "ds_tensor", p).detach().clone() for p in engine.module.parameters()]


def batch(rank: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """One fixed batch per rank: memorizing it must bring the loss down within a few steps."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(8, 12, generator=g).to(dtype), TARGET_SCALE * torch.randn(8, 9, generator=g)


def backward(engine, rank: int, dtype: torch.dtype) -> float:
    x, y = batch(rank, dtype)
    loss = nn.functional.mse_loss(engine(x).float(), y)
    engine.backward(loss)
    return loss.item()


def train_step(engine, rank: int, dtype: torch.dtype = torch.float32) -> float:
    loss = backward(engine, rank, dtype)
    engine.step()
    return loss


class CPUAdamKeepingGrads(CPUAdam):
    """CPUAdam that keeps a copy of the grads DeepSpeed hands it, by flat partition, for the references."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: dict[torch.Tensor, torch.Tensor] = {}

    def step(self, closure=None):
        self.seen.update({p: p.grad.clone() for group in self.param_groups for p in group["params"]})
        return super().step(closure)


def on_given_grads(optimizer_class: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """``optimizer_class`` stepping on the grads handed to it (``given``, by flat partition) rather than its own
    (kept in ``own``).

    From the second step the engines' weights differ by ulps, and so would their grads; stepping the references
    on CPUAdam's grads leaves only the optimizers' arithmetic to differ.
    """

    class OnGivenGrads(optimizer_class):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.given: dict[torch.Tensor, torch.Tensor] = {}
            self.own: dict[torch.Tensor, torch.Tensor] = {}

        def step(self, *args, **kwargs):
            for p in (p for group in self.param_groups for p in group["params"]):
                self.own[p] = p.grad.clone()
                p.grad.copy_(self.given[p])
            return super().step(*args, **kwargs)

    return OnGivenGrads


def train_beside(
    ours_engine,
    references: list,
    rank: int,
    dtype: torch.dtype,
    alone: Sequence[CPUAdam] = (),
    save_to: str = "",
) -> None:
    """STEPS steps of CPUAdam's engine (saving a checkpoint after half of them to ``save_to``); each reference
    engine steps on the grads CPUAdam was given, and each of ``alone`` (a CPUAdam over one flat partition's copy,
    in DeepSpeed's order) on that partition's."""
    ours = ours_engine.optimizer.optimizer
    losses = []
    for step in range(STEPS):
        if save_to and step == STEPS // 2:
            ours_engine.save_checkpoint(save_to)
        losses.append(train_step(ours_engine, rank, dtype))
        given = [ours.seen[flat] for flat in client_flats(ours_engine)]
        for optimizer, grad in zip(alone, given):
            optimizer.param_groups[0]["params"][0].grad = grad.clone()
            optimizer.step()
        for engine in references:
            reference = engine.optimizer.optimizer
            reference.given = dict(zip(client_flats(engine), given))
            train_step(engine, rank, dtype)
            if step == 0:  # identical engines: identical first grads
                own = [reference.own[flat] for flat in client_flats(engine)]
                assert all(torch.equal(a, b) for a, b in zip(own, given)), "the first grads differ"
    assert losses[-1] < losses[0], f"rank {rank}: loss went {losses[0]:.4f} -> {losses[-1]:.4f}"


def largest_grad(optimizer: CPUAdamKeepingGrads) -> float:
    return max(g.abs().max().item() for g in optimizer.seen.values())


def assert_within(actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str, ulps: int = 8) -> None:
    """``ulps`` float32 ulps of |expected| + scale, where scale bounds the terms that cancel."""
    bound = ulps * FP32_UNIT_ROUNDOFF * (expected.double().abs() + scale)
    excess = (actual.double() - expected.double()).abs() - bound
    assert excess.max() <= 0, f"{what}: off by {excess.max().item():.3g} beyond {ulps} ulps"


def real_part(engine, index: int, t: torch.Tensor) -> torch.Tensor:
    """``t``, laid out as the engine's flat partition ``index``, without ZeRO-3's padding: where the ranks do not
    divide a param's size, the last rank's partition of it ends in elements left as whatever memory was there (in
    each engine its own, never read into the model). ZeRO-1/2 pad with zeros."""
    if engine.zero_optimization_stage() != 3:
        return t
    rank = torch.distributed.get_rank()
    pieces, offset = [], 0
    for p in engine.optimizer.fp16_groups[index]:
        size = p.partition_numel()
        pieces.append(t[offset : offset + min(size, max(0, p.ds_numel - rank * size))])
        offset += size
    return torch.cat(pieces)


def assert_steps_as_adamw(ours_engine, torch_engine, what: str) -> None:
    """The same bounds as tests/test_fsdp2.py (and test_optimizer.py): each step's update (|update| <= about lr)
    differs from torch's by a few ulps, so weights stay within 8 ulps of |p| + STEPS * lr; exp_avg cancels terms as
    large as the grads; exp_avg_sq adds non-negative terms and stays within a few ulps of itself."""
    ours, reference = ours_engine.optimizer.optimizer, torch_engine.optimizer.optimizer
    assert isinstance(ours, CPUAdam), f"DeepSpeed replaced the client optimizer with {type(ours).__name__}"
    for i, (p, q) in enumerate(zip(client_flats(ours_engine), client_flats(torch_engine))):
        assert p.dtype == torch.float32 and p.device.type == "cpu" and p.dim() == 1
        real = functools.partial(real_part, ours_engine, i)
        assert_within(real(p), real(q), STEPS * HYPER["lr"], f"{what} flat fp32 partition {i}")
        mine, theirs = ours.state[p], reference.state[q]
        assert_within(real(mine["exp_avg"]), real(theirs["exp_avg"]), largest_grad(ours), f"{what} exp_avg {i}")
        worst = ulp_distance(real(mine["exp_avg_sq"]), real(theirs["exp_avg_sq"])).max().item()
        assert worst <= 8, f"{what} exp_avg_sq {i}: {worst} ulps apart"
        assert mine["step"].item() == theirs["step"].item() == STEPS


def assert_ranks_agree(engine) -> None:
    """ZeRO-1/2 keep full weights on every rank: after the all-gather they must be identical."""
    import torch.distributed as dist

    flat = torch.cat([p.detach().float().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks hold different weights"


def _matches_adamw(rank: int, world_size: int, stage: int) -> None:
    ours_engine = build_engine(CPUAdamKeepingGrads, stage)
    torch_engine = build_engine(on_given_grads(torch.optim.AdamW), stage)
    train_beside(ours_engine, [torch_engine], rank, torch.float32)
    assert_steps_as_adamw(ours_engine, torch_engine, f"rank {rank}")
    assert_ranks_agree(ours_engine)


@pytest.mark.parametrize("stage", [1, 2], ids=["zero1", "zero2"])
def test_deepspeed_zero_offload_matches_torch_adamw(stage: int) -> None:
    run_ranks(_matches_adamw, stage, timeout_s=150)


def _bf16_model_bf16_states_train(rank: int, world_size: int) -> None:
    engine = build_engine(CPUAdam, stage=2, bf16=True, fp32_optimizer_states=False)
    optimizer = engine.optimizer.optimizer
    losses = [train_step(engine, rank, torch.bfloat16) for _ in range(STEPS)]
    assert losses[-1] < losses[0], f"rank {rank}: loss went {losses[0]:.4f} -> {losses[-1]:.4f}"
    assert all(p.dtype == torch.bfloat16 for p in engine.module.parameters())
    for flat in client_flats(engine):
        # DeepSpeed keeps the fp32 master partition; CPUAdam keeps its moments in bf16.
        assert flat.dtype == torch.float32
        for key in ("exp_avg", "exp_avg_sq"):
            assert optimizer.state[flat][key].dtype == torch.bfloat16
    assert_ranks_agree(engine)


def test_deepspeed_bf16_model_with_bf16_states_trains() -> None:
    run_ranks(_bf16_model_bf16_states_train, timeout_s=150)


def global_norm(grads: list[torch.Tensor]) -> float:
    """The norm of the ranks' partitions together (padding is zeros)."""
    import torch.distributed as dist

    squares = torch.stack([g.double().square().sum() for g in grads]).sum().reshape(1)
    dist.all_reduce(squares)
    return squares.sqrt().item()


def _clips_by_gradient_clipping(rank: int, world_size: int, stage: int) -> None:
    refused = build_engine(CPUAdam, stage, gradient_clipping=CLIP, max_grad_norm=CLIP)
    masters, weights = [flat.clone() for flat in client_flats(refused)], local_weights(refused)
    backward(refused, rank, torch.float32)
    with pytest.raises(ValueError, match="gradient_clipping"):
        refused.step()
    assert not refused.optimizer.optimizer.state, f"rank {rank}: the refused step created state"
    assert all(map(torch.equal, client_flats(refused), masters)), f"rank {rank}: the refused step moved the masters"
    assert all(map(torch.equal, local_weights(refused), weights)), f"rank {rank}: the refused step moved the weights"

    ours_engine = build_engine(CPUAdamKeepingGrads, stage, gradient_clipping=CLIP)
    torch_engine = build_engine(on_given_grads(torch.optim.AdamW), stage, gradient_clipping=CLIP)
    train_beside(ours_engine, [torch_engine], rank, torch.float32)
    norm_given = global_norm(list(ours_engine.optimizer.optimizer.seen.values()))
    assert float(ours_engine.get_global_grad_norm()) > CLIP, "the test means to clip"
    assert abs(norm_given - CLIP) < 1e-5, f"rank {rank}: CPUAdam was given grads of norm {norm_given}, not {CLIP}"
    assert_steps_as_adamw(ours_engine, torch_engine, f"rank {rank}")


@pytest.mark.parametrize("stage", [2, 3], ids=["zero2", "zero3"])
def test_deepspeed_refuses_max_grad_norm_and_clips_by_gradient_clipping(stage: int) -> None:
    """max_grad_norm under DeepSpeed, which hands CPUAdam a part of the grads (ZeRO-3: 3 sub-groups, a step() call
    each), is refused naming gradient_clipping, before anything changes; the fix it names, gradient_clipping in the
    config with max_grad_norm None, steps as torch's AdamW does under the same config."""
    run_ranks(_clips_by_gradient_clipping, stage, timeout_s=150)


def assert_same_state(ours: dict, reference: dict, what: str) -> None:
    assert ours.keys() == reference.keys(), what
    for key in ours:
        if ours[key].is_floating_point():
            assert_same_bits(ours[key], reference[key], f"{what} {key}")
        else:  # 8-bit codes
            assert torch.equal(ours[key], reference[key]), f"{what} {key}"


def _zero3_offload(rank: int, world_size: int, precision: str, checkpoint: str) -> None:
    ours_engine = build_engine(CPUAdamKeepingGrads, 3, bf16=True, state_precision=precision)
    flats = client_flats(ours_engine)
    alone = [CPUAdam([flat.detach().clone()], **HYPER, state_precision=precision) for flat in flats]
    references = []
    if precision == "fp32":
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # its op built beforehand: build_deepspeed_cpu_adam_op

        references = [build_engine(on_given_grads(cls), 3, bf16=True) for cls in (DeepSpeedCPUAdam, torch.optim.AdamW)]
    train_beside(ours_engine, references, rank, torch.bfloat16, alone, save_to=checkpoint)

    ours = ours_engine.optimizer.optimizer
    assert all(ours.state[flat]["exp_avg"].dtype == MOMENT_DTYPES[precision] for flat in flats)
    for i, (flat, optimizer) in enumerate(zip(flats, alone)):
        (single,) = optimizer.param_groups[0]["params"]
        assert_same_bits(flat, single, f"rank {rank} sub-group {i}: the master")
        assert_same_state(ours.state[flat], optimizer.state[single], f"rank {rank} sub-group {i}")
    if references:
        deepspeed_engine, torch_engine = references
        for i, (p, q) in enumerate(zip(flats, client_flats(deepspeed_engine))):
            real = functools.partial(real_part, ours_engine, i)
            what = f"rank {rank} sub-group {i}: DeepSpeedCPUAdam's master"
            assert_within(real(p), real(q), STEPS * HYPER["lr"], what, ulps=16)
        assert_steps_as_adamw(ours_engine, torch_engine, f"rank {rank}")

    resumed = build_engine(CPUAdam, 3, bf16=True, state_precision=precision)
    resumed.load_checkpoint(checkpoint)
    for _ in range(STEPS - STEPS // 2):
        train_step(resumed, rank, torch.bfloat16)
    for i, (p, q) in enumerate(zip(client_flats(resumed), flats)):
        assert_same_bits(p, q, f"rank {rank} sub-group {i}: the resumed master")
        assert_same_state(resumed.optimizer.optimizer.state[p], ours.state[q], f"rank {rank} sub-group {i} resumed")
    for i, (p, q) in enumerate(zip(local_weights(resumed), local_weights(ours_engine))):
        assert_same_bits(p, q, f"rank {rank} param {i}: the resumed bf16 partition")


@pytest.mark.parametrize("precision", MOMENT_DTYPES)
def test_deepspeed_zero3_offload_steps_as_deepspeed_cpu_adam_and_resumes(precision: str, tmp_path: Path) -> None:
    """ZeRO-3 with the optimizer and the params offloaded to the CPU, a bf16 model and fp32 masters: CPUAdam steps
    each sub-group as CPUAdam alone steps that tensor (bitwise); with fp32 moments as DeepSpeedCPUAdam and torch's
    AdamW do (to 16 and 8 ulps); and a checkpoint saved after half the steps, loaded into a fresh engine, goes on
    bitwise as the engine that saved it."""
    if precision == "fp32":
        build_deepspeed_cpu_adam_op()
    run_ranks(_zero3_offload, precision, str(tmp_path), timeout_s=150)


def build_deepspeed_cpu_adam_op() -> None:
    """DeepSpeedCPUAdam's op, JIT-built by DeepSpeed's own builder as DeepSpeedCPUAdam loads it (minutes on 2 cores
    the first time, then cached in ~/.cache/torch_extensions), here rather than in both ranks within their deadline."""
    build = subprocess.run(
        [sys.executable, "-c", "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()"],
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert build.returncode == 0, f"DeepSpeed's CPUAdamBuilder failed:\n{build.stderr[-3000:]}"
