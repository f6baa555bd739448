"""The step behind the forward (``cpu_adam.fsdp2.step_behind_forward``) gives the serial step's bits: every
precision of shards and moments, clipping inside and outside the step and none, at world sizes 1, 2 and 4 and
HSDP, with what trainers do between steps (accumulation, frozen params, param groups, activation checkpointing,
``reshard_after_forward=False``, a forward of one model part, skipped steps, prefetching, another block order)."""

from __future__ import annotations

import pytest
import torch
from behind_setup import PRECISIONS, Case, each_case, train_both
from rank_spawn import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.slow]

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

EVERY_PRECISION = [
    Case(dtype=dtype, precision=precision, clip=clip)
    for dtype, precision in PRECISIONS
    for clip in ("inside", "outside", None)
]
WHAT_TRAINERS_DO = each_case(
    Case(),
    reshard_after_forward=[False],
    checkpointed=[True],
    frozen=[True],
    groups=[True],
    accumulate=[2],
    nonfinite_at=[1],
    partial_forward=[True],
    reversed_order=[True],
    prefetch=[True],
)
CASES = {
    1: [Case(dtype=dtype, precision=precision) for dtype, precision in PRECISIONS] + WHAT_TRAINERS_DO,
    2: EVERY_PRECISION + each_case(Case(clip="outside"), accumulate=[2], groups=[True], reshard_after_forward=[False]),
    4: [Case(dtype=dtype, precision=precision) for dtype, precision in PRECISIONS]
    + [Case(precision="8bit", replicas=2), Case(dtype=torch.float32, precision="fp32", replicas=2, clip="outside")],
}


def _train_every_case(rank: int, world_size: int) -> None:
    for case in CASES[world_size]:
        train_both(case, f"rank {rank}/{world_size}, {case.describe()}")


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_the_step_behind_the_forward_is_the_serial_step(world_size: int) -> None:
    run_ranks(_train_every_case, world_size=world_size, timeout_s=400.0)
