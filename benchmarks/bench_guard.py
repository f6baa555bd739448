"""What CPUAdam's guard against concurrent steps costs: a step with it against the same step without it.

The guard is a lock taken without waiting at the start of step() (and of load_state_dict() and
add_param_group()). Steps of the two kinds alternate on twin optimizers (the same params, grads and
state), so both see the same machine; medians over the rounds, and the median of the paired
differences.

    python benchmarks/bench_guard.py                  # 2^10 and 2^20 params, about 10 s
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parent.parent))
from cpu_adam import CPUAdam

_STEP_ITSELF = inspect.unwrap(CPUAdam.step)  # under torch.no_grad and the guard


class Unguarded(CPUAdam):
    """CPUAdam's step without the guard: the same work, no lock."""

    @torch.no_grad()
    def step(self, closure=None):
        return _STEP_ITSELF(self, closure)


def timed_step(opt: CPUAdam) -> float:
    t = time.perf_counter()
    opt.step()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    print(f"{'params':>10}{'with guard us':>15}{'without us':>12}{'difference us':>15}{'of the step':>13}")
    for numel in (2**10, 2**20):
        rounds = args.rounds if numel <= 2**12 else args.rounds // 30
        twins = {}
        for guarded, kind in ((True, CPUAdam), (False, Unguarded)):
            p = torch.nn.Parameter(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
            p.grad = torch.full_like(p, 1e-3)
            twins[guarded] = kind([p], lr=1e-3)
        times: dict[bool, list[float]] = {True: [], False: []}
        for r in range(rounds + 10):
            order = (True, False) if r % 2 else (False, True)
            for guarded in order:
                elapsed = timed_step(twins[guarded])
                if r >= 10:
                    times[guarded].append(elapsed)
        diff = statistics.median(a - b for a, b in zip(times[True], times[False]))
        with_us, without_us = (statistics.median(times[g]) * 1e6 for g in (True, False))
        print(f"{numel:>10}{with_us:>15.2f}{without_us:>12.2f}{diff * 1e6:>15.2f}{diff * 1e6 / without_us:>13.1%}")


if __name__ == "__main__":
    main()
