"""The CPU step time, estimated: bytes the offload step moves per param, over the bandwidth this machine's probe sees.

``cpu_adam.ops.bandwidth_probe`` moves exactly the bytes of an Adam step with the kernel's threads
and no arithmetic: its time is the floor of a step that memory alone paces. Run once on the
default configuration (fp32 master and moments), it gives this machine's bandwidth now, and each
configuration's estimate is its bytes per param over that bandwidth. The kernel runs close to the
probe where memory sets the pace (fp32 and bf16 moments) and slower where its arithmetic does
(8-bit moments); ``docs/plan.md`` compares the estimates with measured steps.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from .. import ops
from .._precision import state_dtype
from ..offload.link import SLOT_DTYPE
from ..offload.store import SCALES_DTYPE, scales_shape
from ..quant8 import BLOCK

__all__ = [
    "COMPUTE_FACTOR",
    "DEFAULT_PROBE_ELEMENTS",
    "DEFAULT_PROBE_SECONDS",
    "measure_bandwidth",
    "pace_factor",
    "step_bytes_per_param",
]

DEFAULT_PROBE_SECONDS = 0.5
DEFAULT_PROBE_ELEMENTS = 1 << 24  # 235 MB of fp32 buffers: far past the caches
# Plain and software-prefetched loads: with the output written over the grads (in place), as the
# offload step writes it, streaming stores lose (benchmarks/README.md, "The probe").
VARIANTS = ("plain", "prefetched")


def step_bytes_per_param(precision: str, master: torch.dtype) -> float:
    """What the offload step moves per param: the master and both moments (8-bit: with their block scales)
    read and written, the bf16 grad read from its slot, and with an fp32 master the new bf16 weight written
    over it (a bf16 master is the weight: it goes up as it is)."""
    scales = 0.0
    if state_dtype(precision) == torch.uint8:
        scales = 2 * math.prod(scales_shape(BLOCK)) * SCALES_DTYPE.itemsize / BLOCK  # read and written
    moments = 2 * 2 * state_dtype(precision).itemsize
    weight = SLOT_DTYPE.itemsize if master == torch.float32 else 0
    return 2 * master.itemsize + moments + scales + SLOT_DTYPE.itemsize + weight


# Where the kernel's arithmetic, not memory, sets the pace: the step over the probe's pace as measured
# (benchmarks/bench_plan.py, 2^24 params, 2 cores, AMD EPYC: 1.94-2.32 and 3.71-4.16). The estimate includes it until
# the 8-bit kernel is memory-bound (benchmarks/README.md, "Where the 8-bit step's time goes").
COMPUTE_FACTOR = {("8bit", torch.float32): 2.0, ("8bit", torch.bfloat16): 3.8}


def pace_factor(precision: str, master: torch.dtype) -> float:
    """How much longer than memory alone allows the step takes, as measured (1 where memory sets the pace)."""
    return COMPUTE_FACTOR.get((precision, master), 1.0)


def measure_bandwidth(seconds: float = DEFAULT_PROBE_SECONDS, elements: int = DEFAULT_PROBE_ELEMENTS) -> float:
    """Bytes per second the probe moves in the fp32 configuration: the best variant's median over ``seconds``."""
    master = torch.zeros(elements, dtype=torch.float32)
    grads = torch.zeros(elements, dtype=SLOT_DTYPE)
    moments = [torch.zeros(elements, dtype=state_dtype("fp32")) for _ in range(2)]
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    deadline = time.perf_counter() + seconds
    rounds = 0
    while rounds < 4 or (time.perf_counter() < deadline and rounds < 1000):
        for variant in VARIANTS:
            start = time.perf_counter()
            ops.bandwidth_probe([master], [grads], [moments[0]], [moments[1]], bf16_outs=[grads], variant=variant)
            if rounds:  # the first round touches the pages
                times[variant].append(time.perf_counter() - start)
        rounds += 1
    best = min(statistics.median(t) for t in times.values())
    return step_bytes_per_param("fp32", torch.float32) * elements / best
