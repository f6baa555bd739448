"""accelerate's FSDP2 plugin with CPU offload (the real library) and CPUAdam, 2 gloo ranks.

What an accelerate user configures for a model larger than the GPU: ``FullyShardedDataParallelPlugin
(fsdp_version=2, cpu_offload=True)``, the optimizer built on the model before ``prepare`` (which
moves it onto the DTensor shards), then ``accumulate``, ``backward``, ``clip_grad_norm_`` (the
global norm over the CPU shards, all-reduced on gloo) and ``save_state`` / ``load_state`` (DCP).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from accelerate_fsdp2_cpu import as_beside_gpus, cpu_offload_plugin
from rank_spawn import run_ranks

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from test_accelerate import ACCUMULATION, HYPER, MAX_NORM
from test_accelerate import _with_accelerate as train  # one process's loop: accumulate, clip, step
from tiny_gpt2 import tiny_gpt2, token_batches

from cpu_adam import CPUAdam

pytestmark = [pytest.mark.dist, pytest.mark.slow]

Build = Callable[[torch.nn.Module], torch.optim.Optimizer]


def prepared(seed: int, build: Build):
    """A fresh Accelerator with the FSDP2 plugin offloading to the CPU, and the prepared model and optimizer."""
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
    model = tiny_gpt2(seed)
    model, optimizer = accelerator.prepare(model, build(model))
    return accelerator, model, optimizer


def shards(model, optimizer) -> list[torch.Tensor]:
    state = optimizer.optimizer.state
    out = []
    for p in model.parameters():
        out.append(p.to_local())
        out += [state[p][key].to_local() for key in ("exp_avg", "exp_avg_sq")]
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
