"""The plan: for each state precision and master dtype, the bytes the offload optimizer holds, whether they fit,
and the CPU step's estimated time.

Host bytes are counted as the optimizer allocates them: each param group laid out by the
optimizer's own ``FlatLayout`` (params on 256-element boundaries), times the dtypes of its host
buffers. Device bytes are the model's bf16 weights and the most the optimizer's grad buckets take
at once: the buckets being packed (``OPEN_BUCKETS``) and those on their way down
(``max_inflight_buckets``), each as large as the largest bucket. Activations are the user's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._precision import STATE_PRECISIONS, state_dtype
from ..offload.layout import FlatLayout
from ..offload.link import SLOT_DTYPE
from ..offload.options import DEFAULT_BUCKET_SIZE, check_options
from ..offload.params import WEIGHTS_DTYPE
from ..offload.schedule import OPEN_BUCKETS
from ..offload.share import buckets_for, checked_fraction
from ..offload.store import SCALES_DTYPE, scales_shape
from ..offload.window import ACCUMULATOR_DTYPE
from ..quant8 import BLOCK
from .models import ModelLike, ModelSpec, model_spec
from .probe import DEFAULT_PROBE_SECONDS, measure_bandwidth, pace_factor, step_bytes_per_param
from .sizes import PlanError, detect_gpu_memory, detect_host_memory, parse_bytes, parse_count

__all__ = ["MASTER_DTYPES", "Row", "plan"]

MASTER_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Row:
    """One configuration of the offload optimizer on one model. Byte fields are named as in ``memory_stats()``."""

    state_precision: str  # "fp32", "bf16" or "8bit"
    master_dtype: str  # "fp32" or "bf16"
    overlap: str
    accumulation: bool  # whether host_bytes includes the fp32 accumulator of gradient accumulation
    params: int  # trained elements, tied params once
    host_bytes: int  # master + state + pinned + accumulator + overlap
    master_bytes: int
    state_bytes: int  # both moments, with their block scales when 8-bit
    pinned_bytes: int  # the bf16 buffer grads come down and weights go up through
    accumulator_bytes: int
    overlap_bytes: int  # the spare bf16 buffer of overlap="backward"
    device_bytes: int  # weights_bytes + grad_buffer_bytes; activations not included
    weights_bytes: int  # bf16 weights of every param, frozen ones too
    grad_buffer_bytes: int  # the most the optimizer's grad buckets take on the device at once
    host_memory: int | None  # the budgets the row was judged against (None: unknown)
    gpu_memory: int | None
    step_bytes_per_param: float  # moved by one CPU step
    step_seconds: float | None  # an estimate of the host's part (None: no probe was run)
    device_share: float = 0.0  # of the elements, stepped on the device (device_fraction, to whole buckets)
    device_state_bytes: int = 0  # their state in device memory, all resident (in device_bytes); streamed, per step
    device_grads_bytes: int = 0  # their grads, kept on the device until the step (in device_bytes)

    @property
    def host_bytes_per_param(self) -> float:
        return self.host_bytes / self.params

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_memory is None else self.host_bytes <= self.host_memory

    @property
    def gpu_fits(self) -> bool | None:
        return None if self.gpu_memory is None else self.device_bytes <= self.gpu_memory

    @property
    def gpu_left(self) -> int | None:
        """GPU memory left for activations, the CUDA context and the allocator's cache."""
        return None if self.gpu_memory is None else self.gpu_memory - self.device_bytes

    @property
    def fits(self) -> bool | None:
        """False where either side does not fit; None where one side is unknown and the other fits."""
        sides = (self.host_fits, self.gpu_fits)
        return False if False in sides else None if None in sides else True


def plan(
    model: ModelLike,
    gpu_memory: int | str | None = None,
    host_memory: int | str | None = None,
    *,
    bucket_size: int | str = DEFAULT_BUCKET_SIZE,
    max_inflight_buckets: int = 2,
    overlap: str = "none",
    accumulation: bool = False,
    probe_seconds: float = DEFAULT_PROBE_SECONDS,
    bandwidth: float | None = None,
    device_fraction: float = 0.0,
) -> list[Row]:
    """The table: one ``Row`` per state precision and master dtype, for the offload optimizer built on ``model``
    with these options (one process; ``overlap`` and ``accumulation`` add their host buffers).

    ``model``: a parameter count (``7_000_000_000`` or ``"7B"``), a config.json path, an ``nn.Module`` (the
    meta device will do) or the params / param groups the optimizer would get. ``gpu_memory`` and
    ``host_memory`` (bytes, or sizes such as ``"80GiB"``) are detected where None. The step time is an
    estimate from a bandwidth probe of ``probe_seconds`` (0: none), or from ``bandwidth`` in bytes/s.
    ``device_fraction``: the share the device steps (its state and kept grads counted on the device, all
    resident; the host's step estimated on the rest).
    """
    bucket_size = parse_count(bucket_size, "bucket_size")
    try:
        device_fraction = float(checked_fraction(device_fraction))
    except ValueError as error:
        raise PlanError(f"cpu_adam.plan: {error} ('auto' is planned as training runs)") from None
    try:
        check_options(torch.float32, False, max_inflight_buckets, overlap)
    except ValueError as error:
        raise PlanError(f"cpu_adam.plan: {error}") from None
    spec = model_spec(model)
    gpu = budget(gpu_memory, "gpu_memory", detect_gpu_memory)
    host = budget(host_memory, "host_memory", detect_host_memory)
    if bandwidth is None and probe_seconds > 0:
        bandwidth = measure_bandwidth(probe_seconds)
    groups = _layouts(spec, bucket_size)
    elements = sum(n for n, _ in groups)
    on_device = _device_elements(spec, bucket_size, device_fraction)
    weights = (spec.params + spec.frozen) * WEIGHTS_DTYPE.itemsize
    largest = max(bucket for _, bucket in groups)
    grad_buffers = (OPEN_BUCKETS + max_inflight_buckets) * largest * SLOT_DTYPE.itemsize
    rows = []
    for precision in STATE_PRECISIONS:
        for master_name, master in MASTER_DTYPES.items():
            host_parts = _host_bytes([n for n, _ in groups], master, precision, overlap, accumulation)
            moved = step_bytes_per_param(precision, master)
            device_state = _device_state_bytes(on_device, master, precision)
            device_grads = on_device * (SLOT_DTYPE.itemsize + (ACCUMULATOR_DTYPE.itemsize if accumulation else 0))
            rows.append(
                Row(
                    precision,
                    master_name,
                    overlap,
                    accumulation,
                    spec.params,
                    sum(host_parts),
                    *host_parts,
                    weights + grad_buffers + device_state + device_grads,
                    weights,
                    grad_buffers,
                    host,
                    gpu,
                    moved,
                    _host_step(moved, elements - on_device, bandwidth, precision, master),
                    on_device / elements,
                    device_state,
                    device_grads,
                )
            )
    return rows


def _host_step(
    moved: float, elements: int, bandwidth: float | None, precision: str, master: torch.dtype
) -> float | None:
    """Seconds of the host's step: its bytes at the probe's pace, times what the arithmetic adds where it sets it."""
    return None if bandwidth is None else moved * elements / bandwidth * pace_factor(precision, master)


def _device_elements(spec: ModelSpec, bucket_size: int, fraction: float) -> int:
    """Elements of the buckets the device steps, as the optimizer picks them (each group's first buckets)."""
    if fraction == 0:
        return 0
    if spec.count is None:
        layouts = [FlatLayout([torch.Size(s) for s in g], bucket_size) for g in spec.groups if g]
    else:  # params of a bucket each, then the rest (as _layouts counts them)
        full, rest = divmod(spec.count, bucket_size)
        layouts = [FlatLayout([torch.Size([bucket_size])] * full + [torch.Size([rest])] * bool(rest), bucket_size)]
    return sum(layouts[g].pieces[b].numel for g, b in buckets_for(layouts, fraction))


def _device_state_bytes(elements: int, master: torch.dtype, precision: str) -> int:
    """The state of the device's share: the master where it is fp32 (a bf16 master is the weights), the moments."""
    states = 2 * elements * state_dtype(precision).itemsize
    if state_dtype(precision) == torch.uint8:
        states += math.prod(scales_shape(-(-elements // BLOCK) * BLOCK)) * SCALES_DTYPE.itemsize
    return (elements * master.itemsize if master == torch.float32 else 0) + states


def _layouts(spec: ModelSpec, bucket_size: int) -> list[tuple[int, int]]:
    """(host elements, largest bucket's elements) of each param group, as the optimizer's FlatLayout lays it out."""
    if spec.count is None:
        layouts = [FlatLayout([torch.Size(s) for s in g], bucket_size) for g in spec.groups if g]
        return [(layout.shard_numel, max(b.numel for b in layout.buckets)) for layout in layouts]
    # A count: params of a bucket each, then the rest. Each is a bucket alone, so their layouts add up,
    # without listing a billion-param model's thousands of them.
    full, rest = divmod(spec.count, bucket_size)
    parts = [(size, copies) for size, copies in ((bucket_size, full), (rest, 1)) if size and copies]
    numels = [(FlatLayout([torch.Size([size])], bucket_size).numel, copies) for size, copies in parts]
    return [(sum(numel * copies for numel, copies in numels), max(numel for numel, _ in numels))]


def _host_bytes(
    groups: list[int], master: torch.dtype, precision: str, overlap: str, accumulation: bool
) -> tuple[int, int, int, int, int]:
    """(master, state, pinned, accumulator, overlap) bytes of param groups of these host elements, as the
    optimizer allocates them."""
    n = sum(groups)
    states = 2 * n * state_dtype(precision).itemsize
    if state_dtype(precision) == torch.uint8:  # as the store allocates block scales, per group
        states += sum(math.prod(scales_shape(g)) for g in groups) * SCALES_DTYPE.itemsize
    return (
        n * master.itemsize,
        states,
        n * SLOT_DTYPE.itemsize,
        n * ACCUMULATOR_DTYPE.itemsize if accumulation else 0,
        n * SLOT_DTYPE.itemsize if overlap == "backward" else 0,
    )


def budget(value: int | str | None, what: str, detect) -> int | None:
    """Bytes given (a size as people write it), else what ``detect`` finds (None where it finds nothing)."""
    if value is not None:
        return parse_bytes(value, what)
    found = detect()
    return None if found is None else found[0]
