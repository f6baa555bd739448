"""CPUAdam on FSDP2's CPU-offloaded DTensor shards, every precision, at world sizes 1, 2 and 4:
for the same grads, weights and state are bitwise those of CPUAdam on the whole tensors in one
process (8-bit moments: outside the blocks a shard boundary cuts, see docs/cpu_adam.md).

Each rank steps its shards and, beside them, CPUAdam on whole, plain tensors fed the full grads of
the shards (``full_tensor()``): the one-process reference, which no world size touches. The model's
shapes give uneven shards, padded and empty ones, shards starting at odd elements and inside 8-bit
blocks, and shards on block boundaries.
"""

from __future__ import annotations

import pytest
import torch
from rank_spawn import run_ranks
from torch import Tensor, nn

from cpu_adam import CPUAdam, quant8
from cpu_adam.fsdp2.places import element_scales

pytestmark = [pytest.mark.dist, pytest.mark.slow]

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_available():
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

HYPER = {"lr": 1e-2, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.05}
STEPS = 3
# (param dtype, moments): fp32 shards with every precision of moments, and bf16 shards that are the
# masters, stepped with stochastic rounding.
SETTINGS = [
    (torch.float32, "fp32"),
    (torch.float32, "bf16"),
    (torch.bfloat16, "bf16"),
    (torch.float32, "8bit"),
    (torch.bfloat16, "8bit"),
]


def plain_model(dtype: torch.dtype) -> nn.Module:
    # Rows of 12, 1, 33 and 256 elements over 33, 256 and 5 rows: at 2 and 4 ranks shards start at odd
    # elements (the 33 biases), inside 8-bit blocks (12 and 33 per row), on block boundaries (256 per
    # row); 5 rows over 4 ranks leave rank 3 an empty shard.
    torch.manual_seed(0)
    layers = [nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 256), nn.Tanh(), nn.Linear(256, 5)]
    return nn.Sequential(*layers).to(dtype)


def sharded_model(dtype: torch.dtype, replicas: int = 1, **options: object) -> nn.Module:
    """``plain_model`` with each Linear and the whole sharded by FSDP2 on the CPU (``options``: fully_shard's),
    over ``replicas`` replicas of the shards (HSDP: the mesh's dims are replicas x shards)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = plain_model(dtype)
    world_size = torch.distributed.get_world_size()
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    options = {k: v for k, v in options.items() if v is not None}
    for layer in model[::2]:
        fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False), **options)
    fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False), **options)
    return model


def rows_of(rank: int, world_size: int, rows: int) -> range:
    """The rows FSDP2 gives ``rank``: torch.chunk's split of dim 0 (the last ranks may get none)."""
    chunks = torch.arange(rows).chunk(world_size)
    return range(int(chunks[rank][0]), int(chunks[rank][-1]) + 1) if rank < len(chunks) else range(0)


def cut_elements(numel: int, row_size: int, rows: int, world_size: int) -> Tensor:
    """Which elements of a whole param lie in an 8-bit block that a shard boundary cuts."""
    cut = torch.zeros(quant8.blocks(numel), dtype=torch.bool)
    for rank in range(1, world_size):
        boundary = rows_of(rank, world_size, rows).start * row_size
        if 0 < boundary < numel and boundary % quant8.BLOCK:
            cut[boundary // quant8.BLOCK] = True
    return cut.repeat_interleave(quant8.BLOCK)[:numel]


def assert_bitwise(actual: Tensor, expected: Tensor, what: str) -> None:
    assert actual.dtype == expected.dtype, f"{what}: {actual.dtype} vs {expected.dtype}"
    size = actual.element_size()
    raw = [t.reshape(-1).contiguous().view(torch.uint8).reshape(-1, size) for t in (actual, expected)]
    differ = (raw[0] != raw[1]).any(dim=1)
    assert not differ.any(), f"{what}: {int(differ.sum())} of {actual.numel()} elements differ from the reference's"


def _steps_as_one_process(rank: int, world_size: int) -> None:
    # At 4 ranks, also HSDP: 2 replicas of shards over 2 ranks (the placements Replicate, Shard(0)).
    layouts = [(dtype, precision, 1) for dtype, precision in SETTINGS]
    if world_size == 4:
        layouts.append((torch.bfloat16, "8bit", 2))
    for dtype, precision, replicas in layouts:
        shards, shard_rank = world_size // replicas, rank % (world_size // replicas)
        what = f"rank {rank}/{world_size} ({replicas} replicas), {dtype} shards, {precision} moments"
        options = {**HYPER, "state_precision": precision, "stochastic_rounding": dtype == torch.bfloat16, "seed": 7}
        sharded, whole = sharded_model(dtype, replicas), plain_model(dtype)
        ours, reference = CPUAdam(sharded.parameters(), **options), CPUAdam(whole.parameters(), **options)
        for step in range(STEPS):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x, y = torch.randn(8, 12, generator=g, dtype=dtype), torch.randn(8, 5, generator=g, dtype=dtype)
            nn.functional.mse_loss(sharded(x), y).backward()
            for p, q in zip(sharded.parameters(), whole.parameters()):
                q.grad = p.grad.full_tensor()
            ours.step()
            reference.step()
            ours.zero_grad()
            reference.zero_grad()
        for p, q in zip(sharded.parameters(), whole.parameters()):
            rows, row_size = q.shape[0], q[0].numel()
            mine = rows_of(shard_rank, shards, rows)
            start, numel = mine.start * row_size, len(mine) * row_size
            shard = slice(start, start + numel)
            local, state, theirs = p.to_local().reshape(-1), ours.state[p], reference.state[q]
            assert local.numel() == numel and state["step"].item() == theirs["step"].item() == STEPS
            keep = torch.ones(numel, dtype=torch.bool)
            if precision == "8bit":  # bitwise outside the blocks a boundary cuts; close inside them
                keep = ~cut_elements(q.numel(), row_size, rows, shards)[shard]
                scales = element_scales(state["state_scales"], numel, start)
                whole_scales = element_scales(theirs["state_scales"], q.numel(), 0)[:, shard]
                assert_bitwise(scales[:, keep], whole_scales[:, keep], f"{what}: {tuple(q.shape)} scales")
                drift = (local.double() - q.detach().reshape(-1)[shard].double()).abs()
                assert (drift <= STEPS * HYPER["lr"]).all(), f"{what}: cut blocks' weights {drift.max():.3g} away"
            assert_bitwise(local[keep], q.detach().reshape(-1)[shard][keep], f"{what}: {tuple(q.shape)} weights")
            for key in ("exp_avg", "exp_avg_sq"):
                moment = state[key].to_local().reshape(-1)[keep]
                assert_bitwise(moment, theirs[key].reshape(-1)[shard][keep], f"{what}: {tuple(q.shape)} {key}")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_fsdp2_shards_step_as_one_process(world_size: int) -> None:
    run_ranks(_steps_as_one_process, world_size=world_size, timeout_s=240.0)
