"""The plan for FSDP2 with ``CPUOffloadPolicy`` and ``CPUAdam`` stepping the shards: host RAM per rank and per
host, GPU memory per unit, and the CPU step's estimated time.

Host bytes are each rank's shards as FSDP2 lays them out (every param cut along its first dim into
``ceil(rows / world_size)``-row chunks), in the shards' dtype, for the weights and for the grads
that FSDP2 moves down into host RAM, plus CPUAdam's two moments (8-bit: codes and a float32 scale
per block of the whole param that the shard touches, as ``cpu_adam.fsdp2.places`` lays them out); the
rank holding the most. The GPU holds, per unit, its
weights all-gathered in the compute dtype, the next unit's gathered ahead (FSDP2's prefetch) and,
in backward, the unit's unsharded grads in the reduce dtype with their reduce-scattered shard:
an estimate from the largest unit, activations not included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .._precision import STATE_PRECISIONS, state_dtype
from ..fsdp2.places import local_blocks
from ..quant8 import BLOCK
from .models import ModelLike, ModelSpec, model_spec
from .probe import DEFAULT_PROBE_SECONDS, measure_bandwidth, pace_factor
from .sizes import PlanError, detect_gpu_memory, detect_host_memory, parse_count
from .table import budget

__all__ = ["FORWARD_FLOPS", "SHARD_DTYPES", "FSDP2Row", "exposed_behind", "fsdp2_step_bytes_per_param", "plan_fsdp2"]

# The forward's pace under FSDP2 with CPUOffloadPolicy on one H200: 1.32B params x 16,384 tokens x 2 flops in
# 127 ms (benchmarks/results/h200-2026-12-04): the gathers' copies up included.
FORWARD_FLOPS = 340e12

SHARD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SCALE_BYTES = 2 * torch.float32.itemsize  # per 256-element block: one scale per moment


@dataclass(frozen=True)
class FSDP2Row:
    """One configuration: the shards' dtype (bf16 shards are stepped with stochastic rounding) and the moments."""

    shard_dtype: str  # "fp32" or "bf16"
    state_precision: str  # "fp32", "bf16" or "8bit"
    world_size: int
    ranks_per_host: int
    params: int  # trained elements of the whole model
    rank_params: int  # elements of the shards of the rank holding the most bytes
    weight_bytes: int  # per rank: the sharded weights
    grad_bytes: int  # per rank: the sharded grads, in the shards' dtype
    state_bytes: int  # per rank: both moments (8-bit: with their block scales)
    unit_params: int | None  # elements of the largest unit (None: unknown)
    gpu_bytes: int | None  # the per-unit estimate of the GPU's peak, activations not included
    host_memory: int | None  # the budgets the row was judged against (None: unknown)
    gpu_memory: int | None
    step_bytes_per_param: float
    step_seconds: float | None  # every rank of a host stepping at once, sharing its memory bandwidth
    forward_seconds: float | None = None  # the GPU's forward, which a step behind it runs beside
    exposed_seconds: float | None = None  # of the step behind the forward: what the forward waits for it

    @property
    def hidden_seconds(self) -> float | None:
        if self.step_seconds is None or self.exposed_seconds is None:
            return None
        return self.step_seconds - self.exposed_seconds

    @property
    def rank_bytes(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.state_bytes

    @property
    def host_bytes(self) -> int:
        """The ranks of one host together."""
        return self.rank_bytes * self.ranks_per_host

    @property
    def host_bytes_per_param(self) -> float:
        return self.rank_bytes / self.rank_params

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_memory is None else self.host_bytes <= self.host_memory

    @property
    def gpu_fits(self) -> bool | None:
        return None if self.gpu_memory is None or self.gpu_bytes is None else self.gpu_bytes <= self.gpu_memory

    @property
    def gpu_left(self) -> int | None:
        return None if self.gpu_memory is None or self.gpu_bytes is None else self.gpu_memory - self.gpu_bytes

    @property
    def fits(self) -> bool | None:
        sides = (self.host_fits, self.gpu_fits)
        return False if False in sides else None if None in sides else True


def fsdp2_step_bytes_per_param(shard_dtype: str, precision: str) -> float:
    """What CPUAdam's step over a shard moves per param: the weight and both moments read and written (8-bit: with
    their block scales), the grad read. No bf16 copy: the shard is the weight FSDP2 gathers."""
    shard = SHARD_DTYPES[shard_dtype].itemsize
    scales = 2 * SCALE_BYTES / BLOCK if state_dtype(precision) == torch.uint8 else 0.0
    return 2 * shard + shard + 2 * 2 * state_dtype(precision).itemsize + scales


def plan_fsdp2(
    model: ModelLike,
    world_size: int,
    gpu_memory: int | str | None = None,
    host_memory: int | str | None = None,
    *,
    ranks_per_host: int | None = None,
    unit_params: int | str | None = None,
    compute_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    probe_seconds: float = DEFAULT_PROBE_SECONDS,
    bandwidth: float | None = None,
    tokens: int = 16384,
    forward_seconds: float | None = None,
) -> list[FSDP2Row]:
    """One ``FSDP2Row`` per shard dtype and moment precision, for ``model`` sharded over ``world_size`` ranks.

    ``ranks_per_host``: the ranks sharing one host's RAM and memory bandwidth (default: all of them, at most 8).
    ``unit_params``: the largest FSDP2 unit's elements (default: from a config.json's layers and embeddings;
    unknown for a bare count). ``compute_dtype`` / ``reduce_dtype``: ``MixedPrecisionPolicy``'s ``param_dtype``
    and ``reduce_dtype`` (torchtitan's defaults). ``host_memory`` is one host's, ``gpu_memory`` one GPU's.
    ``tokens``: each rank's tokens a step, for the forward's time at ``FORWARD_FLOPS`` (or ``forward_seconds``),
    beside which a step behind the forward runs (``exposed_behind``).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"cpu_adam.plan: the world size must be a whole number of ranks >= 1, got {world_size!r}")
    ranks_per_host = min(world_size, 8) if ranks_per_host is None else ranks_per_host
    if isinstance(ranks_per_host, bool) or not isinstance(ranks_per_host, int) or not ranks_per_host >= 1:
        raise PlanError(f"cpu_adam.plan: ranks per host must be a whole number >= 1, got {ranks_per_host!r}")
    ranks_per_host = min(ranks_per_host, world_size)
    spec = model_spec(model)
    ranks = _rank_shards(spec, world_size)
    unit = parse_count(unit_params, "unit_params") if unit_params is not None else max(spec.units, default=None)
    gpu = budget(gpu_memory, "gpu_memory", detect_gpu_memory)
    host = budget(host_memory, "host_memory", detect_host_memory)
    if bandwidth is None and probe_seconds > 0:
        bandwidth = measure_bandwidth(probe_seconds)
    if forward_seconds is None:
        forward_seconds = 2 * spec.params * tokens / FORWARD_FLOPS
    shares = _unit_shares(spec)
    rows = []
    for shard_name, shard_dtype in SHARD_DTYPES.items():
        for precision in STATE_PRECISIONS:
            scales = SCALE_BYTES if state_dtype(precision) == torch.uint8 else 0
            per_rank = [
                (n * (2 * shard_dtype.itemsize + 2 * state_dtype(precision).itemsize) + b * scales, n, b)
                for n, b in ranks
            ]
            _, elements, blocks = max(per_rank)
            moved = fsdp2_step_bytes_per_param(shard_name, precision)
            seconds = None
            if bandwidth is not None:
                seconds = moved * elements * ranks_per_host / bandwidth * pace_factor(precision, shard_dtype)
            rows.append(
                FSDP2Row(
                    shard_name,
                    precision,
                    world_size,
                    ranks_per_host,
                    spec.params,
                    elements,
                    elements * shard_dtype.itemsize,
                    elements * shard_dtype.itemsize,
                    2 * elements * state_dtype(precision).itemsize + blocks * scales,
                    unit,
                    None if unit is None else _unit_gpu_bytes(unit, world_size, compute_dtype, reduce_dtype),
                    host,
                    gpu,
                    moved,
                    seconds,
                    forward_seconds,
                    None if seconds is None else exposed_behind(seconds, forward_seconds, shares),
                )
            )
    return rows


def exposed_behind(step_seconds: float, forward_seconds: float, shares: list[float]) -> float:
    """What a forward waits for a step behind it: unit k's forward begins once units 0..k are stepped, in the
    order it gathers them, each unit's step and forward taking its share (``shares``, in that order) of each.
    The forward ends at the latest of (steps through k) + (forwards from k on); less the forward itself."""
    stepped, left, latest = 0.0, forward_seconds, 0.0
    for share in shares:
        stepped += step_seconds * share
        latest = max(latest, stepped + left)
        left -= forward_seconds * share
    return latest - forward_seconds


def _unit_shares(spec: ModelSpec) -> list[float]:
    """Each unit's share of the params in the order a forward gathers them (a config's embedding, layers and head);
    for a bare count, 32 equal layers."""
    units = list(spec.units) or [1] * 32
    return [u / sum(units) for u in units]


def _rank_shards(spec: ModelSpec, world_size: int) -> list[tuple[int, int]]:
    """(elements, 8-bit scale blocks) of each rank's shards: FSDP2's ``ceil(rows / world_size)``-row chunks of
    each param (a bare count: one flat param), the blocks as ``cpu_adam.fsdp2.places`` lays them out."""
    shapes = [(spec.count,)] if spec.count is not None else [s or (1,) for g in spec.groups for s in g]
    ranks = []
    for rank in range(world_size):
        elements = blocks = 0
        for shape in shapes:
            row = math.prod(shape[1:])
            chunk = math.ceil(shape[0] / world_size)
            rows = max(0, min(chunk, shape[0] - rank * chunk))
            elements += rows * row
            blocks += local_blocks(rows * row, rank * chunk * row) if rows else 0
        ranks.append((elements, blocks))
    return ranks


def _unit_gpu_bytes(unit: int, world_size: int, compute: torch.dtype, reduce: torch.dtype) -> int:
    """The unit's gathered weights and the next unit's (prefetched, taken as large), its unsharded grads and
    their reduce-scattered shard."""
    return 2 * unit * compute.itemsize + unit * reduce.itemsize + math.ceil(unit / world_size) * reduce.itemsize
