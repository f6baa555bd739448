"""The process group the offload optimizer shards over, and the collectives it runs on it.

Everything goes through torch.distributed (NCCL on GPUs, gloo on CPUs). Each call runs on the
caller's current stream: the optimizer calls them on its side stream, so NCCL waits for the
work queued there and the side stream waits for NCCL before the copies that follow.

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

__all__ = ["ShardComm"]

# torch 2.13 renamed the flat-tensor collectives; older versions only have the old names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class ShardComm:
    """Rank, world size and the collectives of one process group, with clear errors."""

    def __init__(self, group: Any, device: torch.device) -> None:
        if not (dist.is_available() and isinstance(group, dist.ProcessGroup)):
            raise TypeError(
                f"cpu_adam.OffloadOptimizer: process_group must be a torch.distributed ProcessGroup "
                f"(e.g. torch.distributed.group.WORLD after init_process_group), got {type(group).__name__}"
            )
        self.group = group
        self.device = device
        self.rank = self.check_alive()
        if self.rank < 0:
            raise ValueError("cpu_adam.OffloadOptimizer: this process is not a member of process_group")
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group))
        self.native_reduce_scatter = self._probe_reduce_scatter()

    def check_alive(self) -> int:
        """This process's rank in the group; a clear error when the group is gone."""
        try:
            return dist.get_rank(self.group)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: the process group is not usable ({e}). It was destroyed, or never "
                "initialized: keep it alive (dist.destroy_process_group only after training) and pass a live group"
            ) from e

    def _call(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        self.check_alive()
        try:
            fn(*args, group=self.group, **kwargs)
        except (RuntimeError, ValueError) as e:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: {what} over the process group failed on rank {self.rank} of "
                f"{self.world_size} ({type(e).__name__}: {e}). Check that no rank has exited or destroyed the "
                "group, and that every rank runs the same backward passes and step() calls"
            ) from e

    def _probe_reduce_scatter(self) -> bool:
        # Deterministic per backend and torch version, so every rank takes the same path.
        probe = torch.zeros(self.world_size, dtype=torch.bfloat16, device=self.device)
        try:
            _reduce_scatter(probe[:1].clone(), probe, group=self.group)
        except (RuntimeError, NotImplementedError, ValueError):
            return False
        return True

    def reduce_scatter(self, out: Tensor, inp: Tensor) -> None:
        """``out`` = this rank's 1/N of the sum over ranks of ``inp`` (contiguous pieces in rank order)."""
        if self.native_reduce_scatter:
            self._call("reduce-scatter of a grad bucket", _reduce_scatter, out, inp)
            return
        # Fallback for backends without reduce-scatter: the whole bucket is summed everywhere
        # (N times the bytes) and each rank keeps its piece. The input is scratch, so in place.
        self._call("all-reduce of a grad bucket (reduce-scatter fallback)", dist.all_reduce, inp)
        n = out.numel()
        out.copy_(inp[self.rank * n : (self.rank + 1) * n])

    def all_gather(self, out: Tensor, inp: Tensor) -> None:
        """``out`` = every rank's ``inp`` back to back; ``inp`` may be this rank's piece of ``out``."""
        self._call("all-gather of the updated weights", _all_gather, out, inp)

    def all_reduce_sum(self, t: Tensor) -> None:
        self._call("all-reduce of the grad norm", dist.all_reduce, t)

    def all_reduce_max(self, t: Tensor) -> None:
        self._call("all-reduce of which params got grads", dist.all_reduce, t, op=dist.ReduceOp.MAX)

    def broadcast_from_rank0(self, t: Tensor, what: str = "rank 0's weights") -> None:
        self._call(f"broadcast of {what}", dist.broadcast, t, src=dist.get_global_rank(self.group, 0))

    def check_same(self, what: str, value: Any, fix: str) -> None:
        """Raises unless every rank passes an equal ``value`` (compared by a hash, in one all-reduce)."""
        digest = int.from_bytes(hashlib.sha256(repr(value).encode()).digest()[:7], "little")
        t = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        self._call(f"the check of {what}", dist.all_reduce, t, op=dist.ReduceOp.MAX)
        if int(t[0]) != -int(t[1]):
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: the ranks of the process group disagree on {what} (rank {self.rank} "
                f"of {self.world_size}); {fix}"
            )
