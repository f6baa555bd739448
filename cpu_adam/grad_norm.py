"""Clipping by the global grad norm inside the step (``CPUAdam(max_grad_norm=...)``): one pass reads
the grads for the norm, the kernel multiplies them by the factor as it steps (its ``grad_scale``), and
no pass rewrites them.

The arithmetic is ``torch.nn.utils.clip_grad_norm_``'s (norm_type 2): each tensor's norm (a DTensor's:
the root of the sum over its mesh's ranks of their shards' squared norms, as torch's ``_NormPartial``
reduces it), then the norm of those norms, so that the factor is torch's wherever the norms agree.
Each tensor's norm is taken in its own dtype, as torch takes it: a bfloat16 grad's is accumulated in
float32 and rounded to bfloat16 (2^-9 relative), which reads the grad at memory speed; asked for a
float32 result (``dtype=torch.float32``) torch widens the grad element by element, about 40 times
slower on the host (48M elements on 2 cores: 144 ms against 3.7). The norms are then combined in
float32.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .shards import is_dtensor, local

__all__ = ["check_max_grad_norm", "clip_factor", "total_norm"]


def check_max_grad_norm(owner: str, max_grad_norm: object) -> float | None:
    """None (no clipping) or a finite number > 0."""
    if max_grad_norm is None:
        return None
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
        raise TypeError(f"{owner}: max_grad_norm must be a number or None, got {max_grad_norm!r}")
    if not 0 < max_grad_norm < math.inf:
        raise ValueError(
            f"{owner}: max_grad_norm must be a finite number > 0 (or None: no clipping), got {max_grad_norm}"
        )
    return float(max_grad_norm)


def total_norm(grads: Sequence[Tensor]) -> Tensor:
    """The 2-norm of all ``grads`` together (float32, 0-dim), DTensor shards summed over their meshes:
    one all-reduce per mesh (FSDP2: one per step) where torch's clip_grad_norm_ makes one per tensor."""
    if not grads:
        return torch.tensor(0.0)
    by_mesh: dict[object, list[int]] = {}
    for i, g in enumerate(grads):
        by_mesh.setdefault(_reduced_over(g), []).append(i)
    norms = torch.empty(len(grads), dtype=torch.float32)
    for reduced_over, indices in by_mesh.items():
        norms[indices] = _norms([local(grads[i]) for i in indices], reduced_over)
    return torch.linalg.vector_norm(norms, 2)


def _norms(tensors: list[Tensor], reduced_over: tuple[object, tuple[int, ...]] | None) -> Tensor:
    """Each tensor's norm; for shards, that of the whole tensor: the root of the sum of the ranks' squares."""
    norms = torch.stack([norm.float() for norm in torch._foreach_norm(tensors, 2)])
    if reduced_over is None:
        return norms
    mesh, dims = reduced_over
    squares = (norms**2).to(mesh.device_type)  # a mesh of GPUs may have no CPU backend (NCCL alone)
    for dim in dims:
        dist.all_reduce(squares, group=mesh.get_group(dim))
    return squares.cpu() ** (1.0 / 2)


def clip_factor(norm: Tensor, max_grad_norm: float) -> float:
    """What ``clip_grad_norm_`` multiplies the grads by: max_norm / (norm + 1e-6), at most 1."""
    return float(torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0))


def _reduced_over(g: Tensor) -> tuple[object, tuple[int, ...]] | None:
    """The mesh and its dims over which a DTensor's shards add up (its Shard placements); None: a whole tensor."""
    if not is_dtensor(g):
        return None
    dims = tuple(i for i, placement in enumerate(g.placements) if placement.is_shard())
    return (g.device_mesh, dims) if dims else None
