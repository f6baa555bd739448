"""Every copy between the device and host memory, the copies in flight, and the device bytes they hold.

Down: a bucket's grads, packed in a staging area on the device, are reduce-scattered across the
ranks (ZeRO), have their params' squared norms taken, and are copied into the group's pinned
host buffer, all on the side stream. Up: this rank's updated bf16 weights go from that buffer
into the params' own storage, one copy per param slice (one process) or all-gathered through a
bucket buffer on the device (ZeRO). A staging area is freed only once the host has seen its
copy's event complete, with at most ``max_inflight`` copies pending. On the CPU device the
staging area is the host buffer itself and these copies are no-ops.
"""

from __future__ import annotations

from collections import deque

import torch
from torch import Tensor

from ._collectives import ShardComm
from ._device import DeviceOps, Event
from ._group import GroupBuffers

__all__ = ["Transfers"]


class Transfers:
    def __init__(self, dev: DeviceOps, comm: ShardComm | None, max_inflight: int) -> None:
        self._dev = dev
        self._comm = comm
        self._max_inflight = max_inflight
        self._inflight: deque[tuple[Event, list[Tensor]]] = deque()
        self.device_bytes = 0  # what the optimizer holds on the device now
        self.device_peak_bytes = 0

    # -- device memory ----------------------------------------------------------------------

    def staging_area(self, group: GroupBuffers, b: int) -> Tensor:
        """Where bucket ``b``'s grads are packed before they go down."""
        bucket, where = group.layout.buckets[b], group.host_slice(b)
        if self._comm is None and where is not None and where[0] == slice(0, bucket.numel):
            # One process: a bucket is its own piece. On the CPU that is the host buffer itself.
            return self._held(self._dev.staging(group.grads.tensor[where[1]]))
        # ZeRO: the whole bucket is packed on the device, for the reduce-scatter.
        return self._held(torch.zeros(bucket.numel, dtype=torch.bfloat16, device=self._dev.device))

    def drop(self, staging: Tensor) -> None:
        """A staging area given up before it went down (the window was reset)."""
        self._release([staging])

    def note_transient(self, t: Tensor) -> None:
        """Counts a short-lived device buffer in the peak (the held bytes do not change)."""
        if not self._dev.host_addressable:
            self.device_peak_bytes = max(self.device_peak_bytes, self.device_bytes + _nbytes(t))

    def _held(self, t: Tensor) -> Tensor:
        if not self._dev.host_addressable:
            self.device_bytes += _nbytes(t)
            self.device_peak_bytes = max(self.device_peak_bytes, self.device_bytes)
        return t

    def _release(self, tensors: list[Tensor]) -> None:
        if not self._dev.host_addressable:
            self.device_bytes -= sum(_nbytes(t) for t in tensors)

    # -- down -------------------------------------------------------------------------------

    def down(self, group: GroupBuffers, b: int, staging: Tensor, *, take_norms: bool) -> Event:
        """Sends bucket ``b``'s packed grads to the host buffer; returns the copy's event."""
        where = group.host_slice(b)
        held = [staging]
        with self._dev.side_stream():
            mine = staging if where is None else staging[where[0]]
            if self._comm is not None and group.layout.buckets[b].numel > 0:
                # On the CPU the reduced piece lands in the host buffer; on a GPU in a device
                # tensor (not in place in the staging area: gloo does not promise that works).
                if self._dev.host_addressable:
                    mine = group.grads.tensor[where[1]]
                else:
                    mine = self._held(torch.empty_like(staging[where[0]]))
                    held.append(mine)
                self._comm.reduce_scatter(mine, staging)
            if take_norms and where is not None:
                _take_norms(group, b, mine)
            if where is not None:
                self._dev.copy(group.grads.tensor[where[1]], mine)
            event = self._dev.record()
        self._inflight.append((event, held))
        self._reap(self._max_inflight)
        return event

    def wait_all(self) -> None:
        """Returns once every copy down has landed in the host buffers."""
        self._reap(0)

    def _reap(self, keep: int) -> None:
        """Frees staging areas whose copy is done; waits for the oldest beyond ``keep`` pending."""
        while self._inflight and (len(self._inflight) > keep or self._dev.done(self._inflight[0][0])):
            event, held = self._inflight.popleft()
            self._dev.wait_host(event)
            self._release(held)

    # -- up ---------------------------------------------------------------------------------

    def up(self, group: GroupBuffers, b: int, wanted: list[bool], *, in_place: bool = False) -> None:
        """Puts this rank's new bf16 weights of bucket ``b`` (in the host buffer) into the params' storage.

        Call on the side stream. ``in_place``: the kernel already wrote them there (one process
        on the CPU). ZeRO: the piece goes up into its place in a bucket buffer on the device, the
        bucket is all-gathered there (NCCL allows it in place when the input is the rank's slice
        of the output) and copied into the params; on the CPU the host buffer is the all-gather's
        input.
        """
        if self._comm is None:
            if not in_place:
                for i, part, host in group.piece_segments(b):
                    if wanted[i]:
                        self._dev.copy(group.weights(i)[part], group.grads.tensor[host])
            return
        piece, bucket = group.layout.pieces[b], group.layout.buckets[b]
        if bucket.numel == 0:
            return
        buffer = torch.empty(bucket.numel, dtype=torch.bfloat16, device=self._dev.device)
        self.note_transient(buffer)
        host = group.grads.tensor[piece.host : piece.host + piece.numel]
        if not self._dev.host_addressable:
            mine = buffer[piece.flat - bucket.start : piece.flat - bucket.start + piece.numel]
            self._dev.copy(mine, host)
            host = mine
        self._comm.all_gather(buffer, host)
        for i, lo, hi, _ in group.layout.segments(bucket.start, bucket.end, 0):
            if wanted[i]:
                start = group.layout.offsets[i]
                group.weights(i)[lo - start : hi - start].copy_(buffer[lo - bucket.start : hi - bucket.start])


def _take_norms(group: GroupBuffers, b: int, piece: Tensor) -> None:
    """Each param's squared grad norm, from its slice of this rank's piece, into ``group.param_sq``."""
    if group.param_sq is None:
        group.param_sq = torch.zeros(len(group.params), dtype=torch.float32, device=piece.device)
    index, slices = group.sq_plan(b)
    if slices:  # a piece may hold padding only
        norms = torch._foreach_norm([piece[s] for s in slices], 2, dtype=torch.float32)
        group.param_sq.index_copy_(0, index, torch.stack(norms).square())


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()
