"""accelerate's FSDP2 plugin with CPU offload (the real library) and CPUAdam, 2 gloo ranks.

What an accelerate user configures for a model larger than the GPU: ``FullyShardedDataParallelPlugin
(fsdp_version=2, cpu_offload=True)``, the optimizer built on the model before ``prepare`` (which
moves it onto the DTensor shards), then ``accumulate``, ``backward``, ``clip_grad_norm_`` (the
global norm over the CPU shards, all-reduced on gloo) and ``save_state`` / ``load_state`` (DCP). With the step behind
the forward (``step_behind_forward`` on the prepared model and the CPUAdam inside the prepared optimizer) the same
loop, with an LR scheduler, trains and resumes bit for bit as the serial one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from accelerate_fsdp2_cpu import as_beside_gpus, cpu_offload_plugin
from behind_setup import slow_units
from rank_spawn import run_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from test_accelerate import ACCUMULATION, HYPER, MAX_NORM
from test_accelerate import _with_accelerate as train  # one process's loop: accumulate, clip, step
from tiny_gpt2 import tiny_gpt2, token_batches

from cpu_adam import CPUAdam
from cpu_adam.fsdp2 import step_behind_forward

pytestmark = [pytest.mark.dist, pytest.mark.slow]

Build = Callable[[torch.nn.Module], torch.optim.Optimizer]
UNITS = ["the root", "'transformer.wte'", "'transformer.h.0'", "'transformer.h.1'"]  # accelerate's FSDP2 units


def fsdp2_accelerator():
    """A fresh Accelerator with the FSDP2 plugin offloading to the CPU."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plugin = cpu_offload_plugin(
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPT2Block"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, gradient_accumulation_steps=ACCUMULATION)
    as_beside_gpus(accelerator, plugin)  # see accelerate_fsdp2_cpu.py: accelerate's FSDP2 path from here on
    return accelerator


def prepared(seed: int, build: Build):
    """A fresh FSDP2 Accelerator, and the prepared model and optimizer."""
    accelerator = fsdp2_accelerator()
    model = tiny_gpt2(seed)
    model, optimizer = accelerator.prepare(model, build(model))
    return accelerator, model, optimizer


def shards(model, optimizer) -> list[torch.Tensor]:
    state = optimizer.optimizer.state
    out = []
    for p in model.parameters():
        out.append(p.to_local())
        out += [state[p][key].to_local() for key in ("exp_avg", "exp_avg_sq")] + [state[p]["step"]]
    return out


def _trains_as_torch_adamw_and_resumes(rank: int, world_size: int, folder: str) -> None:
    from torch.distributed.tensor import DTensor

    data = token_batches(4 * ACCUMULATION, seed=1 + rank)
    half = len(data) // 2

    accelerator, model, optimizer = prepared(0, lambda m: CPUAdam(m.parameters(), **HYPER))
    params = optimizer.optimizer.param_groups[0]["params"]
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params), "not on the CPU shards"
    norms = train(accelerator, model, optimizer, data[:half])
    accelerator.save_state(folder)
    norms += train(accelerator, model, optimizer, data[half:])
    straight = shards(model, optimizer)

    reference = prepared(0, lambda m: torch.optim.AdamW(m.parameters(), **HYPER, foreach=False))
    expected_norms = train(*reference, data)
    # The first step's grads are the same bits; later ones differ by the optimizers' rounding.
    assert norms[0] == expected_norms[0] and min(norms) > 2 * MAX_NORM
    torch.testing.assert_close(norms, expected_norms, rtol=1e-4, atol=0)
    for mine, theirs in zip(straight, shards(*reference[1:]), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)

    accelerator, model, optimizer = prepared(7, lambda m: CPUAdam(m.parameters(), **HYPER))  # other weights
    accelerator.load_state(folder)
    train(accelerator, model, optimizer, data[half:])
    for mine, theirs in zip(shards(model, optimizer), straight, strict=True):
        assert torch.equal(mine, theirs), f"rank {rank}: the resumed run differs from the straight one"


def test_fsdp2_plugin_with_cpu_offload_steps_clips_and_resumes_cpu_adam(tmp_path: Path) -> None:
    run_ranks(_trains_as_torch_adamw_and_resumes, str(tmp_path / "state"), timeout_s=180)


def prepared_with_a_schedule(seed: int):
    """A fresh FSDP2 Accelerator, and the prepared model, CPUAdam and LR scheduler."""
    accelerator = fsdp2_accelerator()
    model = tiny_gpt2(seed)
    optimizer = CPUAdam(model.parameters(), **HYPER)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
    return accelerator, *accelerator.prepare(model, optimizer, scheduler)


def _behind_forward_trains_and_resumes_as_the_serial_step(rank: int, world_size: int, folder: str) -> None:
    data = token_batches(4 * ACCUMULATION, seed=1 + rank)
    half = len(data) // 2
    serial = prepared_with_a_schedule(0)
    accelerator, model, optimizer, scheduler = serial
    expected_norms = train(accelerator, model, optimizer, data, scheduler)
    expected = shards(*serial[1:3])

    accelerator, model, optimizer, scheduler = prepared_with_a_schedule(0)
    handle = step_behind_forward(model, optimizer.optimizer)  # prepare returns the FSDP2 model, CPUAdam wrapped
    with slow_units(0.02):  # each unit's step lags: what does not wait for it would read the old values
        norms = train(accelerator, model, optimizer, data[:half], scheduler)
        accelerator.save_state(folder)  # right after a step()
        norms += train(accelerator, model, optimizer, data[half:], scheduler)
        straight = shards(model, optimizer)
    assert list(handle.unit_seconds) == UNITS  # the last step was queued unit by unit, in the forward's order
    handle.remove()
    assert norms == expected_norms
    for mine, theirs in zip(straight, expected, strict=True):
        assert torch.equal(mine, theirs), f"rank {rank}: behind the forward differs from the serial step"

    accelerator, model, optimizer, scheduler = prepared_with_a_schedule(7)  # other weights
    handle = step_behind_forward(model, optimizer.optimizer)
    accelerator.load_state(folder)
    with slow_units(0.02):
        train(accelerator, model, optimizer, data[half:], scheduler)
        resumed = shards(model, optimizer)
    handle.remove()
    assert scheduler.get_last_lr() == serial[3].get_last_lr()
    for mine, theirs in zip(resumed, expected, strict=True):
        assert torch.equal(mine, theirs), f"rank {rank}: the resumed run differs from the serial one"


def test_the_step_behind_the_forward_trains_and_resumes_as_the_serial_step_with_accelerate(tmp_path: Path) -> None:
    run_ranks(_behind_forward_trains_and_resumes_as_the_serial_step, str(tmp_path / "state"), timeout_s=180)
