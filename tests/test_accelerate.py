"""accelerate (the real library) driving CPUAdam and OffloadOptimizer on the CPU.

What a training script does with it: ``prepare``, ``accumulate``, ``backward``,
``clip_grad_norm_`` and ``save_state``/``load_state`` (safetensors, the default).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from example_scripts import run_and_resume
from tiny_gpt2 import tiny_gpt2, token_batches

from cpu_adam import CPUAdam, OffloadOptimizer

ACCUMULATION = 2
MAX_NORM = 0.05  # below the tiny model's grad norms: every step is clipped
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _offload(model: torch.nn.Module, **options) -> OffloadOptimizer:
    return OffloadOptimizer(model.parameters(), **HYPER, bucket_size=4096, **options)


def _cpu_adam(model: torch.nn.Module, **options) -> CPUAdam:
    return CPUAdam(model.parameters(), **HYPER, **options)


KINDS = {"offload": (_offload, torch.bfloat16), "cpu_adam": (_cpu_adam, torch.float32)}
EIGHT_BIT = {  # only resuming is asked of them here: the rest of the path is the float states'
    "offload-8bit": (partial(_offload, state_precision="8bit"), torch.bfloat16),
    "cpu_adam-8bit": (partial(_cpu_adam, state_precision="8bit"), torch.float32),
}


def _fresh_accelerator() -> Accelerator:
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)


def _with_accelerate(accelerator: Accelerator, model, opt, data: list[torch.Tensor], scheduler=None) -> list[float]:
    """accelerate's loop: accumulate, backward, clip_grad_norm_, step, the scheduler's step (if any), zero_grad."""
    norms = []
    for tokens in data:
        with accelerator.accumulate(model):
            accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)))
            opt.step()
            if scheduler is not None:
                scheduler.step()
            opt.zero_grad()
    return norms


def _by_hand(model, opt, data: list[torch.Tensor], clip: Callable[[], float] | None) -> list[float]:
    norms = []
    for start in range(0, len(data), ACCUMULATION):
        for tokens in data[start : start + ACCUMULATION]:
            (model(input_ids=tokens, labels=tokens).loss / ACCUMULATION).backward()
        if clip is not None:
            norms.append(clip())
        opt.step()
        opt.zero_grad()
    return norms


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_prepare_accumulate_clip_trains_as_the_optimizer_does_by_hand(kind: str):
    build, dtype = KINDS[kind]
    data = token_batches(3 * ACCUMULATION)
    accelerator = _fresh_accelerator()
    model = tiny_gpt2(0, dtype)
    model, opt = accelerator.prepare(model, build(model))
    norms = _with_accelerate(accelerator, model, opt, data)

    unclipped = tiny_gpt2(0, dtype)
    unclipped_opt = build(unclipped)
    _by_hand(unclipped, unclipped_opt, data, clip=None)
    reference = tiny_gpt2(0, dtype)
    if kind == "offload":  # the optimizer's own clipping, tested against torch AdamW elsewhere
        ref_opt = build(reference, max_grad_norm=MAX_NORM)
        _by_hand(reference, ref_opt, data, clip=None)
        expected_norms = None
    else:
        ref_opt = build(reference)
        expected_norms = _by_hand(
            reference, ref_opt, data, lambda: float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM))
        )
    assert len(norms) == 3 and min(norms) > 2 * MAX_NORM
    if expected_norms is not None:
        assert norms == expected_norms
    for mine, ref in zip(model.parameters(), reference.parameters()):
        # bf16 weights: a clipping coefficient rounded otherwise may flip a last bit
        torch.testing.assert_close(mine, ref, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(_exp_avgs(opt), _exp_avgs(ref_opt), rtol=1e-5, atol=1e-9)
    # Adam's update barely depends on the grads' scale; the first moment shows the clipping.
    assert _exp_avgs(opt).abs().max() < 0.5 * _exp_avgs(unclipped_opt).abs().max(), "nothing was clipped"


def _exp_avgs(opt) -> torch.Tensor:
    state = opt.state_dict()["state"]
    return torch.cat([s["exp_avg"].float().reshape(-1) for s in state.values()])


def _opt_state(opt) -> list[torch.Tensor]:
    state = opt.state_dict()["state"]
    return [v for s in state.values() for k, v in sorted(s.items()) if torch.is_tensor(v)]


@pytest.mark.parametrize("kind", sorted(KINDS | EIGHT_BIT))
def test_save_state_and_load_state_resume_exactly(kind: str, tmp_path: Path):
    build, dtype = (KINDS | EIGHT_BIT)[kind]
    data = token_batches(4 * ACCUMULATION)
    half = len(data) // 2

    accelerator = _fresh_accelerator()
    model = tiny_gpt2(0, dtype)
    model, opt = accelerator.prepare(model, build(model))
    _with_accelerate(accelerator, model, opt, data[:half])
    accelerator.save_state(str(tmp_path / "state"))  # safetensors for the model: the default
    _with_accelerate(accelerator, model, opt, data[half:])
    straight = [p.detach().clone() for p in model.parameters()], _opt_state(opt)

    accelerator = _fresh_accelerator()
    model = tiny_gpt2(7, dtype)  # other weights: everything must come from the saved state
    model, opt = accelerator.prepare(model, build(model))
    accelerator.load_state(str(tmp_path / "state"))
    _with_accelerate(accelerator, model, opt, data[half:])
    assert all(torch.equal(a, b) for a, b in zip(straight[0], model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(straight[1], _opt_state(opt)))


def test_the_example_runs_and_resumes(tmp_path: Path):
    run_and_resume("accelerate_train.py", tmp_path / "run", ["--steps", "4"], ["--steps", "4"])
