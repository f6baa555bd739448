"""Do bf16 master weights learn? fp32 vs bf16 round-to-nearest vs bf16 stochastic rounding, with CPUAdam.

A student MLP learns a fixed random teacher MLP (synthetic regression, a fresh batch every step,
generated in-script from --seed) three ways, from the same init and the same batches:

    fp32         float32 params: the reference trajectory
    bf16-nearest bfloat16 params, CPUAdam(stochastic_rounding=False)
    bf16-sr      bfloat16 params, CPUAdam(stochastic_rounding=True)

At lr 1e-4 most Adam updates are below half a bf16 ulp of the weights, so nearest rounding drops
them; stochastic rounding keeps them on average. Writes the smoothed loss curves to one PNG.

    python benchmarks/sr_experiment.py                  # ~1 minute on 2 busy CPU cores
    python benchmarks/sr_experiment.py --steps 6000 --lr 3e-4 --json sr.json

Each run's result goes to stdout as it ends; a line as each run starts and ends, with the time
left, goes to stderr (``--quiet``: none).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import Progress

from cpu_adam import CPUAdam

IN_DIM, HIDDEN, BATCH = 32, 256, 256
EVAL_SAMPLES = 16384
RUNS = (("fp32", torch.float32, False), ("bf16-nearest", torch.bfloat16, False), ("bf16-sr", torch.bfloat16, True))


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, 1)
    )


class Task:
    """y = teacher(x) for x ~ N(0, I), scaled to unit variance so losses read as fractions of it."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.teacher = mlp().requires_grad_(False)
        for p in self.teacher.parameters():
            # PyTorch's default init makes a near-linear, low-variance teacher; a larger one is worth learning.
            p.mul_(3.0)
        self.scale = self.teacher(torch.randn(EVAL_SAMPLES, IN_DIM)).std().item()
        self.eval_x = torch.randn(EVAL_SAMPLES, IN_DIM)
        self.eval_y = self.targets(self.eval_x)

    def targets(self, x: Tensor) -> Tensor:
        return self.teacher(x) / self.scale

    def batches(self, seed: int, steps: int):
        # One generator per run, seeded alike: every run sees the same batches in the same order.
        gen = torch.Generator().manual_seed(seed)
        for _ in range(steps):
            x = torch.randn(BATCH, IN_DIM, generator=gen)
            yield x, self.targets(x)


@dataclass
class Result:
    name: str
    final_loss: float  # on EVAL_SAMPLES held-out samples, fp32 compute
    unmoved_after_5: float  # fraction of weights still equal to their init after 5 steps
    unmoved_at_end: float  # fraction of weights never changed in any step
    seconds: float
    losses: list[float] = field(repr=False)


def train(
    name: str,
    dtype: torch.dtype,
    stochastic: bool,
    task: Task,
    init: dict[str, Tensor],
    args: argparse.Namespace,
    tick: Callable[[], None] = lambda: None,
) -> Result:
    student = mlp()  # only its structure is used: functional_call swaps our tensors in
    params = {k: v.to(dtype).clone().requires_grad_() for k, v in init.items()}
    start = {k: v.detach().clone() for k, v in params.items()}
    moved = {k: torch.zeros_like(v, dtype=torch.bool) for k, v in params.items()}
    opt = CPUAdam(params.values(), lr=args.lr, stochastic_rounding=stochastic, seed=args.seed)

    def forward(x: Tensor) -> Tensor:
        # Compute in fp32 from the stored weights, so the runs differ only in how weights are stored and rounded.
        return functional_call(student, {k: v.float() for k, v in params.items()}, (x,))

    def unmoved() -> float:
        return 1.0 - sum(int(m.sum()) for m in moved.values()) / sum(m.numel() for m in moved.values())

    losses: list[float] = []
    unmoved_after_5 = 1.0
    began = time.perf_counter()
    for step, (x, y) in enumerate(task.batches(args.seed, args.steps), 1):
        loss = F.mse_loss(forward(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        with torch.no_grad():
            for k, v in params.items():
                moved[k] |= v != start[k]
        if step == 5:
            unmoved_after_5 = unmoved()
        tick()
    seconds = time.perf_counter() - began
    with torch.no_grad():
        final = F.mse_loss(forward(task.eval_x), task.eval_y).item()
    return Result(name, final, unmoved_after_5, unmoved(), seconds, losses)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean; the per-step loss of one 256-sample batch is too noisy to compare by eye."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot(results: list[Result], args: argparse.Namespace) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    window = max(1, args.steps // 50)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    styles = {"fp32": ("black", "-"), "bf16-nearest": ("tab:red", "-"), "bf16-sr": ("tab:blue", "--")}
    for r in results:
        color, line = styles[r.name]
        label = f"{r.name}  (final {r.final_loss:.4f})"
        ax.plot(range(1, len(r.losses) + 1), smooth(r.losses, window), line, color=color, lw=1.6, label=label)
    ax.set_yscale("log")
    # Label round values (log-scale defaults crowd or go blank) without letting the ticks widen the range.
    limits = ax.get_ylim()
    ax.set_yticks([0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2, 5])
    ax.set_ylim(*limits)
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("step")
    ax.set_ylabel(f"train MSE (mean of last {window} steps)")
    ax.set_title(f"CPUAdam, MLP teacher-student, lr {args.lr:.0e}: how bf16 weights are rounded")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0, help="teacher, init, data order and rounding stream")
    parser.add_argument("--out", default="benchmarks/sr_loss.png")
    parser.add_argument("--json", help="also write config, results and per-step losses here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args()

    # 256-wide matmuls are too small to gain from a second thread, and on shared cores the sync costs 5x.
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="cpu_adam: the optimizer step runs on 1 thread")

    task = Task(args.seed)
    init = {k: v.detach() for k, v in mlp().named_parameters()}
    results = []
    progress = Progress(len(RUNS), len(RUNS) * args.steps, "sr_experiment", quiet=args.quiet)
    for name, dtype, stochastic in RUNS:
        with progress.phase(name, args.steps) as tick:
            r = train(name, dtype, stochastic, task, init, args, tick)
        results.append(r)
        print(
            f"{r.name:13s} final loss {r.final_loss:.4f}   unmoved after 5 steps {r.unmoved_after_5:6.1%}"
            f"   never moved {r.unmoved_at_end:6.1%}   {r.seconds:.0f} s",
            flush=True,
        )
    plot(results, args)
    print(f"wrote {args.out}")
    if args.json:
        config = {"steps": args.steps, "lr": args.lr, "seed": args.seed, "batch": BATCH, "hidden": HIDDEN}
        Path(args.json).write_text(json.dumps({"config": config, "results": [asdict(r) for r in results]}))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
