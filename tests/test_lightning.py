"""Lightning (the real library) with CPUAdam and OffloadOptimizer, on the CPU.

``configure_optimizers`` returning either optimizer, ``accumulate_grad_batches``,
``gradient_clip_val``, ``precision="bf16-true"`` and ``fit(ckpt_path=...)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning.pytorch")
pytest.importorskip("transformers")

from example_scripts import run_and_resume  # noqa: E402
from tiny_gpt2 import tiny_gpt2, token_batches  # noqa: E402

from cpu_adam import CPUAdam, OffloadOptimizer  # noqa: E402

pytestmark = pytest.mark.slow

HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
ACCUMULATION = 2
BATCHES_PER_EPOCH = 4  # two optimizer steps per epoch


class TinyGPT(L.LightningModule):
    def __init__(self, kind: str, seed: int = 0, **optimizer_options: Any) -> None:
        super().__init__()
        self.kind = kind
        self.model = tiny_gpt2(seed)  # fp32: precision="bf16-true" converts it for the offload optimizer
        self.optimizer_options = optimizer_options
        self.optimizer: Any = None

    def training_step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = self.model.parameters()
        if self.kind == "offload":
            self.optimizer = OffloadOptimizer(params, **HYPER, bucket_size=4096, **self.optimizer_options)
        elif self.kind == "cpu_adam":
            self.optimizer = CPUAdam(params, **HYPER)
        else:
            self.optimizer = torch.optim.AdamW(params, **HYPER)
        return self.optimizer


def _fit(module: TinyGPT, out: Path, epochs: int = 2, ckpt_path: str | None = None, **options: Any) -> L.Trainer:
    settings = dict(
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=ACCUMULATION,
        precision="bf16-true" if module.kind == "offload" else "32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(out),
    )
    settings.update(options)
    trainer = L.Trainer(**settings)
    data = torch.utils.data.DataLoader(torch.cat(token_batches(BATCHES_PER_EPOCH)), batch_size=4)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer


def _exp_avgs(opt) -> torch.Tensor:
    state = opt.state_dict()["state"]
    return torch.cat([s["exp_avg"].float().reshape(-1) for s in state.values()])


def test_cpu_adam_trains_as_torch_adamw(tmp_path: Path):
    ours, ref = TinyGPT("cpu_adam"), TinyGPT("torch")
    for module in (ours, ref):
        _fit(module, tmp_path, gradient_clip_val=0.05)
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_gradient_clip_val_clips_the_offload_optimizer_for_real(tmp_path: Path):
    max_norm = 0.05  # below the tiny model's grad norms: every step is clipped
    clipped = TinyGPT("offload")
    _fit(clipped, tmp_path, gradient_clip_val=max_norm)
    reference = TinyGPT("offload", max_grad_norm=max_norm)  # the optimizer's own clipping
    _fit(reference, tmp_path)
    free = TinyGPT("offload")
    _fit(free, tmp_path)
    assert next(clipped.parameters()).dtype == torch.bfloat16
    assert reference.optimizer.last_grad_norm > 2 * max_norm
    assert clipped.optimizer.last_grad_norm == pytest.approx(reference.optimizer.last_grad_norm, rel=1e-5)
    for a, b in zip(clipped.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-6)
    torch.testing.assert_close(_exp_avgs(clipped.optimizer), _exp_avgs(reference.optimizer), rtol=1e-5, atol=1e-9)
    assert _exp_avgs(clipped.optimizer).abs().max() < 0.5 * _exp_avgs(free.optimizer).abs().max()


@pytest.mark.parametrize("kind", ["offload", "cpu_adam"])
def test_fit_from_a_checkpoint_resumes_exactly(kind: str, tmp_path: Path):
    straight = TinyGPT(kind)
    checkpoint = L.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_top_k=-1)
    _fit(straight, tmp_path, enable_checkpointing=True, callbacks=[checkpoint], gradient_clip_val=0.05)
    first_epoch = sorted((tmp_path / "ckpt").glob("epoch=0*.ckpt"))
    assert len(first_epoch) == 1

    resumed = TinyGPT(kind, seed=7)  # other weights: everything must come from the checkpoint
    _fit(resumed, tmp_path, ckpt_path=str(first_epoch[0]), gradient_clip_val=0.05)
    assert all(torch.equal(a, b) for a, b in zip(straight.parameters(), resumed.parameters()))
    mine, ref = straight.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    for key in mine:
        for name in ("master", "exp_avg", "exp_avg_sq"):
            if name in mine[key] or name in ref[key]:
                assert torch.equal(mine[key][name], ref[key][name]), name


def test_the_example_runs_and_resumes(tmp_path: Path):
    run_and_resume("lightning_train.py", tmp_path / "run", ["--epochs", "1"], ["--epochs", "2"])
