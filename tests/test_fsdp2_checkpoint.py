"""CPUAdam's state on FSDP2 shards through ``torch.distributed.checkpoint``: saved on 2 ranks, loaded
on 4 and on 1, training goes on as CPUAdam on the whole tensors in one process would (bitwise; 8-bit
moments: outside the blocks a shard boundary cuts); the full state dict loads into CPUAdam and into
torch's AdamW in one process; torch's state initialisation changes nothing; a checkpoint that does
not fit is refused.

The grads are whole tensors drawn per param and step, each rank taking its shard of them, so that
every world size steps on the same grads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rank_spawn import run_ranks
from test_fsdp2_shards import HYPER, SETTINGS, assert_bitwise, cut_elements, plain_model, rows_of, sharded_model
from torch import Tensor, nn

from cpu_adam import CPUAdam, quant8

pytestmark = [pytest.mark.dist, pytest.mark.slow]

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard") or not torch.distributed.is_available():
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

SAVED_AT = 2  # the world size the checkpoint is saved at, after SAVED_AT steps
STEPS = 4


def name(dtype: torch.dtype, precision: str) -> str:
    return f"{str(dtype).removeprefix('torch.')}-{precision}"


def options(dtype: torch.dtype, precision: str) -> dict:
    return {**HYPER, "state_precision": precision, "stochastic_rounding": dtype == torch.bfloat16, "seed": 3}


def whole_grads(model: nn.Module, step: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(step)
    return [0.1 * torch.randn(p.shape, generator=g).to(p.dtype) for p in model.parameters()]


def step_on(model: nn.Module, optimizer: CPUAdam, step: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for p, grad in zip(model.parameters(), whole_grads(model, step)):
        sharded = isinstance(p, DTensor)
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements, src_data_rank=None) if sharded else grad
    optimizer.step()
    optimizer.zero_grad()


def one_process(dtype: torch.dtype, precision: str, steps: int) -> tuple[nn.Module, CPUAdam]:
    model = plain_model(dtype)
    optimizer = CPUAdam(model.parameters(), **options(dtype, precision))
    for step in range(steps):
        step_on(model, optimizer, step)
    return model, optimizer


def assert_as_one_process(
    model: nn.Module, optimizer: CPUAdam, dtype: torch.dtype, precision: str, rank: int, world_size: int
) -> None:
    """Each shard is bitwise its part of one process's whole tensors after STEPS steps; 8-bit: outside
    the blocks cut by a shard boundary at the saving world size or this one."""
    whole, reference = one_process(dtype, precision, STEPS)
    what = f"rank {rank}/{world_size} {name(dtype, precision)}"
    for p, q in zip(model.parameters(), whole.parameters()):
        rows, row_size = q.shape[0], q[0].numel()
        mine = rows_of(rank, world_size, rows)
        shard = slice(mine.start * row_size, mine.stop * row_size)
        keep = torch.ones(q.numel(), dtype=torch.bool)
        if precision == "8bit":
            for size in (SAVED_AT, world_size):
                keep &= ~cut_elements(q.numel(), row_size, rows, size)
        keep = keep[shard]
        state, theirs = optimizer.state[p], reference.state[q]
        assert state["step"].item() == theirs["step"].item() == STEPS, f"{what}: step counts"
        assert_bitwise(p.to_local().reshape(-1)[keep], q.detach().reshape(-1)[shard][keep], f"{what} weights")
        for key in ("exp_avg", "exp_avg_sq"):
            mine_state = state[key].to_local().reshape(-1)[keep]
            assert_bitwise(mine_state, theirs[key].reshape(-1)[shard][keep], f"{what} {key}")


def _save(rank: int, world_size: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    for dtype, precision in SETTINGS:
        model = sharded_model(dtype)
        optimizer = CPUAdam(model.parameters(), **options(dtype, precision))
        # torch's state initialisation (a zero-grad, lr=0 step) on the fresh optimizer, then training:
        # one process's training from a fresh optimizer, bit for bit, so it changed nothing.
        get_state_dict(model, optimizer)
        assert all(s["step"].item() == 0 for s in optimizer.state.values()), "the initialisation counted a step"
        for step in range(SAVED_AT):
            step_on(model, optimizer, step)
        model_state, optim_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=f"{directory}/{name(dtype, precision)}")
        full = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save(full, f"{directory}/{name(dtype, precision)}.full.pt")


def _resume(rank: int, world_size: int, directory: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for dtype, precision in SETTINGS:
        model = sharded_model(dtype)
        optimizer = CPUAdam(model.parameters(), **options(dtype, precision))
        model_state, optim_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optim": optim_state}
        dcp.load(loaded, checkpoint_id=f"{directory}/{name(dtype, precision)}")
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        for step in range(SAVED_AT, STEPS):
            step_on(model, optimizer, step)
        assert_as_one_process(model, optimizer, dtype, precision, rank, world_size)
    if world_size == 4:
        _resume_from_full(rank, world_size, directory)
    _refuses(rank, directory)


def _resume_from_full(rank: int, world_size: int, directory: str) -> None:
    """The full state dict saved on 2 ranks, loaded on 4 by set_state_dict (full_state_dict=True: each
    rank takes its shards of the whole tensors), goes on as one process too."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    for dtype, precision in SETTINGS:
        model = sharded_model(dtype)
        optimizer = CPUAdam(model.parameters(), **options(dtype, precision))
        full = torch.load(f"{directory}/{name(dtype, precision)}.full.pt", weights_only=False)
        whole = StateDictOptions(full_state_dict=True)
        set_state_dict(model, optimizer, model_state_dict=full[0], optim_state_dict=full[1], options=whole)
        for step in range(SAVED_AT, STEPS):
            step_on(model, optimizer, step)
        assert_as_one_process(model, optimizer, dtype, precision, rank, world_size)


def _refuses(rank: int, directory: str) -> None:
    """A checkpoint of another precision or of other shapes is refused, and the optimizer that refused
    it steps on as if nothing had happened."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    for dtype, precision, other in ((torch.float32, "bf16", "fp32"), (torch.float32, "8bit", "fp32")):
        model = sharded_model(dtype)
        optimizer = CPUAdam(model.parameters(), **options(dtype, precision))
        model_state, optim_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optim": optim_state}
        try:
            dcp.load(loaded, checkpoint_id=f"{directory}/{name(dtype, other)}")
            set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            refusal = str(error)
        else:
            raise AssertionError(f"{name(dtype, precision)}: a {other} checkpoint was not refused")
        assert "state_precision='fp32'" in refusal or "exp_avg_block_exponent" in refusal, refusal
    # A damaged 8-bit state (an exponent no scale has) is refused by set_state_dict, which changes nothing.
    model = sharded_model(torch.float32)
    optimizer = CPUAdam(model.parameters(), **options(torch.float32, "8bit"))
    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=f"{directory}/{name(torch.float32, '8bit')}")
    before = {k: v.full_tensor() if hasattr(v, "full_tensor") else v.clone() for k, v in _flat(optimizer).items()}
    damaged = next(s for s in loaded["optim"]["state"].values() if s["exp_avg"].to_local().numel())
    damaged["exp_avg_block_exponent"].to_local().view(-1)[0] = -120
    try:
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    except ValueError as error:
        assert "damaged" in str(error), error
    else:
        raise AssertionError("a damaged 8-bit state was loaded")
    after = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in _flat(optimizer).items()}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    wider = nn.Sequential(nn.Linear(12, 34))
    optimizer = CPUAdam(wider.parameters())
    wider(torch.ones(1, 12)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="shape"):
        optimizer.load_state_dict(_full_state(f"{directory}/float32-fp32.full.pt", wider, ids_only=True))


def assert_8bit_as_one_process(state: dict, reference: dict, rows: int, row_size: int) -> None:
    """Loaded in one process from the 2-rank checkpoint: the codes of one process's run in the blocks
    no boundary cut at 2 ranks; in the cut ones, re-encoded from two scales into one, values within a
    quarter of the block's largest of one process's (a code step is at most an eighth of it)."""
    numel = rows * row_size
    uncut = ~cut_elements(numel, row_size, rows, SAVED_AT)
    for key in ("exp_avg", "exp_avg_sq"):
        assert_bitwise(state[key].reshape(-1)[uncut], reference[key].reshape(-1)[uncut], f"8-bit {key} codes")
    ours = quant8.dequantize_moments(state["exp_avg"], state["exp_avg_sq"], state["state_scales"])
    theirs = quant8.dequantize_moments(reference["exp_avg"], reference["exp_avg_sq"], reference["state_scales"])
    for mine, expected in ((ours[0], theirs[0]), (ours[1].sqrt(), theirs[1].sqrt())):
        padded = torch.zeros(quant8.blocks(numel) * quant8.BLOCK)
        padded[:numel] = expected.reshape(-1)
        largest = padded.view(-1, quant8.BLOCK).abs().amax(dim=1).repeat_interleave(quant8.BLOCK)[:numel]
        assert ((mine.reshape(-1) - expected.reshape(-1)).abs() <= 0.25 * largest).all()


def _flat(optimizer: CPUAdam) -> dict[str, Tensor]:
    return {f"{i}.{k}": v for i, state in enumerate(optimizer.state.values()) for k, v in state.items()}


def _full_state(path: str, model: nn.Module, ids_only: bool = False) -> dict:
    """A full optimizer state dict of torch.distributed.checkpoint (params named by their FQNs) keyed by
    index, as ``Optimizer.load_state_dict`` takes it."""
    saved = torch.load(path, weights_only=False)[1]
    names = [n for g in saved["param_groups"] for n in g["params"]]
    index = {n: i for i, n in enumerate(names)}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in saved["param_groups"]]
    return {"state": {index[n]: s for n, s in saved["state"].items()}, "param_groups": groups}


def test_fsdp2_checkpoints_reshard(tmp_path: Path) -> None:
    directory = str(tmp_path)
    run_ranks(_save, directory, world_size=SAVED_AT, timeout_s=180.0)
    for world_size in (4, 1):
        run_ranks(_resume, directory, world_size=world_size, timeout_s=240.0)
    for dtype, precision in SETTINGS:  # the full state dict, in one process
        whole, reference = one_process(dtype, precision, SAVED_AT)
        model = plain_model(dtype)
        model.load_state_dict(torch.load(f"{directory}/{name(dtype, precision)}.full.pt", weights_only=False)[0])
        optimizer = CPUAdam(model.parameters(), **options(dtype, precision))
        optimizer.load_state_dict(_full_state(f"{directory}/{name(dtype, precision)}.full.pt", model))
        for p, q in zip(model.parameters(), whole.parameters()):
            assert_bitwise(p.detach(), q.detach(), f"{name(dtype, precision)} full state dict: weights")
            if precision == "8bit":  # one process's codes where no boundary cut a block, its values elsewhere
                assert_8bit_as_one_process(optimizer.state[p], reference.state[q], q.shape[0], q[0].numel())
                continue
            for key in ("exp_avg", "exp_avg_sq", "step"):  # one process's state, bit for bit
                assert_bitwise(optimizer.state[p][key], reference.state[q][key], f"full state dict: {key}")
        if dtype == torch.float32 and precision != "8bit":  # and torch's AdamW takes it
            adamw = torch.optim.AdamW(model.parameters(), **HYPER)
            adamw.load_state_dict(_full_state(f"{directory}/{name(dtype, precision)}.full.pt", model))
            for p, q in zip(model.parameters(), whole.parameters()):
                for key in ("exp_avg", "exp_avg_sq"):
                    expected = reference.state[q][key].float()
                    assert_bitwise(adamw.state[p][key], expected, f"AdamW from {precision} moments: {key}")
