"""Where the optimizer's state lives: master weights, Adam's moments, 8-bit block scales, step counts.

Nothing outside the store touches them: the stepper asks for the views of a chunk, the state
dict exports and imports them, the params' side writes masters through ``write_master``. Each
param group's state is this rank's shard, laid out as its ``FlatLayout`` says (the padding
between params holds zeros, which Adam keeps at zero). ``Store`` is the interface, so that a
tier below host RAM can stand in for ``HostStore``, today's one implementation.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from .._precision import SCALES
from ..quant8 import BLOCK
from .device import HostBuffer
from .layout import FlatLayout

__all__ = ["SCALES_DTYPE", "ChunkViews", "HostStore", "Store", "scales_shape"]

SCALES_DTYPE = torch.float32  # 8-bit moments: the scale of each block


def scales_shape(numel: int) -> tuple[int, int]:
    """The block scales of ``numel`` (a multiple of BLOCK) 8-bit elements: both moments' scale per block."""
    return (2, numel // BLOCK)


class ChunkViews(NamedTuple):
    """The state of host elements ``[start, stop)`` of one group, as views the kernel updates in place."""

    master: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    scales: Tensor | None  # 8-bit moments: [2, blocks] (a view starts on a block boundary)


class Store(Protocol):
    steps: list[list[int]]  # per group, per param: Adam steps taken (as torch counts them)
    master_dtype: torch.dtype

    def views(self, g: int, host: slice) -> ChunkViews: ...

    def advance(self, g: int, params: list[int]) -> None: ...

    def master(self, g: int, host: slice) -> Tensor: ...

    def write_master(self, g: int, host: slice, values: Tensor) -> None: ...

    def export(self, g: int) -> dict[str, Tensor]: ...

    def load(self, g: int, tensors: dict[str, Tensor], steps: list[int]) -> None: ...

    def nbytes(self) -> tuple[int, int]: ...

    def close(self) -> None: ...


class HostStore:
    """The state in host RAM: one flat tensor per group and kind."""

    def __init__(
        self,
        layouts: list[FlatLayout | None],
        master_dtype: torch.dtype,
        state_dtype: torch.dtype,
        pinnable: bool = False,
    ) -> None:
        self._groups = [
            None if layout is None else _GroupState(layout, master_dtype, state_dtype) for layout in layouts
        ]
        self.steps = [[] if layout is None else [0] * len(layout.shapes) for layout in layouts]
        self.master_dtype = master_dtype
        self._pinnable = pinnable  # the device is a CUDA device, which copies page-locked memory asynchronously

    def pin(self, g: int, *, master_only: bool = False) -> None:
        """Page-locks group ``g``'s state (once), or its master alone, for copies to and from the device that overlap
        other work."""
        if self._pinnable:
            for buffer in self._groups[g].buffers[: 1 if master_only else None]:
                buffer.pin()

    def close(self) -> None:
        """Page-locked memory given back (the state stays readable); every copy that uses it must be done."""
        for state in self._groups:
            for buffer in [] if state is None else state.buffers:
                buffer.close()

    def views(self, g: int, host: slice) -> ChunkViews:
        state = self._groups[g]
        scales = None
        if state.scales is not None:
            scales = state.scales[:, host.start // BLOCK : (host.stop + BLOCK - 1) // BLOCK]
        return ChunkViews(state.master[host], state.exp_avg[host], state.exp_avg_sq[host], scales)

    def advance(self, g: int, params: list[int]) -> None:
        """One more step for each of ``params`` (once their kernel has run)."""
        steps = self.steps[g]
        for i in params:
            steps[i] += 1

    def master(self, g: int, host: slice) -> Tensor:
        return self._groups[g].master[host]

    def write_master(self, g: int, host: slice, values: Tensor) -> None:
        self._groups[g].master[host].copy_(values)

    def export(self, g: int) -> dict[str, Tensor]:
        """The live tensors of group ``g``, by their state-dict names."""
        state = self._groups[g]
        tensors = {"master": state.master, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq}
        if state.scales is not None:
            tensors[SCALES] = state.scales
        return tensors

    def load(self, g: int, tensors: dict[str, Tensor], steps: list[int]) -> None:
        """Moments zeroed, then ``tensors`` (checked, in this store's dtypes and shapes) copied in."""
        state = self._groups[g]
        state.exp_avg.zero_()
        state.exp_avg_sq.zero_()
        if state.scales is not None:
            state.scales.fill_(1.0)
        live = self.export(g)
        for name, t in tensors.items():
            live[name].copy_(t)
        self.steps[g] = list(steps)

    def nbytes(self) -> tuple[int, int]:
        """(master bytes, moment bytes with their block scales) held."""
        master = states = 0
        for state in self._groups:
            if state is not None:
                master += _nbytes(state.master)
                states += _nbytes(state.exp_avg) + _nbytes(state.exp_avg_sq) + _nbytes(state.scales)
        return master, states


class _GroupState:
    def __init__(self, layout: FlatLayout, master_dtype: torch.dtype, state_dtype: torch.dtype) -> None:
        n = layout.shard_numel
        # The master filled from the device weights at the first step, so weights loaded into the model
        # after the optimizer was built are the ones trained.
        self.buffers = [HostBuffer(n, dtype, pin=False) for dtype in (master_dtype, state_dtype, state_dtype)]
        self.master, self.exp_avg, self.exp_avg_sq = (buffer.tensor for buffer in self.buffers)
        self.scales = None
        if state_dtype == torch.uint8:  # 8-bit moments: both moments' scale per block; an all-zero block's is 1
            self.buffers.append(HostBuffer(math.prod(scales_shape(n)), SCALES_DTYPE, pin=False))
            self.scales = self.buffers[-1].tensor.view(scales_shape(n)).fill_(1.0)


def _nbytes(t: Tensor | None) -> int:
    return 0 if t is None else t.untyped_storage().nbytes()
