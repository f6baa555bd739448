"""The ranks the offload optimizer shards over, and the collectives between them.

A single process is a world of one: its reduce-scatter and all-gather hand their input back
(its piece of a bucket is the whole bucket) and its all-reduces, broadcasts and agreement checks
do nothing, so the rest of the optimizer has one path. A process group (NCCL on GPUs, gloo on
CPUs) is ``GroupWorld``. Each collective runs on the caller's current stream: the optimizer calls
them on its side stream, so NCCL waits for the work queued there and the copies after it wait
for NCCL.

torch.distributed quietly skips a collective on a group this process is no longer part of (a
destroyed group), which would leave the grads unreduced: every call first checks that the group
is still registered, and a failing call is re-raised with the rank and what to check.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .._threads import check_threads

__all__ = ["GroupWorld", "World", "world_of"]

# torch 2.13 renamed the flat-tensor collectives; older versions only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class World:
    """A single process: rank 0 of 1."""

    rank = 0
    size = 1

    def check_alive(self) -> None:
        """Raises a clear error when the ranks can no longer talk."""

    def reduce_scatter(self, bucket: Tensor, into: Tensor | None = None) -> Tensor:
        """This rank's piece of the sum over the ranks of ``bucket`` (into ``into`` where a new tensor is needed)."""
        return bucket

    def all_gather(self, piece: Tensor, into: Tensor | None = None) -> Tensor:
        """Every rank's ``piece`` back to back (in ``into``, of which ``piece`` may be this rank's part)."""
        return piece

    def sum_over_ranks(self, tensors: list[Tensor]) -> list[Tensor]:
        """Each host tensor summed over the ranks."""
        return tensors

    def max_over_ranks(self, values: list[int]) -> list[int]:
        """Each value's maximum over the ranks."""
        return values

    def broadcast_from_rank0(self, t: Tensor, what: str = "rank 0's weights") -> None:
        """``t`` as rank 0 holds it, in place."""

    def rank0_int(self, value: int, what: str) -> int:
        """Rank 0's ``value`` on every rank."""
        return value

    def rank0_values(self, t: Tensor) -> Tensor:
        """Rank 0's values of a param being handed over (from another device, in any float dtype)."""
        return t

    def check_same(self, what: str, value: Any, fix: str) -> None:
        """Raises unless every rank passes an equal ``value``."""


class GroupWorld(World):
    """The ranks of a ``torch.distributed`` process group, with clear errors."""

    def __init__(self, group: Any, device: torch.device) -> None:
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(
                f"cpu_adam.OffloadOptimizer: process_group must be a torch.distributed ProcessGroup "
                f"(e.g. torch.distributed.group.WORLD after init_process_group), got {type(group).__name__}"
            )
        self.group = group
        self.device = device
        self.rank = self._rank()
        if self.rank < 0:
            raise ValueError("cpu_adam.OffloadOptimizer: this process is not a member of process_group")
        self.size = dist.get_world_size(group)
        check_threads(self.rank, self.size)  # the ranks on a node share its cores
        self.native_reduce_scatter = self._probe_reduce_scatter()

    def _rank(self) -> int:
        try:
            return dist.get_rank(self.group)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: the process group is not usable ({e}). It was destroyed, or never "
                "initialized: keep it alive (dist.destroy_process_group only after training) and pass a live group"
            ) from e

    def check_alive(self) -> None:
        self._rank()

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self._rank()
        try:
            fn(*args, group=self.group, **kwargs)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: {what} over the process group failed on rank {self.rank} of "
                f"{self.size} ({type(e).__name__}: {e}). Check that no rank has exited or destroyed the "
                "group, and that every rank runs the same backward passes and step() calls"
            ) from e

    def _probe_reduce_scatter(self) -> bool:
        # Deterministic per backend and torch version, so every rank takes the same path.
        probe = torch.zeros(self.size, dtype=torch.bfloat16, device=self.device)
        try:
            _reduce_scatter(probe[:1].clone(), probe, group=self.group)
        except (RuntimeError, NotImplementedError, ValueError):
            return False
        return True

    def reduce_scatter(self, bucket: Tensor, into: Tensor | None = None) -> Tensor:
        if bucket.numel() == 0:
            return bucket
        out = torch.empty_like(bucket[: bucket.numel() // self.size]) if into is None else into
        if self.native_reduce_scatter:
            self._call("reduce-scatter of a grad bucket", _reduce_scatter, out, bucket)
            return out
        # Fallback for backends without reduce-scatter: the whole bucket is summed everywhere
        # (N times the bytes) and each rank keeps its piece. The input is scratch, so in place.
        self._call("all-reduce of a grad bucket (reduce-scatter fallback)", dist.all_reduce, bucket)
        n = out.numel()
        out.copy_(bucket[self.rank * n : (self.rank + 1) * n])
        return out

    def all_gather(self, piece: Tensor, into: Tensor | None = None) -> Tensor:
        out = piece.new_empty(piece.numel() * self.size) if into is None else into
        self._call("all-gather of the updated weights", _all_gather, out, piece)
        return out

    def sum_over_ranks(self, tensors: list[Tensor]) -> list[Tensor]:
        flat = torch.cat(tensors).to(self.device)
        self._call("all-reduce of the grad norm", dist.all_reduce, flat)
        return list(flat.cpu().split([t.numel() for t in tensors]))

    def max_over_ranks(self, values: list[int]) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        self._call("all-reduce of which params got grads", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        return t.tolist()

    def rank0_int(self, value: int, what: str) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self.broadcast_from_rank0(t, what)
        return int(t.item())

    def rank0_values(self, t: Tensor) -> Tensor:
        # On the device, in float32: the collectives' device and one dtype on every rank.
        values = t.to(device=self.device, dtype=torch.float32, copy=True)
        self.broadcast_from_rank0(values)
        return values

    def broadcast_from_rank0(self, t: Tensor, what: str = "rank 0's weights") -> None:
        self._call(f"broadcast of {what}", dist.broadcast, t, src=dist.get_global_rank(self.group, 0))

    def check_same(self, what: str, value: Any, fix: str) -> None:
        # Compared by a hash, in one all-reduce: max(d) == -max(-d) only when every rank's d is equal.
        digest = int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "little")
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        self._call(f"the check of {what}", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: the ranks of the process group disagree on {what} (rank {self.rank} "
                f"of {self.size}); {fix}"
            )


def world_of(process_group: Any | None, device: torch.device) -> World:
    """The world a ``process_group`` argument names: None is a single process."""
    return World() if process_group is None else GroupWorld(process_group, device)
