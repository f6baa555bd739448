"""DTensor params (FSDP2 shards): where a rank's local shard lies in its whole param, and the pieces
the kernel steps so that every random bit follows an element's place in the whole param.

FSDP2 shards dim 0 (``Shard(0)``), so a rank's local shard is the contiguous range of the flattened
whole param from ``start`` = (its first row) * (the row's size). The kernel draws an element's random
bits (stochastic rounding, 8-bit codes) from its counter; the optimizer gives it the counter of the
element's place in the whole param, so the world size changes no bit. Two details of the kernel
shape the pieces:

- 8-bit moments have a scale per block of 256 elements from the tensor's first element. The blocks
  follow the whole param: a shard that starts inside a block steps that block's part (the head) as a
  tensor of its own, scaled by its own largest value, and the rest (the body) from a block boundary.
  Only blocks cut by a shard boundary differ from one process's; the others are bitwise the same.
- The vector kernels hash the random bits of pairs of elements, so a tensor's first counter is even.
  A head that starts at an odd counter is stepped in a copy that repeats its first element in front
  (an identical element changes no block's scale), then copied back.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch
from torch import Tensor

from ..quant8 import BLOCK

__all__ = [
    "Piece",
    "block_sizes",
    "element_scales",
    "head_size",
    "is_dtensor",
    "local",
    "local_blocks",
    "pieces",
    "shard_start",
]


def is_dtensor(t: Tensor) -> bool:
    # Importing torch.distributed.tensor costs most of a second; until someone has imported it,
    # no DTensor can exist.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local(t: Tensor) -> Tensor:
    """The tensor the kernel updates: a DTensor's local shard, else the tensor itself."""
    # The shard itself, as FSDP2 reads it: to_local() returns a view of it through an autograd
    # Function, which costs about 10 us a call, four calls a param a step.
    return t._local_tensor if is_dtensor(t) else t


def shard_start(p: Tensor) -> int:
    """Where ``p``'s local shard starts in its flattened whole param (0 for a plain tensor).

    Only shards of dim 0 (FSDP2's ``Shard(0)``, HSDP's ``Replicate`` + ``Shard(0)``) are contiguous
    ranges of the whole param; other layouts (tensor parallel's ``Shard(1)``) step their random bits
    from the local shard's own places (0 here), which then depend on the layout.
    """
    if not is_dtensor(p):
        return 0
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    def along_rows(placement: object) -> bool:
        return type(placement) is Replicate or (type(placement) is Shard and placement.dim == 0)

    if not all(along_rows(placement) for placement in p.placements):
        return 0
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return int(offset[0]) * math.prod(p.shape[1:]) if offset else 0


def head_size(numel: int, start: int, eight_bit: bool) -> int:
    """How many of a shard's first elements are stepped apart: those before the whole param's next
    block boundary (8-bit moments), or the first one if it sits at an odd counter."""
    return min(numel, -start % BLOCK if eight_bit else start % 2)


def local_blocks(numel: int, start: int) -> int:
    """How many 8-bit scale blocks a shard of ``numel`` elements from ``start`` has: the part of a
    block it starts in (if any), then whole blocks of the whole param, the last one maybe cut."""
    head = head_size(numel, start, eight_bit=True)
    return int(head > 0) + -(-(numel - head) // BLOCK)


class Piece(NamedTuple):
    """A contiguous range of a param's local shard as the kernel steps it: its tensors (or copies of
    them), its first element's counter, and where copies are written back after the step."""

    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    scales: Tensor | None
    counter: int
    write_backs: tuple[tuple[Tensor, Tensor], ...] = ()  # (stepped copy, destination)


def pieces(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    scales: Tensor | None,
    *,
    counter: int,
    start: int,
    random_bits: bool,
) -> list[Piece]:
    """The pieces that step one local shard (local tensors) whose first element is element ``start``
    of a whole param whose counters start at ``counter``: one piece where the shard starts on a block
    boundary (8-bit) or an even counter, else its head, then its body."""
    numel = param.numel()
    if not random_bits or numel == 0:  # no bits drawn: any even counter will do
        return [Piece(param, grad, exp_avg, exp_avg_sq, scales, counter)]
    whole = Piece(param, grad, exp_avg, exp_avg_sq, scales, counter + start)
    head = head_size(numel, start, scales is not None)
    if head == 0:
        return [whole]
    flat = [t.view(-1) for t in (param, grad, exp_avg, exp_avg_sq)]
    head_scales = scales[:, :1] if scales is not None else None
    body_scales = scales[:, 1:] if scales is not None else None
    if start % 2 == 0:
        first = Piece(*(t[:head] for t in flat), head_scales, counter + start)
    else:  # stepped in a copy with its first element repeated in front, at the even counter before it
        copies = [torch.cat((t[:1], t[:head])) for t in flat]
        written = tuple((copies[i][1:], flat[i][:head]) for i in (0, 2, 3))
        first = Piece(*copies, head_scales, counter + start - 1, written)
    if head == numel:
        return [first]
    return [first, Piece(*(t[head:] for t in flat), body_scales, counter + start + head)]


def block_sizes(numel: int, start: int) -> list[int]:
    """How many of the shard's elements each of its 8-bit scale blocks holds (``local_blocks`` of them)."""
    head = head_size(numel, start, eight_bit=True)
    body = [min(BLOCK, numel - lo) for lo in range(head, numel, BLOCK)]
    return ([head] if head else []) + body


def element_scales(scales: Tensor, numel: int, start: int) -> Tensor:
    """Each element's scales, float32 [2, numel], from a shard's [2, blocks] 8-bit block scales."""
    sizes = torch.tensor(block_sizes(numel, start), dtype=torch.int64)
    return scales.repeat_interleave(sizes, dim=1, output_size=numel)
