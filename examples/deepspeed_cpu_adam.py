"""DeepSpeed ZeRO with the optimizer offloaded to the CPU, stepped by CPUAdam as the client optimizer.

    torchrun --nproc-per-node 2 examples/deepspeed_cpu_adam.py --config examples/deepspeed_cpu_adam.json
    torchrun --nproc-per-node 2 examples/deepspeed_cpu_adam.py --config examples/deepspeed_cpu_adam_zero3.json

(`deepspeed --num_gpus 2 examples/deepspeed_cpu_adam.py ...` works as well on GPUs.) Without CUDA,
DeepSpeed picks its CPU accelerator and gloo. deepspeed_cpu_adam.json is ZeRO-2 with "offload_optimizer":
{"device": "cpu"}: each rank keeps one flat fp32 partition per param group in host memory; DeepSpeed fills its
.grad and calls the client optimizer's step(), which is where CPUAdam runs. deepspeed_cpu_adam_zero3.json is
ZeRO-3 with "offload_param" on the CPU as well, for models larger than the GPUs: the bf16 params live in host
memory between uses, and DeepSpeed calls step() once per sub-group of each param group. Either config must allow
a client optimizer with offload: "zero_force_ds_cpu_optimizer": false, "zero_allow_untested_optimizer": true.
Clipping is DeepSpeed's "gradient_clipping" (CPUAdam's max_grad_norm is refused under DeepSpeed: CPUAdam sees a
part of the grads).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch import nn

from cpu_adam import CPUAdam
from cpu_adam.distributed import cores_per_local_rank


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "deepspeed_cpu_adam.json"))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument(
        "--state-precision", choices=["fp32", "bf16", "8bit"], default="fp32", help="how CPUAdam keeps Adam's moments"
    )
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher; unused")
    args = parser.parse_args()

    # torchrun sets OMP_NUM_THREADS=1: give this rank its share of the cores for the CPU step.
    threads = cores_per_local_rank()
    torch.set_num_threads(threads)
    import deepspeed  # after the thread setting: importing it probes the accelerator
    from deepspeed.accelerator import get_accelerator

    with open(args.config) as f:
        config = json.load(f)
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    rank = torch.distributed.get_rank()

    torch.manual_seed(0)
    dim = args.dim
    model = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.GELU(), nn.Linear(dim, 1))
    # Decay the matrices only: one param group each, and DeepSpeed hands CPUAdam one flat
    # fp32 partition per group (ZeRO-3: per sub-group of it).
    matrices = [p for p in model.parameters() if p.dim() > 1]
    others = [p for p in model.parameters() if p.dim() <= 1]
    optimizer = CPUAdam(
        [{"params": matrices, "weight_decay": 0.01}, {"params": others, "weight_decay": 0.0}],
        lr=args.lr,
        state_precision=args.state_precision,  # "bf16": 4 bytes per param fewer on the host, "8bit": 5.97 fewer
    )
    engine, optimizer, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if rank == 0:
        print(
            f"{engine.world_size} ranks on {get_accelerator().device_name()}, ZeRO stage "
            f"{engine.zero_optimization_stage()}, {threads} CPU threads per rank for the optimizer step"
        )

    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    teacher = torch.randn(dim, 1, generator=torch.Generator().manual_seed(1))
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches (data parallel)
    for step in range(args.steps):
        x = torch.randn(engine.train_micro_batch_size_per_gpu(), dim, generator=data)
        y = torch.tanh(x @ teacher)
        x, y = x.to(engine.device, dtype), y.to(engine.device)
        loss = nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()  # grads reduced into the host partitions, CPUAdam steps them, weights gathered
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
