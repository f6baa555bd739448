"""HF Trainer (the real library) with CPUAdam and OffloadOptimizer, on the CPU.

Trainer's own loop: its clipping (``max_grad_norm``, on by default), logged ``grad_norm``,
gradient accumulation, LR scheduler, ``save_steps`` checkpoints with ``resume_from_checkpoint``
and safetensors weights.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from example_scripts import run_and_resume
from tiny_gpt2 import TokenDataset, tiny_gpt2
from transformers import GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from cpu_adam import CPUAdam, OffloadOptimizer

pytestmark = pytest.mark.slow

STEPS = 4
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)


def _args(out: Path, **options: Any) -> TrainingArguments:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=HYPER["lr"],
        adam_beta1=HYPER["betas"][0],
        adam_beta2=HYPER["betas"][1],
        adam_epsilon=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        lr_scheduler_type="linear",
        warmup_steps=1,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    settings.update(options)
    return TrainingArguments(**settings)


class _OptimizerNorms(TrainerCallback):
    """The norm the offload optimizer took at each of its steps."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs) -> None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
        self.norms.append(inner.last_grad_norm)


def _train(model, args: TrainingArguments, resume: str | None = None, **trainer_options: Any) -> Trainer:
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(64), **trainer_options)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _logged_norms(trainer: Trainer) -> list[float]:
    return [entry["grad_norm"] for entry in trainer.state.log_history if "grad_norm" in entry]


def _exp_avgs(opt) -> torch.Tensor:
    state = opt.state_dict()["state"]
    return torch.cat([s["exp_avg"].float().reshape(-1) for s in state.values()])


@pytest.mark.parametrize("how", ["optimizers", "optimizer_cls_and_kwargs"])
def test_cpu_adam_trains_as_torch_adamw(how: str, tmp_path: Path):
    runs = {}
    for name, cls in (("cpu_adam", CPUAdam), ("torch", torch.optim.AdamW)):
        model = tiny_gpt2(0)
        if how == "optimizers":
            options = {"optimizers": (cls(model.parameters(), **HYPER), None)}
        else:  # Trainer builds it, with its decay / no-decay param groups
            options = {"optimizer_cls_and_kwargs": (cls, {k: v for k, v in HYPER.items() if k != "weight_decay"})}
        trainer = _train(model, _args(tmp_path / name, gradient_accumulation_steps=2), **options)
        runs[name] = model, _logged_norms(trainer)
    (ours, our_norms), (ref, ref_norms) = runs["cpu_adam"], runs["torch"]
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert our_norms == pytest.approx(ref_norms, rel=1e-5) and len(our_norms) == STEPS


def test_offload_optimizer_clips_with_trainer_max_grad_norm_and_logs_the_real_norm(tmp_path: Path):
    max_norm = 0.05  # below the tiny model's grad norms: every step is clipped

    def run(name: str, trainer_max_norm: float, optimizer_max_norm: float | None):
        model = tiny_gpt2(0, torch.bfloat16)
        opt = OffloadOptimizer(model.parameters(), **HYPER, max_grad_norm=optimizer_max_norm, bucket_size=4096)
        seen = _OptimizerNorms()
        args = _args(tmp_path / name, max_grad_norm=trainer_max_norm, gradient_accumulation_steps=2)
        trainer = _train(model, args, optimizers=(opt, None), callbacks=[seen])
        return model, opt, _logged_norms(trainer), seen.norms

    model, opt, logged, _ = run("trainer_clips", max_norm, None)
    ref_model, ref_opt, _, ref_norms = run("optimizer_clips", 0, max_norm)  # the optimizer's own clipping
    _, free_opt, _, _ = run("no_clipping", 0, None)
    assert len(logged) == STEPS and min(logged) > 2 * max_norm
    assert logged == pytest.approx(ref_norms, rel=1e-5)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(_exp_avgs(opt), _exp_avgs(ref_opt), rtol=1e-5, atol=1e-9)
    assert _exp_avgs(opt).abs().max() < 0.5 * _exp_avgs(free_opt).abs().max(), "Trainer's clipping clipped nothing"


def _offload_kind(model):
    return OffloadOptimizer(model.parameters(), **HYPER, bucket_size=4096)


def _cpu_adam_kind(model):
    return CPUAdam(model.parameters(), **HYPER)


def _offload_8bit_kind(model):
    return OffloadOptimizer(model.parameters(), **HYPER, bucket_size=4096, state_precision="8bit")


KINDS = {
    "offload": (_offload_kind, torch.bfloat16),
    "offload-8bit": (_offload_8bit_kind, torch.bfloat16),
    "cpu_adam": (_cpu_adam_kind, torch.float32),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_resume_from_checkpoint_is_exact_and_weights_load_back(kind: str, tmp_path: Path):
    build, dtype = KINDS[kind]
    args = _args(tmp_path / "run", save_strategy="steps", save_steps=2, gradient_accumulation_steps=2)
    straight = tiny_gpt2(0, dtype)
    straight_opt = build(straight)
    trainer = _train(straight, args, optimizers=(straight_opt, None))

    resumed = tiny_gpt2(7, dtype)  # other weights: everything must come from the checkpoint
    resumed_opt = build(resumed)
    _train(resumed, args, resume=str(tmp_path / "run" / "checkpoint-2"), optimizers=(resumed_opt, None))
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    mine, ref = straight_opt.state_dict()["state"], resumed_opt.state_dict()["state"]
    for key in mine:
        for name in ("master", "exp_avg", "exp_avg_sq", "state_scales"):
            if name in mine[key] or name in ref[key]:
                assert torch.equal(mine[key][name], ref[key][name]), name

    trainer.save_model(str(tmp_path / "final"))  # safetensors
    loaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "final"), dtype=dtype)
    assert all(torch.equal(a, b) for a, b in zip(straight.state_dict().values(), loaded.state_dict().values()))


def test_offload_optimizer_built_by_trainer_gets_its_param_groups(tmp_path: Path):
    # optimizer_cls_and_kwargs: Trainer builds the optimizer over its decay / no-decay groups.
    kwargs = {k: v for k, v in HYPER.items() if k != "weight_decay"} | {"bucket_size": 4096}
    built = tiny_gpt2(0, torch.bfloat16)
    trainer = _train(built, _args(tmp_path / "built"), optimizer_cls_and_kwargs=(OffloadOptimizer, kwargs))
    groups = trainer.optimizer.param_groups
    assert sorted(g["weight_decay"] for g in groups) == [0.0, HYPER["weight_decay"]]

    by_hand = tiny_gpt2(0, torch.bfloat16)
    decay = set(trainer.get_decay_parameter_names(by_hand))
    named = [(n, p) for n, p in by_hand.named_parameters() if p.requires_grad]
    hand_groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": HYPER["weight_decay"]},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    _train(by_hand, _args(tmp_path / "by_hand"), optimizers=(OffloadOptimizer(hand_groups, **kwargs), None))
    assert all(torch.equal(a, b) for a, b in zip(built.parameters(), by_hand.parameters()))


def test_the_example_runs_and_resumes(tmp_path: Path):
    run_and_resume("hf_trainer.py", tmp_path / "run", ["--steps", "4"], ["--steps", "4"])
