"""The device's share of the step on a GPU: a timeline model from measured figures, not a measurement.

With clipping the exact step follows the backward (it needs the global norm). cpu_adam's step() then
runs the host's share of Adam on the host's cores, and the device's share with the device kernel:

    step = forward + backward + grads' wait + host part + device part
    host part   = (1 - f) x the all-host CPU Adam time (memory-bound: time goes with elements)
    device part = max(f N bytes_per_element / HBM rate, launches x issue time)

The device part runs after the host part (so that a host failure leaves the device's state alone).
Where the share's state does not fit the memory the activations leave free, the rest streams over the
link during forward and backward, which hides it while its bytes fit the window at the link's rate.

Inputs (each a measured figure; ``--help`` lists them): the 1.32B run on one H200 of
shared/measurements/h200-2026-11-26 (forward 77-80 ms, backward 180-189 ms, CPU Adam per config,
PCIe 55 GB/s each way, peak device memory 35.9 GiB of 139.8 GiB, torchao 375 ms, GPU-resident AdamW
286 ms), and the 6.66B run on one H100 80 GB of benchmarks/README.md (backward 411 ms, forward about
150 ms, CPU Adam 864 ms with bf16-SR masters and bf16 states, torchao 1402 ms, peak 49.2 GiB of
79.6 GiB). Assumed, not measured: the device kernel's pace (HBM at 65% of the datasheet: 3.1 TB/s
on the H200, 2.2 TB/s on the H100, for the bytes it moves per element), and the host's time to
issue one bucket's launches (0.15 ms: 32 us for the kernel's own preparation measured on this
2-core machine, three times that for the buffers, the gather and the spread, and the launches).

    python benchmarks/timeline_model.py
    python benchmarks/timeline_model.py --issue-ms 0.3 --hbm-share 0.5      # a less kind device
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GB = 1e9
GIB = 2**30


@dataclass(frozen=True)
class Machine:
    name: str
    params: float
    forward_ms: float
    backward_ms: float
    grads_wait_ms: float  # grads still coming down when step() starts, and the norm
    peak_gib: float  # activations and weights, the optimizer's own buffers
    memory_gib: float
    hbm_tbps: float  # the datasheet's
    link_gbps: float  # each way
    torchao_ms: float
    adamw_ms: float | None  # GPU-resident AdamW's step; None: it does not fit


@dataclass(frozen=True)
class Config:
    name: str
    host_adam_ms: dict[str, float]  # all-host CPU Adam, per machine
    state_bytes: float  # per element, in device memory (fp32 master 4, moments 8 / 4 / 2 + scales)
    kernel_bytes: float  # per element moved by the device's step (grads, state both ways, the weights' round trip)


H200 = Machine("H200, 1.32B", 1.316e9, 78, 185, 5, 35.9, 139.8, 4.8, 55, 375, 286)
H100 = Machine("H100 80GB, 6.66B", 6.66e9, 150, 411, 10, 49.2, 79.6, 3.35, 55, 1402, None)
# Bytes the device's step moves per element: the bf16 grad read; the state read and written; with an fp32 master
# the bf16 weight written into the bucket buffer and spread (read, written); with a bf16 master the weights
# gathered into the buffer (read, written), stepped in place (read, written) and spread back (read, written).
CONFIGS = [
    Config("fp32 master, fp32 states", {H200.name: 322}, 12, 2 + 2 * 12 + 2 + 4),
    Config("fp32 master, bf16 states", {H200.name: 249}, 8, 2 + 2 * 8 + 2 + 4),
    Config("bf16-SR master, bf16 states", {H200.name: 197, H100.name: 864}, 4, 2 + 2 * 4 + 12),
    Config("bf16-SR master, 8-bit states", {H200.name: 321}, 2 + 8 / 256, 2 + 2 * (2 + 8 / 256) + 12),
]


def model(m: Machine, c: Config, share: float, args: argparse.Namespace) -> dict[str, float]:
    elements = share * m.params
    free = (m.memory_gib - m.peak_gib) * GIB * 0.85  # the planner's MEMORY_USE
    resident = min(elements, free / c.state_bytes)
    streamed_bytes = (elements - resident) * c.state_bytes  # each way
    window_s = (m.forward_ms + m.backward_ms) / 1e3
    link_left = max(0.0, streamed_bytes - 0.7 * window_s * m.link_gbps * GB)  # the planner's LINK_USE
    host_ms = (1 - share) * c.host_adam_ms[m.name]
    kernel_ms = elements * c.kernel_bytes / (m.hbm_tbps * 1e12 * args.hbm_share) * 1e3
    issue_ms = elements / args.bucket_size * args.issue_ms
    device_ms = max(kernel_ms, issue_ms) + link_left / (m.link_gbps * GB) * 1e3
    step = m.forward_ms + m.backward_ms + m.grads_wait_ms + host_ms + device_ms
    return dict(step=step, host=host_ms, device=device_ms, resident=resident / max(elements, 1), stream=streamed_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hbm-share", type=float, default=0.65, help="of the HBM datasheet rate the kernel reaches")
    parser.add_argument("--issue-ms", type=float, default=0.15, help="host time to issue one bucket's launches")
    parser.add_argument("--bucket-size", type=float, default=2**23, help="elements per bucket")
    args = parser.parse_args()
    print(
        "| machine, size | config | share | host part ms | device part ms | resident | streamed GB each way "
        "| step ms | tokens/s against torchao | against GPU AdamW |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in (H200, H100):
        for c in CONFIGS:
            if m.name not in c.host_adam_ms:
                continue
            for share in (0.0, 0.5, 1.0):
                r = model(m, c, share, args)
                adamw = f"{m.adamw_ms / r['step']:.2f}x" if m.adamw_ms else "does not fit"
                print(
                    f"| {m.name} | {c.name} | {share:.1f} | {r['host']:.0f} | {r['device']:.1f} | "
                    f"{r['resident']:.0%} | {r['stream'] / GB:.1f} | {r['step']:.0f} | "
                    f"{m.torchao_ms / r['step']:.2f}x | {adamw} |"
                )


if __name__ == "__main__":
    main()
