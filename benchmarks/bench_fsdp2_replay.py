"""FSDP2 + CPUAdam with the step behind the next forward, measured without a GPU by replaying a GPU's timeline.

The GPU is played by sleeps that leave the cores free: the forward reads each FSDP2 unit's shards where FSDP2's
gather reads them (and so waits for the unit's step, as FSDP2's pre-forward gather does), then sleeps for that
unit's share of the forward; the backward sleeps for its time. Everything else is real: a
world of one (gloo), the model's units sharded by ``fully_shard`` with ``CPUOffloadPolicy``, their grads
reduce-scattered by FSDP2 once, CPUAdam's step over the shards with the clip norm inside it (bf16-SR shards and
bf16 moments, every step clipping), serial or behind the forward.

The timeline is the H200's (benchmarks/results/h200-2026-12-04/timelines, world of one, 1.32B GPT, seq 2048,
batch 8): the root's part before the first block, each of 24 blocks' forward, and the backward; the units' sizes
are the GPT's, scaled to ``--params`` in all. The sleeps are scaled so that the host's kernel takes the share of
forward + backward it took there (there: 175 ms against 127 + 229 ms), measured here first; the norm then costs
what it costs here.

Per mode it prints the step (forward, backward and step(), back to back), the time the GPU would be busy, and the
exposed optimizer time (their difference); the issue's target for the step behind the forward: exposed at most
max(0, host step - forward) + 10% of the serial step; and what the guard of a step in flight costs a torch op on
the stepping thread (the forward's launches on a GPU).

    python benchmarks/bench_fsdp2_replay.py                    # ~1 minute on 2 cores
    python benchmarks/bench_fsdp2_replay.py --params 96M --steps 8 --json replay.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import cpu_model, parse_size

TIMELINE = Path(__file__).parent / "results/h200-2026-12-04/timelines/fsdp2_sr_bf16_inside.json"
HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MAX_NORM = 1e-3  # below the grads' norm: every step clips, as language models' steps do


class Units(nn.Module):
    """The root's own params (the GPT's embeddings and final norm), then the blocks; a loss that uses them all."""

    def __init__(self, width: int, rows: list[int]) -> None:
        super().__init__()
        self.root = nn.Linear(width, rows[0], bias=False)
        self.blocks = nn.ModuleList(nn.Linear(width, n, bias=False) for n in rows[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.root(x).float().square().mean() + sum(b(x).float().square().mean() for b in self.blocks)


def build(params: int, timeline: dict[str, Any]) -> nn.Module:
    """The GPT's units as Linears of the same shares of ``params``: the root's own, then each block's."""
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    shares = [timeline["root_numel"], *timeline["unit_numels"]]
    width = 512
    rows = [max(1, round(params * share / sum(shares) / width)) for share in shares]
    torch.manual_seed(0)
    model = Units(width, rows).to(torch.bfloat16)
    policy = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    # FSDP2's own reduce-scattered grad shards, kept for every replayed step
    model(torch.randn(4, width, dtype=torch.bfloat16)).backward()
    return model


def gathered_shards(unit: nn.Module) -> list[torch.Tensor]:
    """What FSDP2's gather of a unit reads on the host: each param's padded shard (FSDP2's own attribute)."""
    return [fsdp_param._sharded_param_data for fsdp_param in unit._get_fsdp_state()._fsdp_param_group.fsdp_params]


def replayed_step(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, unit_s: list[float], backward_s: float
) -> None:
    """The GPU's forward and backward as sleeps, each unit's gather reading its shards first (so that a step behind
    the forward is waited for there, unit by unit, as FSDP2's gather is), then step().

    A gather here reads one element of each shard: on a GPU the copy up is the device's work, not the host's."""
    for unit, seconds in zip([model, *model.blocks], unit_s):
        for shard in gathered_shards(unit):
            shard[:1].clone()
        time.sleep(seconds)
    time.sleep(backward_s)
    if optimizer is not None:  # None: the GPU's time alone, as the sleeps take it
        optimizer.step()


def measure(model: nn.Module, behind: bool, steps: int, unit_s: list[float], backward_s: float) -> dict[str, Any]:
    from cpu_adam import CPUAdam
    from cpu_adam.fsdp2 import step_behind_forward

    optimizer = CPUAdam(
        model.parameters(), **HYPER, state_precision="bf16", stochastic_rounding=True, max_grad_norm=MAX_NORM
    )
    # Every thread: here the forward's thread sleeps, as a GPU's launching thread would mostly wait.
    handle = step_behind_forward(model, optimizer, threads=torch.get_num_threads()) if behind else None
    times, kernels = [], []
    for i in range(steps + 2):  # two to warm up: the state's first step, then the first step behind
        start = time.perf_counter()
        replayed_step(model, optimizer, unit_s, backward_s)
        if i >= 2:
            times.append(time.perf_counter() - start)
            if handle is not None and i > 2 and handle._last is not None:  # the step this forward ran beside
                kernels.append(sum(handle._last.seconds))
    if handle is not None:
        handle.wait()
        handle.remove()
    gpu_s = gpu_time(model, steps, unit_s, backward_s)
    step_s = statistics.median(times)
    kernel_s = statistics.median(kernels) if kernels else None
    return {"step_s": step_s, "gpu_s": gpu_s, "exposed_s": step_s - gpu_s, "steps_s": times, "kernel_s": kernel_s}


def gpu_time(model: nn.Module, steps: int, unit_s: list[float], backward_s: float) -> float:
    """The replayed GPU's time as the sleeps take it (each a little over what it asks), with no step."""
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        replayed_step(model, None, unit_s, backward_s)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_step(model: nn.Module, rounds: int = 5) -> tuple[float, float]:
    """(kernel, norm) seconds of the serial step here, medians."""
    from cpu_adam import CPUAdam
    from cpu_adam.fsdp2.norm import total_norm

    optimizer = CPUAdam(
        model.parameters(), **HYPER, state_precision="bf16", stochastic_rounding=True, max_grad_norm=MAX_NORM
    )
    optimizer.step()
    grads = [p.grad for p in model.parameters()]
    kernel, norm = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        total_norm(grads)
        norm.append(time.perf_counter() - start)
        start = time.perf_counter()
        optimizer.step()
        kernel.append(time.perf_counter() - start - norm[-1])
    return statistics.median(kernel), statistics.median(norm)


def guard_cost(ops: int = 20000, rounds: int = 7) -> tuple[float, float]:
    """Seconds of a small torch op on the stepping thread without and with the guard of a step in flight (over a
    model's worth of guarded tensors, none of them the op's): medians of interleaved rounds."""
    from cpu_adam.fsdp2.guard import ReadGuard

    a, b = torch.ones(16), torch.ones(16)
    held = [torch.ones(4) for _ in range(600)]
    guard = ReadGuard({id(t): 0 for t in held}, held, lambda unit: None, lambda: None, lambda: False)

    def per_op() -> float:
        start = time.perf_counter()
        for _ in range(ops):
            torch.add(a, b)
        return (time.perf_counter() - start) / ops

    plain, guarded = [], []
    for _ in range(rounds):
        plain.append(per_op())
        torch._C._push_on_torch_function_stack(guard)
        try:
            guarded.append(per_op())
        finally:
            torch._C._pop_torch_function_stack()
    return statistics.median(plain), statistics.median(guarded)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=parse_size, default=parse_size("64M"))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--timeline", type=Path, default=TIMELINE)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    timeline = json.loads(args.timeline.read_text())
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29561"))
    dist.init_process_group("gloo", rank=0, world_size=1)
    model = build(args.params, timeline)
    kernel_s, norm_s = host_step(model)
    gpu_kernel_s = timeline["host"]["kernel"]
    scale = kernel_s / gpu_kernel_s  # the GPU's times, so that the kernel takes the share it took there
    unit_s = [scale * (timeline["root_before_first_unit_s"])] + [scale * t for t in timeline["unit_forward_s"]]
    backward_s = scale * timeline["backward_s"]
    forward_s = sum(unit_s)
    serial = measure(model, False, args.steps, unit_s, backward_s)
    behind = measure(model, True, args.steps, unit_s, backward_s)
    host_s = kernel_s + norm_s
    bar = max(0.0, host_s - forward_s) + 0.1 * serial["step_s"]
    lines = [
        f"{cpu_model()}, {torch.get_num_threads()} threads; {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"params in {len(unit_s)} units, bf16-SR shards + bf16 moments, clipping every step",
        f"timeline {args.timeline.name} scaled {scale:.3f}x: forward {forward_s * 1e3:.1f} ms, backward "
        f"{backward_s * 1e3:.1f} ms; the host step here: kernel {kernel_s * 1e3:.1f} ms + norm {norm_s * 1e3:.1f} ms",
        "",
        f"{'mode':<28}{'step ms':>9}{'GPU ms':>9}{'exposed ms':>12}",
    ]
    for name, row in (("serial", serial), ("behind the next forward", behind)):
        lines.append(f"{name:<28}{row['step_s'] * 1e3:>9.1f}{row['gpu_s'] * 1e3:>9.1f}{row['exposed_s'] * 1e3:>12.1f}")
    verdict = "met" if behind["exposed_s"] <= bar else "missed"
    plain_op, guarded_op = guard_cost()
    lines += [
        "",
        f"behind: {serial['step_s'] / behind['step_s']:.2f}x the serial step's speed; exposed "
        f"{behind['exposed_s'] * 1e3:.1f} ms; the target, max(0, host step - forward) + 10% of the serial step: "
        f"{bar * 1e3:.1f} ms ({verdict}); behind the forward the kernel took {behind['kernel_s'] * 1e3:.1f} ms",
        f"the guard while a step is in flight: a small torch op on the stepping thread {plain_op * 1e6:.2f} us, "
        f"{guarded_op * 1e6:.2f} us under it (+{(guarded_op - plain_op) * 1e6:.2f} us an op)",
    ]
    print("\n".join(lines))
    if args.json:
        result = {
            "serial": serial,
            "behind": behind,
            "kernel_s": kernel_s,
            "norm_s": norm_s,
            "scale": scale,
            "forward_s": forward_s,
            "backward_s": backward_s,
            "target_s": bar,
            "cpu": cpu_model(),
        }
        Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
