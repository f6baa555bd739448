"""The planner's CPU step estimate against the measured step, for each state precision and master dtype.

    python benchmarks/bench_plan.py --sizes 22,24 --rounds 5

For each size: ``cpu_adam.plan`` probes the bandwidth as ``python -m cpu_adam.plan`` does and
estimates each configuration's step; then ``bench_step.py``'s step section (``--sections step``,
the peers left out) measures the kernel in the offload step's configurations (bf16 grads; with
fp32 masters the bf16 weights written over them, its "cpu_adam + out=grad" rows; a bf16 master
is the weight, its "cpu_adam" rows) and, in the same rounds, the probe of each configuration.
"measured / estimate" is how far the estimate is from the step;
"probe / estimate" how far the bandwidth moved between the planner's probe and the rounds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))
import bench_step
from _common import Progress, format_table, machine, parse_size, size_label

from cpu_adam import ops
from cpu_adam.plan import plan
from cpu_adam.plan.probe import measure_bandwidth

STATES = ["fp32", "bf16", "8bit"]


def compare(n: int, rounds: int, warmup: int, probe_seconds: float, progress: Progress) -> list[list[str]]:
    bandwidth = measure_bandwidth(probe_seconds)
    estimates = {
        (r.master_dtype, r.state_precision): r.step_seconds for r in plan(n, "1TiB", "1TiB", bandwidth=bandwidth)
    }
    peers = bench_step.PEERS + bench_step.PEERS8
    results = bench_step.run(
        n, torch.get_num_threads(), rounds, warmup, ["step"], STATES, dict.fromkeys(peers, False), {}, progress
    )
    # The best probe variant's row is named "probe + out=grad [variant]".
    measured = {(r["config"], r["implementation"].split(" [")[0]): r["ms_per_step"] / 1e3 for r in results}
    body = []
    for (master, states), estimate in estimates.items():
        label = f"{master}/bf16/{states}"
        out = " + out=grad" if master == "fp32" else ""  # a bf16 master is the weight: no bf16 copy written
        step = measured[(label, bench_step.CPU_ADAM + out)]
        probe = measured[(label, bench_step.PROBE + out)]
        cells = [size_label(n), states, master, f"{bandwidth / 1e9:.1f}", f"{estimate * 1e3:.2f}"]
        body.append(
            [*cells, f"{probe * 1e3:.2f}", f"{step * 1e3:.2f}", f"{probe / estimate:.2f}", f"{step / estimate:.2f}"]
        )
    return body


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="22,24", help="params per step, comma list (log2 or counts, as bench_step)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per configuration (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (default 1)")
    parser.add_argument("--probe-seconds", type=float, default=0.5, help="the planner's probe (its default 0.5)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args()
    # The offload step's configurations only: bf16 grads, as they come down from the device.
    bench_step.STEP_CONFIGS = [c for c in bench_step.STEP_CONFIGS if c.grad == bench_step.BF16]
    info = machine()
    print(f"# {info['cpu']}, {info['cpus']} cpus, {info['torch_threads']} threads, cpu_adam ISA {ops.active_isa()}")
    headers = ["params", "states", "master", "plan GB/s", "estimate ms", "probe ms", "measured ms"]
    headers += ["probe / estimate", "measured / estimate"]
    sizes = [parse_size(size) for size in args.sizes.split(",")]
    groups = len(bench_step.plan_jobs(sizes[0], ["step"], STATES, {}, {}))
    work = groups * (args.rounds + args.warmup) * sum(sizes)
    progress = Progress(groups * len(sizes), work, "bench_plan", quiet=args.quiet)
    body = [row for n in sizes for row in compare(n, args.rounds, args.warmup, args.probe_seconds, progress)]
    print(format_table(headers, body))


if __name__ == "__main__":
    main()
