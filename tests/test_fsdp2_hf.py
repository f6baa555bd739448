"""HF Trainer with FSDP2 and CPU offload (the real libraries) stepping CPUAdam, 2 gloo ranks.

What a Trainer user sets for a model larger than the GPU: ``fsdp="full_shard offload auto_wrap"``
with ``fsdp_config={"version": 2, ...}``, and CPUAdam by ``optimizer_cls_and_kwargs`` (Trainer
builds it after wrapping, over the CPU DTensor shards, with its decay / no-decay groups). Trainer's
clipping, gradient accumulation, LR schedule and ``save_steps`` checkpoints (DCP, sharded) with
``resume_from_checkpoint`` run as they do beside GPUs. With the step behind the forward (a TrainerCallback turning
``step_behind_forward`` on at the start of training) the same training and resuming are bit for bit the serial one's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate_fsdp2_cpu import as_beside_gpus, cpu_offload_plugin
from behind_setup import slow_units
from rank_spawn import run_ranks

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_hf_trainer import HYPER, STEPS, _args, _logged_norms
from tiny_gpt2 import TokenDataset, tiny_gpt2
from transformers import Trainer, TrainerCallback

from cpu_adam import CPUAdam
from cpu_adam.fsdp2 import step_behind_forward

pytestmark = [pytest.mark.dist, pytest.mark.slow]

FSDP2 = {
    "fsdp": "full_shard offload auto_wrap",
    "fsdp_config": {
        "version": 2,
        "transformer_layer_cls_to_wrap": ["GPT2Block"],
        "state_dict_type": "SHARDED_STATE_DICT",
    },
}
KWARGS = {k: v for k, v in HYPER.items() if k != "weight_decay"}  # Trainer's weight_decay, per group
UNITS = ["the root", "'transformer.wte'", "'transformer.h.0'", "'transformer.h.1'"]  # accelerate's FSDP2 units


class CPUGroupTrainer(Trainer):
    """Trainer, with accelerate given the FSDP2 state it sets up beside GPUs (accelerate_fsdp2_cpu.py)."""

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        options = {k: v for k, v in self.args.fsdp_plugin_args.items() if k not in ("fsdp_version", "cpu_offload")}
        as_beside_gpus(self.accelerator, cpu_offload_plugin(**options))
        self.is_fsdp_enabled = True


class StepBehindForward(TrainerCallback):
    """CPUAdam's steps behind the next forward while Trainer trains: on once Trainer has sharded the model and
    accelerate has wrapped the optimizer, off at the end."""

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        self.handle = step_behind_forward(model, optimizer.optimizer)

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.handle.remove()


def train(
    folder: Path,
    seed: int,
    optimizer: type,
    resume: str | None = None,
    callbacks: list[TrainerCallback] | None = None,
    **options: Any,
) -> Trainer:
    args = _args(folder, gradient_accumulation_steps=2, **FSDP2, **options)
    trainer = CPUGroupTrainer(
        model=tiny_gpt2(seed),
        args=args,
        train_dataset=TokenDataset(64),
        optimizer_cls_and_kwargs=(optimizer, KWARGS),
        callbacks=callbacks,
    )
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def shards(trainer: Trainer) -> list[torch.Tensor]:
    state = trainer.optimizer.optimizer.state
    out = []
    for p in trainer.model.parameters():
        out.append(p.to_local())
        out += [state[p][key].to_local() for key in ("exp_avg", "exp_avg_sq")] + [state[p]["step"]]
    return out


def _trains_as_torch_adamw_and_resumes(rank: int, world_size: int, folder: str) -> None:
    from torch.distributed.tensor import DTensor

    run = Path(folder)
    straight = train(run / "run", 0, CPUAdam, save_strategy="steps", save_steps=2)
    inner = straight.optimizer.optimizer
    assert type(inner) is CPUAdam and len(inner.param_groups) == 2  # decay / no decay
    params = [p for g in inner.param_groups for p in g["params"]]
    assert all(isinstance(p, DTensor) and p.device.type == "cpu" for p in params), "not on the CPU shards"

    reference = train(run / "torch", 0, torch.optim.AdamW)
    norms, expected = _logged_norms(straight), _logged_norms(reference)
    assert len(norms) == STEPS and norms[0] == expected[0]  # the same first grads, bit for bit
    torch.testing.assert_close(norms, expected, rtol=1e-4, atol=0)
    for mine, theirs in zip(shards(straight), shards(reference), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-6)

    resumed = train(run / "run", 7, CPUAdam, resume=str(run / "run" / "checkpoint-2"))  # other weights
    for mine, theirs in zip(shards(resumed), shards(straight), strict=True):
        assert torch.equal(mine, theirs), f"rank {rank}: the resumed run differs from the straight one"


def test_trainer_with_fsdp2_cpu_offload_steps_and_resumes_cpu_adam(tmp_path: Path) -> None:
    run_ranks(_trains_as_torch_adamw_and_resumes, str(tmp_path), timeout_s=240)


def _logged_losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _behind_forward_trains_and_resumes_as_the_serial_step(rank: int, world_size: int, folder: str) -> None:
    run = Path(folder)
    serial = train(run / "serial", 0, CPUAdam)
    behind = StepBehindForward()
    with slow_units(0.02):  # each unit's step lags: what does not wait for it would read the old values
        straight = train(run / "behind", 0, CPUAdam, callbacks=[behind], save_strategy="steps", save_steps=2)
        checkpoint = str(run / "behind" / "checkpoint-2")  # saved right after a step()
        resumed = train(run / "behind", 7, CPUAdam, resume=checkpoint, callbacks=[StepBehindForward()])
    assert list(behind.handle.unit_seconds) == UNITS  # the last step was queued unit by unit, in the forward's order
    assert _logged_norms(straight) == _logged_norms(serial) and _logged_losses(straight) == _logged_losses(serial)
    expected = shards(serial)
    for mine, theirs in zip(shards(straight), expected, strict=True):
        assert torch.equal(mine, theirs), f"rank {rank}: behind the forward differs from the serial step"
    for mine, theirs in zip(shards(resumed), expected, strict=True):
        assert torch.equal(mine, theirs), f"rank {rank}: the resumed run differs from the serial one"


def test_the_step_behind_the_forward_trains_and_resumes_as_the_serial_step_in_trainer(tmp_path: Path) -> None:
    run_ranks(_behind_forward_trains_and_resumes_as_the_serial_step, str(tmp_path), timeout_s=240)
