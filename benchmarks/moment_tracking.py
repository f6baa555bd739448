"""Do stored Adam moments follow their true values? v_hat / E[g^2] on stationary grads, per state precision.

Gaussian grads of a fixed variance per element (spread over three decades, shuffled, so every
8-bit block holds a range of values) drive CPUAdam at lr 0 with fp32, bf16 and 8-bit states. At
the steps listed, the bias-corrected second moment v_hat = v / (1 - beta2^t) of each element is
divided by sigma^2 (its expectation); the table shows the median over elements (1.00: unbiased).

    python benchmarks/moment_tracking.py                        # 16,384 elements, 3000 steps, ~20 s
    python benchmarks/moment_tracking.py --elements 65536 --steps 30,300,1000,3000,10000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
# An installed cpu_adam wins; a source checkout that was not installed works too.
sys.path.append(str(Path(__file__).resolve().parent.parent))
from _common import format_table

from cpu_adam import CPUAdam, quant8

PRECISIONS = ("fp32", "bf16", "8bit")


def second_moment(optimizer: CPUAdam, param: Tensor) -> Tensor:
    state = optimizer.state[param]
    if state["exp_avg_sq"].dtype == torch.uint8:
        return quant8.dequantize_moments(state["exp_avg"], state["exp_avg_sq"], state["state_scales"])[1]
    return state["exp_avg_sq"].float()


def track(precision: str, elements: int, checkpoints: list[int], beta2: float, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    sigma = torch.logspace(-4, -1, elements)[torch.randperm(elements, generator=g)]
    param = torch.nn.Parameter(torch.zeros(elements))
    optimizer = CPUAdam([param], lr=0.0, betas=(0.9, beta2), state_precision=precision, seed=seed)
    medians = []
    for step in range(1, max(checkpoints) + 1):
        param.grad = sigma * torch.randn(elements, generator=g)
        optimizer.step()
        if step in checkpoints:
            v_hat = second_moment(optimizer, param) / (1 - beta2**step)
            medians.append((v_hat / sigma**2).median().item())
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=16384)
    parser.add_argument("--steps", default="30,300,1000,3000", help="comma list of the steps to report")
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    checkpoints = sorted(int(s) for s in args.steps.split(","))
    columns = {p: track(p, args.elements, checkpoints, args.beta2, args.seed) for p in PRECISIONS}
    rows = [[str(step), *(f"{columns[p][i]:.2f}" for p in PRECISIONS)] for i, step in enumerate(checkpoints)]
    print(f"median of v_hat / sigma^2, {args.elements} elements, beta2 {args.beta2}, seed {args.seed}")
    print(format_table(["step", *(f"{p} states" for p in PRECISIONS)], rows))


if __name__ == "__main__":
    main()
