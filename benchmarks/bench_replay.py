"""How much of the CPU step hides behind backward, measured without a GPU by replaying a GPU's timeline.

The GPU is played by sleeps: the forward sleeps for its share of the step, and during backward each
layer's node sleeps for its share before handing its grads to autograd, so the grads reach the
optimizer's hooks when they would land from the GPU (last layer first, evenly spread over the
backward). Everything else is real: the copies between the "device" and the host buffers (the
GPU code path with the CPU as the device: staging areas, copies down, uploads), the grad norms, the
kernel, the worker thread of overlap="backward". The timeline's phases are the H100 run's (forward
80 ms, backward 190 ms for the 1.32B GPT, benchmarks/README.md), scaled so that the serial CPU step
takes the same share of forward + backward as there (its CPU Adam took 206-288 ms against 270 ms:
``--cpu-share 0.9``).

Per config and overlap mode it prints the step time (forward + backward + step()), the simulated
GPU's busy time, the exposed optimizer time (the step minus the GPU's time), the time of the
``step()`` call alone, and that less the host time of its uploads. The host also does here what
a GPU would do itself: it packs the grads and takes their norms (the CPU is the device), and with
copies (the default) it makes the copies a GPU's copy engines would make, all on the same cores as
the kernel; the exposed time includes them. ``step()`` less its uploads is the part of the CPU
step that a GPU run would still see after backward.

Each config runs two grad-norm trajectories with clipping at 1.0: grads of norm 0.5, which never
clip, and of norm 2, which clip every step, as real training's do nearly every step (about 99% of
them in LM pre-training): with clipping an exact step needs the global norm first.

    python benchmarks/bench_replay.py                    # ~2 minutes on 2 cores
    python benchmarks/bench_replay.py --no-copies        # the CPU as the device itself: no copies
    python benchmarks/bench_replay.py --json replay.json
    python benchmarks/bench_replay.py --timeline DIR/cpu_adam:sr_bf16.json   # a GPU run's recorded timeline

The table goes to stdout; a line per phase (each config's serial probe, then each overlap mode)
with the time left goes to stderr (``--quiet``: none).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import time
from typing import Any

# Before OpenMP starts: idle OpenMP threads spin briefly, then sleep. Here the model's thread does the
# device's work (copies, norms) in parallel regions, and its threads' spinning after each (libgomp's
# default: about 300,000 spins) took the core the worker steps on, preempting the model's thread for
# about 4 ms per step; on a GPU that work is the device's.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import torch
from _common import Phase, Progress

from cpu_adam import OffloadOptimizer
from cpu_adam.offload import rooms as offload_rooms
from cpu_adam.offload.device import DeviceOps

FORWARD_MS, BACKWARD_MS = 80.0, 190.0  # one H100, 1.32B GPT, seq 2048, batch 8
CONFIGS = {
    "fp32 master / fp32 states": dict(state_precision="fp32"),
    "fp32 master / bf16 states": dict(state_precision="bf16"),
    "bf16-SR master / bf16 states": dict(
        state_precision="bf16", master_weights_dtype=torch.bfloat16, stochastic_rounding=True
    ),
}


def _cache_freed_memory() -> None:
    """The CPU as a device allocates like CUDA's caching allocator: freed blocks stay with the process.

    glibc hands large freed blocks back to the OS and maps them again, which made the uploads'
    device buffers (one per bucket per step) cost 8-22 ms per step from step to step (8-10 ms kept).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6")
        for option in (-1, -3):  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
            libc.mallopt(option, 1 << 30)


class CopyingDevice(DeviceOps):
    """The CPU as a device that is not the host: every copy a GPU would make is made."""

    @property
    def host_addressable(self) -> bool:
        return False


class _Clock:
    """When the simulated GPU finishes each layer's backward: evenly spread, whatever the host does meanwhile.

    A GPU runs the kernels the host queued ahead of it, so the host's work in the hooks (packing,
    norms, copies: the device's work here, as the CPU is the device) hides in the layer's time where
    it fits; only what runs past a layer's end delays the next.
    """

    def __init__(self, per_layer: float) -> None:
        self.per_layer = per_layer
        self.due = 0.0

    def start(self) -> None:
        self.due = time.perf_counter()

    def next_layer(self) -> None:
        self.due += self.per_layer
        time.sleep(max(0.0, self.due - time.perf_counter()))


class _Layer(torch.autograd.Function):
    """Forward: nothing. Backward: waits for the GPU to finish this layer, then hands over its grads, made by nobody.

    The grads come from a pool: the tensor handed to autograd is referenced by nothing else, so
    autograd stores it as the param's grad as it is (no copy, no host time); a hook registered
    before the optimizer's puts it back into the pool.
    """

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, pool: list[torch.Tensor], clock: _Clock) -> torch.Tensor:
        ctx.pool, ctx.clock = pool, clock
        return param.new_zeros((), dtype=torch.float32)

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.clock.next_layer()
        return ctx.pool.pop(), None, None


TRAJECTORIES = {"never clips": 0.5, "clips every step": 2.0}  # the grads' norm; max_grad_norm is 1.0


def _timed_steps(
    args: argparse.Namespace,
    options: dict,
    overlap: str,
    timeline: tuple[float, float],
    tick: Phase,
    grad_norm: float = 0.5,
) -> dict:
    forward_s, backward_s = timeline
    offload_rooms.DeviceOps = CopyingDevice if args.copies else DeviceOps
    try:
        size = args.params // args.layers
        layers = [torch.nn.Parameter(torch.randn(size).to(torch.bfloat16)) for _ in range(args.layers)]
        pools: list[list[torch.Tensor]] = [[] for _ in layers]
        for p, pool in zip(layers, pools):
            p.register_post_accumulate_grad_hook(lambda p, pool=pool: pool.append(p.grad))
        # A bucket per layer: about as many buckets as the H100 run's 1.32B params in 8M-element buckets (157),
        # so that grads land as finely spread over the backward.
        opt = OffloadOptimizer(layers, lr=1e-4, max_grad_norm=1.0, overlap=overlap, bucket_size=size, **options)
    finally:
        offload_rooms.DeviceOps = DeviceOps
    g = torch.Generator().manual_seed(0)
    # Clipping at 1.0 is on; grads of norm 0.5 never clip, of norm 2 always do.
    grads = [torch.randn(p.numel(), generator=g) for p in layers]
    total = sum(float(x.square().sum()) for x in grads) ** 0.5
    for pool, x in zip(pools, grads):
        pool.append((x * grad_norm / total).to(torch.bfloat16))
    clock = _Clock(backward_s / args.layers)
    steps, previewed = [], 0
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        time.sleep(forward_s)
        loss = sum(_Layer.apply(p, pool, clock) for p, pool in zip(layers, pools))
        clock.start()
        loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t2 = time.perf_counter()
        if i >= args.warmup:
            timings = opt.step_timings
            steps.append((t2 - t0, t1 - t0, t2 - t1, timings["uploads_s"], timings["overlap_wait_s"]))
            previewed += opt.last_step_overlapped
        tick()
    opt.close()

    def median_ms(column: int) -> float:
        return statistics.median(s[column] for s in steps) * 1e3

    gpu = (forward_s + backward_s) * 1e3
    return {
        "step_ms": median_ms(0),
        "gpu_ms": gpu,
        "exposed_ms": median_ms(0) - gpu,
        "forward_backward_ms": median_ms(1),
        "step_call_ms": median_ms(2),
        "uploads_ms": median_ms(3),  # the host's part: all of it here, none on a GPU (its copy engines)
        "worker_wait_ms": median_ms(4),  # step() waiting for the worker's passes: what backward did not hide
        "previewed_steps": previewed,
        "host_bytes_per_param": opt.memory_stats()["host_bytes_per_param"],
    }


def _timeline(args: argparse.Namespace, options: dict, tick: Phase) -> tuple[float, float]:
    """The simulated GPU's forward and backward, in seconds, from a serial run with no GPU time.

    They are the H100's, scaled so that the serial ``step()`` (the H100's CPU Adam was its
    step's) is ``cpu_share`` of them; the backward also gets the host's time in the hooks there
    (packing, norms, copies down): on a GPU that is the device's work, not the host's.
    """
    probe = _timed_steps(args, options, "none", (0.0, 0.0), tick)
    forward, backward, cpu_share = FORWARD_MS, BACKWARD_MS, args.cpu_share
    if args.timeline:  # a GPU run's: its phases, and its CPU step's share of them
        with open(args.timeline) as f:
            recorded = json.load(f)
        forward, backward = recorded["forward_s"], recorded["backward_s"]
        cpu_share = recorded["step_timings"]["adam_s"] / (forward + backward)
    gpu = probe["step_call_ms"] / 1e3 / cpu_share
    device_work = probe["forward_backward_ms"] / 1e3
    return gpu * forward / (forward + backward), gpu * backward / (forward + backward) + device_work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=2**26)
    parser.add_argument("--layers", type=int, default=128, help="a bucket each")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--cpu-share", type=float, default=0.9, help="serial CPU step / (forward + backward)")
    parser.add_argument("--timeline", metavar="PATH", help="bench_gpu_offload.py --record-timeline's file of one step")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated names of CONFIGS")
    parser.add_argument(
        "--no-copies",
        dest="copies",
        action="store_false",
        help="the CPU as the device itself: no copies down or up (a GPU's copy engines take no host cores)",
    )
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args()
    _cache_freed_memory()
    rows = []
    configs = args.configs.split(",")
    steps = args.warmup + args.steps
    # Work in serial CPU steps: a replayed step adds the simulated GPU's time, 1 / cpu_share of one.
    replayed = 1 + 1 / args.cpu_share
    runs = 2 * len(TRAJECTORIES)
    progress = Progress(
        (1 + runs) * len(configs), len(configs) * steps * (1 + runs * replayed), "bench_replay", quiet=args.quiet
    )
    print(f"{args.params / 1e6:.1f}M params in {args.layers} layers, {torch.get_num_threads()} threads")
    print(
        f"{'config':<30}{'grads':<18}{'overlap':<10}{'step ms':>9}{'gpu ms':>8}{'exposed':>9}{'late':>7}{'step()':>8}"
        f"{'uploads':>9}{'worker':>8}{'previewed':>11}"
    )
    for name in configs:
        options = CONFIGS[name]
        with progress.phase(f"{name}, serial probe", steps) as tick:
            timeline = _timeline(args, options, tick)
        for trajectory, norm in TRAJECTORIES.items():
            for overlap in ("none", "backward"):
                with progress.phase(f"{name}, {trajectory}, overlap {overlap}", steps * replayed, steps) as tick:
                    row = _timed_steps(args, options, overlap, timeline, tick, norm)
                row = {"config": name, "trajectory": trajectory, "overlap": overlap, **row}
                rows.append(row)
                late = row["forward_backward_ms"] - row["gpu_ms"]
                print(
                    f"{name:<30}{trajectory:<18}{overlap:<10}{row['step_ms']:>9.1f}{row['gpu_ms']:>8.1f}"
                    f"{row['exposed_ms']:>9.1f}{late:>7.1f}{row['step_call_ms']:>8.1f}{row['uploads_ms']:>9.1f}"
                    f"{row['worker_wait_ms']:>8.1f}{row['previewed_steps']:>7}/{args.steps}",
                    flush=True,
                )
            none, backward = rows[-2], rows[-1]
            serial_step = none["step_call_ms"] - none["uploads_ms"]
            print(
                f"{'':<48}with overlap: step {backward['step_ms'] / none['step_ms']:.2f}x the serial's, exposed "
                f"{backward['exposed_ms'] / none['exposed_ms']:.0%} of its; step() less uploads "
                f"{(backward['step_call_ms'] - backward['uploads_ms']) / serial_step:.0%}, the worker's wait "
                f"{backward['worker_wait_ms'] / serial_step:.0%}",
                flush=True,
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=2)


if __name__ == "__main__":
    main()
