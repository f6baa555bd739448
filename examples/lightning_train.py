"""Lightning with the offload optimizer: configure_optimizers, gradient_clip_val, bf16-true.

python examples/lightning_train.py                  # a GPU if there is one, else the CPU
python examples/lightning_train.py --resume         # fit from the last checkpoint
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as L
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from cpu_adam import OffloadOptimizer


class CountingGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = GPT2Config(
            n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, tokens: torch.Tensor, index: int) -> torch.Tensor:
        loss = self.model(input_ids=tokens, labels=tokens).loss
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> OffloadOptimizer:
        # precision="bf16-true" has made the weights bf16 on the device by now
        return OffloadOptimizer(self.model.parameters(), lr=1e-3, weight_decay=0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--out", default="lightning_run")
    parser.add_argument("--resume", action="store_true", help="fit from the last checkpoint in --out")
    args = parser.parse_args()

    start = torch.randint(256, (256, 1), generator=torch.Generator().manual_seed(0))
    tokens = (start + torch.arange(64)) % 256  # learnable: next = current + 1
    trainer = L.Trainer(
        max_epochs=args.epochs,
        accelerator="auto",
        devices=1,
        precision="bf16-true",
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,  # clips for real: the optimizer answers the norm of its host grads
        default_root_dir=args.out,
        callbacks=[L.callbacks.ModelCheckpoint(dirpath=f"{args.out}/checkpoints", save_last=True)],
        logger=False,
        enable_progress_bar=False,
    )
    last = Path(args.out) / "checkpoints" / "last.ckpt"
    trainer.fit(
        CountingGPT(), torch.utils.data.DataLoader(tokens, batch_size=8), ckpt_path=last if args.resume else None
    )
    print(f"final loss {float(trainer.callback_metrics['loss']):.3f}")


if __name__ == "__main__":
    main()
