"""The grads' norm for clipping inside CPUAdam's step: one pass reads the grads for it, the kernel multiplies
them by the factor as it steps (its ``grad_scale``), and no pass rewrites them.

The norm is the 2-norm of every grad together, a DTensor's shards summed over the ranks of its mesh, as
``torch.nn.utils.clip_grad_norm_`` defines it; the arithmetic is our own: each square exact in float64,
summed in a fixed order (``ops.squared_norms``), so that the norm is the same for any thread count and ISA
and as accurate as float64 allows, and one parallel pass over all grads at memory speed (torch's
per-tensor reductions over bf16 grads on the host took 0.36-0.45 s at 1.32B params on an H200's 16-core
host, where this pass reads the same 2.6 GB at the host's bandwidth). The factor is then clip_grad_norm_'s:
max_norm / (norm + 1e-6) in float32, at most 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import ops
from .places import is_dtensor, local

__all__ = ["total_norm"]


def total_norm(grads: Sequence[Tensor], group: object = None) -> Tensor:
    """The 2-norm of all ``grads`` together (float32, 0-dim; float64 inside), DTensor shards summed over their
    meshes, plain tensors over ``group`` (None: they are all of them): one all-reduce of one number per mesh or
    group (FSDP2: one per step) where torch's clip_grad_norm_ makes one per tensor."""
    by_mesh: dict[object, list[Tensor]] = {}
    for g in grads:
        plain = (group, None) if group is not None else None
        by_mesh.setdefault(_reduced_over(g) or plain, []).append(local(g))
    total = math.fsum(_squares(tensors, reduced_over) for reduced_over, tensors in by_mesh.items())
    return torch.tensor(math.sqrt(total), dtype=torch.float32)


def _squares(tensors: list[Tensor], reduced_over: tuple[object, tuple[int, ...] | None] | None) -> float:
    """The sum of the tensors' squares; for parts of a whole, over every rank that holds one."""
    local_squares = math.fsum(ops.squared_norms(tensors).tolist())  # exactly rounded: no order to depend on
    if reduced_over is None:
        return local_squares
    squares = torch.tensor([local_squares], dtype=torch.float64)
    mesh_or_group, dims = reduced_over
    if dims is None:  # a process group of plain tensors' parts
        dist.all_reduce(squares, group=mesh_or_group)
        return float(squares)
    squares = squares.to(mesh_or_group.device_type)  # a mesh of GPUs may have no CPU backend (NCCL alone)
    for dim in dims:
        dist.all_reduce(squares, group=mesh_or_group.get_group(dim))
    return float(squares.cpu())


def _reduced_over(g: Tensor) -> tuple[object, tuple[int, ...]] | None:
    """The mesh and its dims over which a DTensor's shards add up (its Shard placements); None: a whole tensor."""
    if not is_dtensor(g):
        return None
    dims = tuple(i for i, placement in enumerate(g.placements) if placement.is_shard())
    return (g.device_mesh, dims) if dims else None
