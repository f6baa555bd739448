"""Layout of one param group in a flat buffer: offsets, buckets, the pieces a rank owns, and the
conversions between a rank's shard and the one-process layout that full state dicts use.

Each param starts on an ALIGN-element boundary: an 8-bit state's scale block (256 elements), so
a block never holds two params and a kernel call can start at any param; and whole cache lines
in every dtype the host buffers use, so the kernel's per-thread splits never share a line.
Padding elements hold zero grads, so Adam keeps them at zero forever.

With ZeRO over ``world_size`` ranks every bucket is padded to a multiple of ALIGN * world_size
and split into ``world_size`` equal pieces; rank r owns piece r of every bucket. So a bucket's
reduce-scatter and all-gather see equal, aligned sizes and can start as soon as that bucket is
ready (a rank owning one contiguous 1/N of the group would need every bucket's grads before
its first collective). The rank's host buffers are its pieces back to back: the piece of the
bucket starting at flat offset s lies at host offset s / world_size. Pieces are cut on ALIGN
boundaries, so 8-bit states shard on whole scale blocks.

Block tensors (the 8-bit states' scales: ``per`` elements per entry of their last dimension)
convert between shard and full layouts like element tensors, block by block.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..quant8 import BLOCK

__all__ = [
    "ALIGN",
    "Bucket",
    "FlatLayout",
    "canonical_offsets",
    "check_shard",
    "from_legacy_layout",
    "full_numel",
    "full_to_shard",
    "shards_to_full",
]

ALIGN = BLOCK
LEGACY_ALIGN = 64  # the layout of state dicts in format 1


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

    def __init__(
        self, shapes: list[torch.Size], bucket_size: int, *, world_size: int = 1, rank: int = 0, align: int = ALIGN
    ) -> None:
        if bucket_size < 1:
            raise ValueError(f"bucket_size must be positive, got {bucket_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.shapes = shapes
        self.numels = [s.numel() for s in shapes]
        self.world_size, self.rank, self.align = world_size, rank, align
        self.offsets: list[int] = []
        self.buckets: list[Bucket] = []
        end = 0
        spans = self._partition(bucket_size)
        for b, (first, last) in enumerate(spans):
            start = end
            for i in range(first, last):
                self.offsets.append(end)
                end = _align_up(end + self.numels[i], align)
            if b == len(spans) - 1:
                end = max(end, 1)  # an all-empty group still gets one aligned block
            end = _align_up(end, align * world_size)
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
        # measured with alignment padding only, so every world size groups the params alike.
        sizes = [_align_up(n, self.align) for n in self.numels]
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

    def piece_segments(self, b: int) -> list[tuple[int, slice, slice]]:
        """(param, slice of its elements, slice of the host buffers) of this rank's piece of bucket ``b``."""
        piece = self.pieces[b]
        return [
            (i, slice(lo - self.offsets[i], hi - self.offsets[i]), slice(host, host + hi - lo))
            for i, lo, hi, host in self.segments(piece.flat, piece.flat + piece.numel, piece.host)
        ]

    def piece_params(self, b: int) -> tuple[list[int], list[slice]]:
        """The params of this rank's piece of bucket ``b``, and their slices of the piece."""
        piece = self.pieces[b]
        segments = self.piece_segments(b)
        return [i for i, _, _ in segments], [slice(h.start - piece.host, h.stop - piece.host) for _, _, h in segments]

    def host_slice(self, b: int) -> tuple[slice, slice] | None:
        """(slice of the whole bucket, slice of the host buffers) of this rank's piece of bucket ``b``."""
        piece = self.pieces[b]
        if piece.numel == 0:
            return None
        start = piece.flat - self.buckets[b].start
        return slice(start, start + piece.numel), slice(piece.host, piece.host + piece.numel)

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


def _canonical(shapes: list[torch.Size], align: int = ALIGN) -> FlatLayout:
    # Offsets of the one-process layout do not depend on the bucket size: one bucket will do.
    return FlatLayout(shapes, 1 << 62, align=align)


def full_numel(shapes: list[torch.Size], *, legacy: bool = False) -> int:
    """Elements of a full state tensor: the one-process layout's (format 1's with ``legacy``)."""
    return _canonical(shapes, LEGACY_ALIGN if legacy else ALIGN).numel


def canonical_offsets(shapes: list[torch.Size]) -> list[int]:
    """Each param's offset in the one-process layout, which no world or bucket size changes."""
    return _canonical(shapes).offsets


def _blocks(lo: int, hi: int, per: int) -> slice:
    """The entries of a tensor holding one entry per ``per`` elements that cover elements ``[lo, hi)``."""
    return slice(lo // per, (hi + per - 1) // per)


def _copy_params(dst: Tensor, dst_layout: FlatLayout, src: Tensor, src_layout: FlatLayout, per: int) -> None:
    for i in range(len(src_layout.shapes)):
        dst[..., _blocks(*dst_layout.param_range(i), per)] = src[..., _blocks(*src_layout.param_range(i), per)]


def full_to_shard(full: Tensor, layout: FlatLayout, *, per: int = 1) -> Tensor:
    """This rank's shard (its pieces back to back) of a tensor in the one-process layout.

    ``per``: elements per entry of the last dimension (the 8-bit states' block scales: BLOCK).
    """
    canonical = _canonical(layout.shapes)
    if full.shape[-1] != canonical.numel // per:
        raise ValueError(f"a full state tensor has {full.shape[-1]} entries, the layout needs {canonical.numel // per}")
    if layout.world_size == 1 and layout.offsets == canonical.offsets and layout.numel == canonical.numel:
        return full
    flat = full.new_zeros(*full.shape[:-1], layout.numel // per)
    _copy_params(flat, layout, full, canonical, per)
    return torch.cat([flat[..., _blocks(p.flat, p.flat + p.numel, per)] for p in layout.pieces], dim=-1)


def shards_to_full(shards: list[Tensor], layouts: list[FlatLayout], *, per: int = 1) -> Tensor:
    """Inverse of ``full_to_shard``: the ranks' shards, in rank order, as one tensor in the one-process layout."""
    zero_layout = layouts[0]
    lead = shards[0].shape[:-1]
    flat = shards[0].new_zeros(*lead, zero_layout.numel // per)
    for shard, layout in zip(shards, layouts):
        for p in layout.pieces:
            flat[..., _blocks(p.flat, p.flat + p.numel, per)] = shard[..., _blocks(p.host, p.host + p.numel, per)]
    canonical = _canonical(zero_layout.shapes)
    full = shards[0].new_zeros(*lead, canonical.numel // per)
    _copy_params(full, canonical, flat, zero_layout, per)
    return full


def from_legacy_layout(full: Tensor, shapes: list[torch.Size]) -> Tensor:
    """A full state tensor saved in format 1 (params on LEGACY_ALIGN boundaries) in today's one-process layout."""
    legacy = _canonical(shapes, LEGACY_ALIGN)
    if full.numel() != legacy.numel:
        raise ValueError(f"a full state tensor has {full.numel()} elements, the layout needs {legacy.numel}")
    out = full.new_zeros(_canonical(shapes).numel)
    _copy_params(out, _canonical(shapes), full, legacy, 1)
    return out


def check_shard(zero: dict[str, Any], rank: int, world_size: int, bucket_size: int) -> None:
    """Raises a ValueError naming the mismatch when a shard was not saved by this rank's place in this layout."""
    saved = (zero["rank"], zero["world_size"], zero["bucket_size"])
    if saved != (rank, world_size, bucket_size):
        raise ValueError(
            f"cpu_adam.OffloadOptimizer.load_state_dict: the state dict is the shard of rank {zero['rank']} of "
            f"{zero['world_size']} (bucket_size {zero['bucket_size']}), but this optimizer is rank {rank} of "
            f"{world_size} (bucket_size {bucket_size}); {_RESHARD_FIX}"
        )
