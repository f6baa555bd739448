"""FSDP2 with the sharded params, grads and optimizer step on the CPU, stepped by CPUAdam.

    torchrun --nproc-per-node 2 examples/fsdp2_cpu_adam.py

Runs on GPUs with NCCL (one per rank) or, without CUDA, on the CPU with gloo. fully_shard's
CPUOffloadPolicy keeps each rank's fp32 shard of the weights and grads in host memory and moves
the weights to the device only for forward and backward, so the optimizer step is a CPU step:
CPUAdam updates the DTensor shards in place.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from cpu_adam import CPUAdam
from cpu_adam.distributed import cores_per_local_rank


def build_model(dim: int, depth: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)  # fully_shard keeps each rank's slice of these weights: make them agree
    blocks = [nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(depth)]
    model = nn.Sequential(*blocks, nn.Linear(dim, 1)).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # Pinned host memory speeds up the copies to a GPU; CPU-only machines have nothing to pin for.
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    for block in blocks:  # one all-gather per block, so only one block is unsharded at a time
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16-states", action="store_true", help="keep Adam's moments in bfloat16 (half the bytes)")
    args = parser.parse_args()

    # torchrun sets OMP_NUM_THREADS=1: give this rank its share of the cores for the CPU step.
    threads = cores_per_local_rank()
    torch.set_num_threads(threads)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    model = build_model(args.dim, args.depth, device)
    optimizer = CPUAdam(model.parameters(), lr=args.lr, weight_decay=0.01, fp32_optimizer_states=not args.bf16_states)
    if rank == 0:
        print(f"{dist.get_world_size()} ranks on {device.type}, {threads} CPU threads per rank for the optimizer step")

    # A fixed random teacher to regress onto; each rank draws its own batches (data parallel).
    teacher = torch.randn(args.dim, 1, generator=torch.Generator().manual_seed(1)).to(device)
    data = torch.Generator(device=device).manual_seed(100 + rank)
    for step in range(args.steps):
        x = torch.randn(32, args.dim, generator=data, device=device)
        loss = nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
        loss.backward()  # grads are reduce-scattered, then offloaded to the host shards
        optimizer.step()  # CPUAdam on the local shards, on this rank's CPU threads
        optimizer.zero_grad()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
