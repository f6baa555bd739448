"""HF Trainer with the offload optimizer: bf16 weights on the GPU, the rest in host RAM.

    python examples/hf_trainer.py                       # a GPU if there is one, else the CPU
    python examples/hf_trainer.py --resume              # continue from the last checkpoint

Trainer's own clipping (max_grad_norm, on by default) clips for real and logs the real
grad_norm: the optimizer answers the norm of the grads it took to host memory. Checkpoints
(save_steps) hold the model as safetensors and the optimizer's state, and resume exactly.
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from cpu_adam import OffloadOptimizer


class Counting(torch.utils.data.Dataset):
    """Learnable token sequences: each token is the previous one plus one."""

    def __init__(self, count: int, vocab: int, length: int) -> None:
        start = torch.randint(vocab, (count, 1), generator=torch.Generator().manual_seed(0))
        self.tokens = (start + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="hf_trainer_run")
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    args = parser.parse_args()

    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPT2LMHeadModel(config).to(device=device, dtype=torch.bfloat16)  # the optimizer trains bf16 weights
    optimizer = OffloadOptimizer(model.parameters(), lr=1e-3, weight_decay=0.01)

    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=2,  # summed in fp32 on the host
        max_grad_norm=1.0,  # Trainer's clipping works as with any optimizer
        lr_scheduler_type="cosine",
        warmup_steps=4,
        logging_steps=10,
        save_steps=max(1, args.steps // 2),
        report_to="none",
        use_cpu=device == "cpu",
    )
    trainer = Trainer(model=model, args=training, train_dataset=Counting(512, 256, 64), optimizers=(optimizer, None))
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    trainer.save_model(f"{args.out}/final")  # safetensors; loads back with GPT2LMHeadModel.from_pretrained
    print(f"mean loss {result.training_loss:.3f}, last grad norm {optimizer.last_grad_norm:.3f}")


if __name__ == "__main__":
    main()
