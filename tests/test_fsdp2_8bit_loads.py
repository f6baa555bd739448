"""Saved moments loaded into CPUAdam's 8-bit moments on FSDP2 shards that start inside a 256-element block of
their whole param (gloo ranks on the CPU).

A shard's 8-bit blocks are the whole param's blocks cut to the shard: its head (the part of the block it starts
in) has a scale of its own, then whole blocks follow (``cpu_adam.fsdp2.places``). Float moments loaded into such a shard
are quantized in those blocks; 8-bit codes whose scales are blocks of the local tensor (what a checkpointer that
copies ``optimizer.state`` saves, not ``CPUAdam.state_dict()``) are refused, since the blocks they name are not the
shard's. The shards here start at odd elements, at even ones inside blocks, on block boundaries, and are empty.
"""

from __future__ import annotations

import pytest
import torch
from rank_spawn import run_ranks
from test_fsdp2_checkpoint import step_on
from test_fsdp2_shards import HYPER, rows_of, sharded_model
from torch import Tensor, nn

from cpu_adam import CPUAdam, quant8
from cpu_adam.fsdp2.places import local

pytestmark = [pytest.mark.dist, pytest.mark.slow]

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_available():
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)


def shard_range(p: Tensor, rank: int, world_size: int) -> tuple[int, int]:
    """Where ``p``'s local shard lies in its flattened whole param: torch.chunk's rows, as FSDP2 cuts them."""
    rows, row_size = p.shape[0], p[0].numel()
    mine = rows_of(rank, world_size, rows)
    return mine.start * row_size, mine.stop * row_size


def block_pieces(start: int, stop: int) -> list[tuple[int, int]]:
    """The whole param's 256-element blocks cut to the elements [start, stop), in the shard's own places."""
    cuts = [start, *range((start // quant8.BLOCK + 1) * quant8.BLOCK, stop, quant8.BLOCK), stop]
    return [(lo - start, hi - start) for lo, hi in zip(cuts, cuts[1:]) if hi > lo]


def model_and_optimizer(precision: str) -> tuple[nn.Module, CPUAdam]:
    model = sharded_model(torch.float32)
    return model, CPUAdam(model.parameters(), **HYPER, state_precision=precision)


def _fp32_moments_load_in_the_shards_blocks(rank: int, world_size: int) -> None:
    source, fp32 = model_and_optimizer("fp32")
    for step in range(2):
        step_on(source, fp32, step)
    model, eight_bit = model_and_optimizer("8bit")
    eight_bit.load_state_dict(fp32.state_dict())
    for index, (p, q) in enumerate(zip(model.parameters(), source.parameters())):
        what = f"rank {rank}/{world_size}: param {index} {tuple(p.shape)}"
        start, stop = shard_range(p, rank, world_size)
        whole = [fp32.state[q][key].full_tensor().reshape(-1) for key in ("exp_avg", "exp_avg_sq")]
        state = eight_bit.state[p]
        codes = [state[key].to_local().reshape(-1) for key in ("exp_avg", "exp_avg_sq")]
        pieces = block_pieces(start, stop)
        assert tuple(state["state_scales"].shape) == (2, len(pieces)), f"{what}: shard from {start}: scales"
        for block, (lo, hi) in enumerate(pieces):
            expected = quant8.quantize_moments(*(t[start + lo : start + hi] for t in whole))
            loaded = (codes[0][lo:hi], codes[1][lo:hi], state["state_scales"][:, block : block + 1])
            for key, mine, theirs in zip(
                ("exp_avg", "exp_avg_sq"), quant8.dequantize_moments(*loaded), quant8.dequantize_moments(*expected)
            ):
                assert torch.equal(mine, theirs), f"{what}: {key} of elements {start + lo}-{start + hi}"
    step_on(model, eight_bit, 2)  # and the loaded state steps
    assert all(s["step"].item() == 3 for s in eight_bit.state.values())


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp32_moments_load_into_8bit_shards_quantized_in_the_whole_params_blocks(world_size: int) -> None:
    """Each shard's loaded 8-bit moments are its moments quantized in the whole param's blocks cut to the shard, as
    one process quantizes them piece by piece. Quantized from the shard's own first element instead, a shard that
    starts inside a block had its exp_avg off by up to 0.675 of its largest value, or the next step raised on the
    shape of its scales."""
    run_ranks(_fp32_moments_load_in_the_shards_blocks, world_size=world_size, timeout_s=120.0)


REFUSAL = "starts inside a block of its whole param"


def load_outcome(optimizer: CPUAdam, state_dict: dict) -> str:
    try:
        optimizer.load_state_dict(state_dict)
    except ValueError as error:
        return "refused" if REFUSAL in str(error) else f"refused for another reason: {error}"
    return "loaded"


def _local_block_scales_are_refused_inside_a_block(rank: int, world_size: int) -> None:
    source, saved_from = model_and_optimizer("8bit")
    for step in range(2):
        step_on(source, saved_from, step)
    # The state as torch's Optimizer.state_dict() gives it: each shard's scales in [2, blocks] of its own.
    saved = torch.optim.Optimizer.state_dict(saved_from)
    inside = {}  # shard start: what its load did
    for index, p in enumerate(source.parameters()):
        start, stop = shard_range(p, rank, world_size)
        model, optimizer = model_and_optimizer("8bit")
        one_param = {"state": {index: saved["state"][index]}, "param_groups": saved["param_groups"]}
        if stop > start and start % quant8.BLOCK:
            inside[start] = load_outcome(optimizer, one_param)
            assert inside[start] == "loaded" or not optimizer.state, f"rank {rank}: a refused load changed the state"
            continue
        optimizer.load_state_dict(one_param)  # from a block boundary the shard's blocks are its own: loaded as saved
        for key in ("exp_avg", "exp_avg_sq", "state_scales"):
            loaded = optimizer.state[list(model.parameters())[index]][key]
            assert torch.equal(local(loaded), local(saved_from.state[p][key])), f"rank {rank}: {key}"
    assert all(outcome == "refused" for outcome in inside.values()), f"rank {rank}, by shard start: {inside}"
    if rank == 1:  # the shards this test is about
        assert {start % 2 for start in inside} == {0, 1}, f"no odd and even starts inside blocks: {inside}"


def test_8bit_local_block_scales_are_refused_where_a_shard_starts_inside_a_block() -> None:
    """Scales in blocks of a shard's own elements name other blocks than its own wherever it starts inside one,
    at an even element as at an odd one. Refused only at odd ones, a shard starting at an even element inside a
    block loaded its sqrt(exp_avg_sq) silently off by up to 0.91 of its largest value."""
    run_ranks(_local_block_scales_are_refused_inside_a_block, world_size=2, timeout_s=120.0)
