"""Layout of one param group in a flat buffer: offsets, buckets, and the slice a rank owns.

Each param starts on an ALIGN-element boundary (128 bytes in bf16, a cache line or two in
every dtype the host buffers use), so the kernel's per-thread splits never share a line.
Padding elements hold zero grads, so Adam keeps them at zero forever.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ALIGN", "Bucket", "FlatLayout"]

ALIGN = 64


def _align_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Bucket:
    """Params ``first..last-1`` of the group, occupying flat elements ``[start, end)``."""

    start: int
    end: int
    first: int
    last: int

    @property
    def numel(self) -> int:
        return self.end - self.start


class FlatLayout:
    """Where each param of a group lives in the flat buffer, its buckets and this rank's shard.

    The shard is ``[shard_offset, shard_offset + shard_numel)``: the part of the flat buffer
    whose master weights and states this process holds and steps. With one process it is the
    whole buffer; ZeRO partitioning gives rank r the r-th of ``world_size`` equal aligned slices.
    """

    def __init__(self, shapes: list[torch.Size], bucket_size: int, *, world_size: int = 1, rank: int = 0) -> None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        self.shapes = shapes
        self.numels = [s.numel() for s in shapes]
        self.offsets: list[int] = []
        end = 0
        for n in self.numels:
            self.offsets.append(end)
            end = _align_up(end + n, ALIGN)
        self.numel = _align_up(max(end, 1), ALIGN * world_size)
        self.shard_numel = self.numel // world_size
        self.shard_offset = rank * self.shard_numel
        self.buckets = self._partition(bucket_size)
        self.bucket_of = [0] * len(shapes)
        for b, bucket in enumerate(self.buckets):
            for i in range(bucket.first, bucket.last):
                self.bucket_of[i] = b

    def _partition(self, bucket_size: int) -> list[Bucket]:
        # Consecutive params up to bucket_size elements (a bigger param gets a bucket alone);
        # buckets tile [0, numel) so that every element, padding included, goes down once.
        count = len(self.numels)
        ends = [*self.offsets[1:], self.numel]
        buckets: list[Bucket] = []
        first = 0
        for i in range(1, count):
            if ends[i] - self.offsets[first] > bucket_size:
                buckets.append(Bucket(self.offsets[first], self.offsets[i], first, i))
                first = i
        buckets.append(Bucket(self.offsets[first], self.numel, first, count))
        return buckets

    def param_range(self, i: int) -> tuple[int, int]:
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def shard_part(self, start: int, end: int) -> tuple[int, int] | None:
        """``[start, end)`` clipped to this rank's shard, in shard coordinates (None if disjoint)."""
        lo = max(start, self.shard_offset)
        hi = min(end, self.shard_offset + self.shard_numel)
        if lo >= hi:
            return None
        return lo - self.shard_offset, hi - self.shard_offset
