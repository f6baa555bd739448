"""Layout of one param group in a flat buffer: offsets, buckets, the pieces a rank owns, and the
conversions between a rank's shard and the one-process layout that full state dicts use.

Each param starts on an ALIGN-element boundary (128 bytes in bf16, a cache line or two in
every dtype the host buffers use), so the kernel's per-thread splits never share a line.
Padding elements hold zero grads, so Adam keeps them at zero forever.

With ZeRO over ``world_size`` ranks every bucket is padded to a multiple of ALIGN * world_size
and split into ``world_size`` equal pieces; rank r owns piece r of every bucket. So a bucket's
reduce-scatter and all-gather see equal, aligned sizes and can start as soon as that bucket is
ready (a rank owning one contiguous 1/N of the group would need every bucket's grads before
its first collective). The rank's host buffers are its pieces back to back: the piece of the
bucket starting at flat offset s lies at host offset s / world_size.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["ALIGN", "Bucket", "FlatLayout", "canonical_offsets", "check_shard", "full_to_shard", "shards_to_full"]

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


@dataclass(frozen=True)
class Piece:
    """This rank's part of a bucket: ``numel`` elements at ``flat`` in the flat buffer, ``host`` in its shard."""

    flat: int
    host: int
    numel: int


class FlatLayout:
    """Where each param of a group lives in the flat buffer, its buckets and this rank's pieces.

    With one process the single piece of each bucket is the whole bucket and the shard is the
    whole buffer; that layout (``world_size=1``) is also the one full state dicts are stored in.
    Bucket membership does not depend on ``world_size``, only the padding between buckets does.
    """

    def __init__(self, shapes: list[torch.Size], bucket_size: int, *, world_size: int = 1, rank: int = 0) -> None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.shapes = shapes
        self.numels = [s.numel() for s in shapes]
        self.world_size, self.rank = world_size, rank
        self.offsets: list[int] = []
        self.buckets: list[Bucket] = []
        end = 0
        spans = self._partition(bucket_size)
        for b, (first, last) in enumerate(spans):
            start = end
            for i in range(first, last):
                self.offsets.append(end)
                end = _align_up(end + self.numels[i], ALIGN)
            if b == len(spans) - 1:
                end = max(end, 1)  # an all-empty group still gets one aligned block
            end = _align_up(end, ALIGN * world_size)
            self.buckets.append(Bucket(start, end, first, last))
        self.numel = end
        self.shard_numel = self.numel // world_size
        self.pieces = [
            Piece(b.start + rank * (b.numel // world_size), b.start // world_size, b.numel // world_size)
            for b in self.buckets
        ]
        self.bucket_of = [0] * len(shapes)
        for b, bucket in enumerate(self.buckets):
            for i in range(bucket.first, bucket.last):
                self.bucket_of[i] = b

    def _partition(self, bucket_size: int) -> list[tuple[int, int]]:
        # Consecutive params up to bucket_size elements (a bigger param gets a bucket alone),
        # measured with ALIGN padding only, so every world size groups the params alike.
        sizes = [_align_up(n, ALIGN) for n in self.numels]
        spans: list[tuple[int, int]] = []
        first, span = 0, sizes[0] if sizes else 0
        for i in range(1, len(sizes)):
            if span + sizes[i] > bucket_size:
                spans.append((first, i))
                first, span = i, 0
            span += sizes[i]
        spans.append((first, len(sizes)))
        return spans

    def param_range(self, i: int) -> tuple[int, int]:
        return self.offsets[i], self.offsets[i] + self.numels[i]

    def segments(self, lo: int, hi: int, host: int) -> list[tuple[int, int, int, int]]:
        """(param, flat start, flat end, host start) of each param's part in flat ``[lo, hi)``.

        ``host`` is where flat element ``lo`` lies in the host buffers; padding is left out.
        """
        out = []
        for i in range(max(0, bisect.bisect_right(self.offsets, lo) - 1), len(self.offsets)):
            start, end = self.param_range(i)
            if start >= hi:
                break
            start, end = max(start, lo), min(end, hi)
            if start < end:
                out.append((i, start, end, host + start - lo))
        return out


_RESHARD_FIX = (
    "load each rank's own shard on the same number of ranks with the same bucket_size, or consolidate the "
    "shards with cpu_adam.distributed.consolidate_state_dict(...) and load the full state dict, which any "
    "number of ranks can load"
)


def _canonical(shapes: list[torch.Size]) -> FlatLayout:
    # Offsets of the one-process layout do not depend on the bucket size: one bucket will do.
    return FlatLayout(shapes, 1 << 62)


def canonical_offsets(shapes: list[torch.Size]) -> list[int]:
    """Each param's offset in the one-process layout, which no world or bucket size changes."""
    return _canonical(shapes).offsets


def full_to_shard(full: Tensor, layout: FlatLayout) -> Tensor:
    """This rank's shard (its pieces back to back) of a tensor in the one-process layout."""
    canonical = _canonical(layout.shapes)
    if full.numel() != canonical.numel:
        raise ValueError(f"a full state tensor has {full.numel()} elements, the layout needs {canonical.numel}")
    if layout.world_size == 1 and layout.offsets == canonical.offsets and layout.numel == canonical.numel:
        return full
    flat = full.new_zeros(layout.numel)
    for i in range(len(layout.shapes)):
        lo, hi = layout.param_range(i)
        c_lo, c_hi = canonical.param_range(i)
        flat[lo:hi] = full[c_lo:c_hi]
    return torch.cat([flat[p.flat : p.flat + p.numel] for p in layout.pieces])


def shards_to_full(shards: list[Tensor], layouts: list[FlatLayout]) -> Tensor:
    """Inverse of ``full_to_shard``: the ranks' shards, in rank order, as one tensor in the one-process layout."""
    zero_layout = layouts[0]
    flat = shards[0].new_zeros(zero_layout.numel)
    for shard, layout in zip(shards, layouts):
        for p in layout.pieces:
            flat[p.flat : p.flat + p.numel] = shard[p.host : p.host + p.numel]
    canonical = _canonical(zero_layout.shapes)
    full = shards[0].new_zeros(canonical.numel)
    for i in range(len(zero_layout.shapes)):
        lo, hi = zero_layout.param_range(i)
        c_lo, c_hi = canonical.param_range(i)
        full[c_lo:c_hi] = flat[lo:hi]
    return full


def check_shard(zero: dict[str, Any], rank: int, world_size: int, bucket_size: int) -> None:
    """Raises a ValueError naming the mismatch when a shard was not saved by this rank's place in this layout."""
    saved = (zero["rank"], zero["world_size"], zero["bucket_size"])
    if saved != (rank, world_size, bucket_size):
        raise ValueError(
            f"cpu_adam.OffloadOptimizer.load_state_dict: the state dict is the shard of rank {zero['rank']} of "
            f"{zero['world_size']} (bucket_size {zero['bucket_size']}), but this optimizer is rank {rank} of "
            f"{world_size} (bucket_size {bucket_size}); {_RESHARD_FIX}"
        )
