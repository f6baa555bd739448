"""accelerate with the offload optimizer: prepare, accumulate, clip, save_state / load_state.

python examples/accelerate_train.py                 # a GPU if there is one, else the CPU
python examples/accelerate_train.py --resume        # continue from the saved state
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

from cpu_adam import OffloadOptimizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="accelerate_run")
    parser.add_argument("--resume", action="store_true", help="load the state saved in --out first")
    args = parser.parse_args()

    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=not torch.cuda.is_available())
    config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=256, n_positions=64, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(device=accelerator.device, dtype=torch.bfloat16)
    optimizer = OffloadOptimizer(model.parameters(), lr=1e-3, weight_decay=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    if args.resume:
        accelerator.load_state(args.out)  # model (safetensors), optimizer state, RNG states

    generator = torch.Generator().manual_seed(accelerator.process_index)
    for step in range(args.steps * accelerator.gradient_accumulation_steps):
        start = torch.randint(256, (8, 1), generator=generator)
        tokens = ((start + torch.arange(64)) % 256).to(accelerator.device)  # learnable: next = current + 1
        with accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)  # clips for real, returns the norm
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients and (step + 1) % 20 == 0:
            accelerator.print(f"step {(step + 1) // 2}: loss {loss.item():.3f}, grad norm {float(norm):.3f}")
    Path(args.out).mkdir(exist_ok=True)
    accelerator.save_state(args.out)


if __name__ == "__main__":
    main()
