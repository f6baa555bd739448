"""Data-parallel training with OffloadOptimizer sharded over the ranks (ZeRO), under plain torchrun.

    torchrun --standalone --nproc-per-node 2 examples/train_zero.py
    torchrun --standalone --nproc-per-node 2 examples/train_zero.py --resume zero_ckpt/full.pt

Runs on GPUs with NCCL (one per rank) or, without CUDA, on the CPU with gloo. Each rank keeps the
bf16 model on its device and 1/N of the master weights and Adam states in host RAM; grads are
averaged over the ranks as DDP does. Every rank saves its shard; rank 0 joins them into one full
checkpoint, which any number of ranks (or a single process) can resume from.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from cpu_adam import OffloadOptimizer, load_checkpoint, save_checkpoint
from cpu_adam.distributed import consolidate_state_dict, cores_per_local_rank

VOCAB = 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per rank")
    parser.add_argument("--out", default="zero_ckpt", help="checkpoint directory")
    parser.add_argument("--resume", help="a full checkpoint (consolidated) to continue from")
    args = parser.parse_args()

    # torchrun sets OMP_NUM_THREADS=1: give this rank its share of the cores for the CPU step.
    threads = cores_per_local_rank()
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # every rank starts from the same weights
    model = nn.Sequential(nn.Embedding(VOCAB, args.dim), nn.LayerNorm(args.dim), nn.Linear(args.dim, VOCAB))
    model = model.to(device=device, dtype=torch.bfloat16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = OffloadOptimizer(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-3,
        max_grad_norm=1.0,
        process_group=dist.group.WORLD,
    )
    if args.resume:
        opt.load_state_dict(load_checkpoint(args.resume))  # sets the device weights too
    if rank == 0:
        stats = opt.memory_stats()
        print(f"{world} ranks on {device.type}, {threads} CPU threads each, {stats['params'] / 1e6:.2f}M params")
        print(f"host bytes per param on each rank: {stats['host_bytes_per_param']:.2f}")

    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(args.steps):
        start = torch.randint(VOCAB, (args.batch, 1), generator=data)
        tokens = ((start + torch.arange(17)) % VOCAB).to(device)  # learnable: next = current + 1
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()  # buckets are reduce-scattered as they fill; this rank's piece goes to host RAM
        opt.step()  # Adam on this rank's shard, then the bf16 shards are all-gathered into the model
        opt.zero_grad()
        if rank == 0 and (step % 20 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}  grad norm {opt.last_grad_norm:.3f}")

    out = Path(args.out)
    out.mkdir(exist_ok=True)
    save_checkpoint(opt.state_dict(), out / f"shard{rank}.pt")  # a crash mid-save keeps the last one
    dist.barrier()
    if rank == 0:
        full = consolidate_state_dict([load_checkpoint(out / f"shard{r}.pt") for r in range(world)])
        save_checkpoint(full, out / "full.pt")
        print(f"saved {out}/shard*.pt (one per rank) and {out}/full.pt (any number of ranks can load it)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
