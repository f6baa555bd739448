"""The optimizer step over FSDP2's CPU-offloaded shards: CPUAdam against torch's AdamW.

What FSDP2 users run today with ``CPUOffloadPolicy`` is ``torch.optim.AdamW`` stepping the fp32
DTensor shards in host RAM (torchtitan builds it with ``fused=True``; ``AdamW()``'s default is the
other common choice). This script gives each rank a model sharded by ``fully_shard`` per block
and at the root, one real forward and backward so that every shard has the grads FSDP2 made, and
then times only ``optimizer.step()``, every contender once per round, interleaved (the order
rotates each round) so that the machine's bandwidth of the moment falls on all of them alike.

A round's time of a contender is that of the slower rank (training waits for it); ratios are
medians over rounds of same-round pairs. With ``--profile`` each CPUAdam row also says how much
of rank 0's step its kernel took (the rest is Python: the param loop, the state lookups, the
DTensor unwrapping, the pieces of shards that start inside an 8-bit block).

    python benchmarks/bench_fsdp2_step.py                      # 2 ranks x 1 thread, ~25M params a rank
    python benchmarks/bench_fsdp2_step.py --params-per-rank 4M --rounds 6   # a quick look
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table, parse_size

WIDTH = 2048  # a block is a WIDTH x WIDTH Linear: 4.2M params, about a transformer's projection
HYPER = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MAX_NORM = 1e-3  # below the grads' norm: every step clips, as language models' steps do


@dataclass(frozen=True)
class Config:
    """A contender: the optimizer, the shards' dtype and the moments' precision."""

    name: str
    optimizer: str  # "adamw_fused", "adamw_default" or "cpu_adam"
    shard_dtype: torch.dtype
    moments: str  # "fp32", "bf16" or "8bit"
    target: float | None = None  # the bar against AdamW(fused=True) on fp32 shards
    rounding: str = "stochastic"  # of bf16 shards' stores: "stochastic", or "nearest" (what SR costs)
    clip: str | None = None  # "inside": CPUAdam(max_grad_norm); "torch": clip_grad_norm_ before the step

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if self.optimizer == "adamw_fused":
            return torch.optim.AdamW(params, **HYPER, fused=True)
        if self.optimizer == "adamw_default":
            return torch.optim.AdamW(params, **HYPER)
        from cpu_adam import CPUAdam

        return CPUAdam(
            params,
            **HYPER,
            state_precision=self.moments,
            stochastic_rounding=self.shard_dtype == torch.bfloat16 and self.rounding == "stochastic",
            max_grad_norm=MAX_NORM if self.clip == "inside" else None,
        )

    def stepper(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> Callable[[], None]:
        if self.clip != "torch":
            return optimizer.step

        def clip_then_step() -> None:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            optimizer.step()

        return clip_then_step


FUSED = Config("AdamW(fused=True) fp32/fp32", "adamw_fused", torch.float32, "fp32")
DEFAULT = Config("AdamW() fp32/fp32", "adamw_default", torch.float32, "fp32")
SR_BF16 = Config("CPUAdam bf16-SR + bf16 moments", "cpu_adam", torch.bfloat16, "bf16", 1.8)
CONFIGS = [
    FUSED,
    DEFAULT,
    Config("CPUAdam fp32/fp32", "cpu_adam", torch.float32, "fp32", 1.0),
    Config("CPUAdam fp32 + bf16 moments", "cpu_adam", torch.float32, "bf16", 1.3),
    SR_BF16,
    Config("CPUAdam bf16 (nearest) + bf16 moments", "cpu_adam", torch.bfloat16, "bf16", rounding="nearest"),
    Config("CPUAdam bf16-SR + 8-bit moments", "cpu_adam", torch.bfloat16, "8bit", 1.3),
    # Clipping, every step: inside the step (one read of the grads for the norm), or torch's before it.
    Config("  clipped inside: bf16-SR + bf16, max_grad_norm", "cpu_adam", torch.bfloat16, "bf16", clip="inside"),
    Config("  clipped before: clip_grad_norm_, bf16-SR + bf16", "cpu_adam", torch.bfloat16, "bf16", clip="torch"),
]
UNCLIPPED = {c.name: SR_BF16 for c in CONFIGS if c.clip}  # each clipped row against the same step unclipped


def sharded_model(blocks: int, dtype: torch.dtype) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(blocks)]).to(dtype)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = CPUOffloadPolicy(pin_memory=False)
    for block in model:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    x = torch.randn(4, WIDTH, dtype=dtype, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).float().square().mean().backward()  # the grads are FSDP2's own reduce-scattered shards
    return model


class KernelClock:
    """Adds up the time spent inside cpu_adam's kernel calls (wrapped where CPUAdam's step calls it)."""

    def __init__(self) -> None:
        import cpu_adam._compiled_step as compiled

        self.seconds = 0.0
        kernel = compiled.adam_step

        def timed(*args, **kwargs) -> None:
            if kwargs.get("check_only"):  # the arguments' checks before any tensor changes: not the kernel
                return kernel(*args, **kwargs)
            start = time.perf_counter()
            kernel(*args, **kwargs)
            self.seconds += time.perf_counter() - start

        compiled.adam_step = timed


@dataclass
class Row:
    config: Config
    step: Callable[[], None] | None
    refused: str = ""


def rows_for(blocks: int, configs: list[Config]) -> list[Row]:
    rows = []
    for config in configs:
        model = sharded_model(blocks, config.shard_dtype)
        try:
            optimizer = config.build(list(model.parameters()))
        except ValueError as error:  # a precision CPUAdam does not take on DTensor params (yet)
            rows.append(Row(config, None, str(error).split(": ")[1]))
            continue
        params = list(model.parameters())
        optimizer.step()  # the first step allocates the state: not timed
        rows.append(Row(config, config.stepper(optimizer, params)))
    return rows


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return value.item()


def rank_main(
    rank: int, world_size: int, port: int, blocks: int, rounds: int, warmup: int, profile: bool, out: str
) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "GLOO_SOCKET_IFNAME": "lo",
            "LOCAL_WORLD_SIZE": str(world_size),
        }
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
    clock = KernelClock() if profile else None
    rows = rows_for(blocks, CONFIGS)
    live = [r for r in rows if r.step is not None]
    times: dict[str, list[float]] = {r.config.name: [] for r in live}
    kernel: dict[str, list[float]] = {r.config.name: [] for r in live}
    for index in range(warmup + rounds):
        shift = index % len(live)
        for row in live[shift:] + live[:shift]:
            dist.barrier()  # both ranks start the step together, as after a backward
            before = clock.seconds if clock else 0.0
            start = time.perf_counter()
            row.step()
            own = time.perf_counter() - start
            elapsed = slowest(own)
            if index >= warmup:
                times[row.config.name].append(elapsed)
                # this rank's kernel over this rank's step: the other rank's wait is not Python's
                kernel[row.config.name].append((clock.seconds - before) / own if clock else 0.0)
    if rank == 0:
        torch.save({"times": times, "kernel": kernel, "refused": {r.config.name: r.refused for r in rows}}, out)
    dist.barrier()
    dist.destroy_process_group()


def median_ratio(numerator: list[float], denominator: list[float]) -> float:
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def table(result: dict, params_per_rank: int, profile: bool) -> str:
    times, kernel, refused = result["times"], result["kernel"], result["refused"]
    headers = ["config", "ms/step", "ns/param", "vs AdamW(fused=True)", "vs AdamW()", "target", "vs unclipped"]
    if profile:
        headers.append("kernel share")
    rows = []
    for config in CONFIGS:
        if config.name not in times:
            rows.append(
                [config.name, "refused", "", "", "", f"{config.target}x" if config.target else "", "", ""][
                    : len(headers)
                ]
            )
            continue
        mine = times[config.name]
        median = statistics.median(mine)
        row = [
            config.name,
            f"{median * 1e3:.1f}",
            f"{median * 1e9 / params_per_rank:.2f}",
            f"{median_ratio(times[FUSED.name], mine):.2f}x",
            f"{median_ratio(times[DEFAULT.name], mine):.2f}x",
            f"{config.target}x" if config.target else "",
            f"{median_ratio(mine, times[UNCLIPPED[config.name].name]):.2f}x" if config.name in UNCLIPPED else "",
        ]
        if profile:
            share = statistics.median(kernel[config.name])
            row.append(f"{share:.0%}" if config.optimizer == "cpu_adam" else "")
        rows.append(row)
    notes = [f"{name}: refused ({why})" for name, why in refused.items() if why]
    return format_table(headers, rows) + "".join(f"\n\n{note}" for note in notes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params-per-rank", type=parse_size, default=parse_size("25M"))
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", action="store_true", help="the kernel's share of each CPUAdam step")
    args = parser.parse_args()
    per_block = WIDTH * WIDTH + WIDTH
    blocks = max(1, round(args.params_per_rank * args.world_size / per_block))
    params_per_rank = blocks * per_block // args.world_size
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        print(
            f"{args.world_size} gloo ranks x 1 thread, {blocks} blocks of {WIDTH}x{WIDTH}, "
            f"{params_per_rank / 1e6:.1f}M params a rank, {args.rounds} rounds after {args.warmup}",
            file=sys.stderr,
            flush=True,
        )
        spawn_args = (args.world_size, free_port(), blocks, args.rounds, args.warmup, args.profile, out)
        mp.spawn(rank_main, args=spawn_args, nprocs=args.world_size)
        result = torch.load(out)
    print(table(result, params_per_rank, args.profile))


if __name__ == "__main__":
    main()
