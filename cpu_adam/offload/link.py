"""Every byte between the device and host memory, both ways, and the pinned slot each bucket goes through.

Each param group has one pinned bf16 host buffer; this rank's piece of bucket ``b`` lies in its
slot ``layout.host_slice(b)``. A slot's ``Slot`` state says what it holds: grads on their way
down, landed grads, the updated weights, or weights on their way up. Whoever writes a slot from
the host (the kernel's bf16 outputs, weights from loaded masters) first gets it with ``writable``,
which waits for the copy in flight.

Down: a bucket's grads, packed in a staging area on the device, are reduce-scattered across the
world (a world of one hands the bucket back), their params' squared norms are taken, and the
piece is copied into its slot, all on the side stream. ``down`` returns a ``Landing``: the copy's
event and the norms, which the accumulation window keeps. A staging area is freed once the host
has seen its copy complete, with at most ``max_inflight`` copies pending.

Up: the piece goes up into its place in a bucket buffer on the device in one copy, is all-gathered
there (NCCL allows it in place when the input is the rank's part of the output), and is scattered
into the params' own storage by the device. Where the device is the host and the world is one
process, the kernel writes the weights straight into the params (``direct``) and nothing moves.

A bucket the device steps (``share.py``) moves neither way: its grads are reduced and their norms
taken as any bucket's, and kept on the device (``kept``); its new weights are written into a
bucket buffer on the device (``device_weights``) and spread from there as uploaded ones are.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from typing import NamedTuple

import torch
from torch import Tensor

from .device import DeviceOps, Event, HostBuffer
from .layout import FlatLayout
from .share import Share
from .store import ChunkViews
from .world import World

__all__ = ["SLOT_DTYPE", "Landing", "Link", "Slot"]

SLOT_DTYPE = torch.bfloat16  # the pinned slots: grads down, weights up


class Slot(enum.Enum):
    EMPTY = "empty"
    RECEIVING = "receiving grads"
    GRADS = "holding grads"
    WEIGHTS = "holding weights"
    UPLOADING = "uploading weights"


class Landing(NamedTuple):
    """What ``down`` launched: the copy's event, and the squared norms of the piece's params (on the device)."""

    event: Event
    params: Tensor | None  # the params' indices in their group (on the device); None without norms
    sq: Tensor | None  # float32, one per param
    sq_host: Tensor | None = None  # the same in host memory, once the event has completed


class Link:
    def __init__(
        self,
        dev: DeviceOps,
        world: World,
        layouts: list[FlatLayout | None],
        params: list[list[Tensor]],
        max_inflight: int,
        share: Share,
    ) -> None:
        self._dev = dev
        self._world = world
        self._layouts = layouts
        self._params = params
        self._max_inflight = max_inflight
        self._share = share
        self.buffers = [
            None if layout is None else dev.host_buffer(layout.shard_numel, SLOT_DTYPE) for layout in layouts
        ]
        self.slots = {
            (g, b): Slot.EMPTY for g, layout in enumerate(layouts) if layout for b in range(len(layout.buckets))
        }
        self._events: dict[tuple[int, int], Event] = {}
        self._inflight: deque[tuple[tuple[int, int], Event, list[Tensor]]] = deque()
        self._kept: dict[tuple[int, int], tuple[Event, list[Tensor], Tensor]] = {}  # the device's buckets: grads
        self._reading: dict[tuple[int, int], Event] = {}  # uploads from host memory that is not a slot
        self._norm_plans: dict[tuple[int, int], tuple[Tensor, list[slice]]] = {}
        self.direct = dev.kernel_writes_params(world.size)
        self.upload_seconds = 0.0  # the host's time in uploads, all of them where the device is the host

    # -- device memory ----------------------------------------------------------------------

    def staging_area(self, g: int, b: int) -> Tensor:
        """Where bucket ``b``'s grads are packed before they go down: on the host device, the slot itself."""
        return self._dev.staging(self._slot(g, b), self._layouts[g].buckets[b].numel)

    def _slot(self, g: int, b: int) -> Tensor:
        where = self._layouts[g].host_slice(b)
        return self.buffers[g].tensor[where[1] if where is not None else slice(0, 0)]

    def is_slot(self, g: int, staging: Tensor) -> bool:
        """Whether a staging area is the slot itself (it then keeps what it held until it is overwritten)."""
        return staging.untyped_storage().data_ptr() == self.buffers[g].tensor.untyped_storage().data_ptr()

    def drop(self, staging: Tensor) -> None:
        """A staging area given up before it went down (the window was reset)."""
        self._dev.release([staging])

    # -- down -------------------------------------------------------------------------------

    def down(self, g: int, b: int, staging: Tensor, *, take_norms: bool) -> Landing:
        """Sends bucket ``b``'s packed grads (this rank's piece of their sum) into its slot, or, for a bucket the
        device steps, keeps them there."""
        where = self._layouts[g].host_slice(b)
        keep = self._share.on_device(g, b)
        held = [staging]
        if not keep:
            self._ready_to_receive(g, b)
        with self._dev.side_stream():
            host = self.buffers[g].tensor[where[1]] if where is not None else None
            mine = self._world.reduce_scatter(staging, into=self._dev.writable_host(host))
            if mine is not staging and mine is not host:
                held.append(self._dev.hold(mine))
            params = sq = sq_host = None
            if where is not None:
                mine = mine[where[0]] if mine is staging else mine
                if take_norms:
                    params, sq = self._norms(g, b, mine)
                    sq_host = None if sq is None else self._dev.to_host(sq)
                if not keep:
                    self._dev.copy(host, mine)
            event = self._dev.record()
        landing = Landing(event, params, sq, sq_host)
        if keep:
            self._drop_kept((g, b))
            self._kept[(g, b)] = (event, held, mine)
            return landing
        self.slots[(g, b)] = Slot.RECEIVING
        self._events[(g, b)] = event
        self._inflight.append(((g, b), event, held))
        self._reap(self._max_inflight)
        return landing

    def _ready_to_receive(self, g: int, b: int) -> None:
        # The side stream orders a copy down after an upload from the same slot; a copy still
        # landing there is waited for, as its grads must be read first.
        if self.slots[(g, b)] == Slot.RECEIVING:
            self.landed(g, b)

    def _norms(self, g: int, b: int, piece: Tensor) -> tuple[Tensor | None, Tensor | None]:
        index, slices = self._norm_plan(g, b)
        if not slices:  # a piece may hold padding only
            return None, None
        norms = torch._foreach_norm([piece[s] for s in slices], 2, dtype=torch.float32)
        return index, torch.stack(norms).square()

    def _norm_plan(self, g: int, b: int) -> tuple[Tensor, list[slice]]:
        """The params of this rank's piece of bucket ``b`` (an index tensor on the device) and their slices of it."""
        if (g, b) not in self._norm_plans:
            params, slices = self._layouts[g].piece_params(b)
            self._norm_plans[(g, b)] = torch.tensor(params, dtype=torch.int64).to(self._dev.device), slices
        return self._norm_plans[(g, b)]

    def landed(self, g: int, b: int) -> Tensor:
        """Bucket ``b``'s slot, once the grads sent down to it have landed; for a bucket the device steps, its
        grads kept on the device, once the compute stream has them."""
        if (g, b) in self._kept:
            event, _, mine = self._kept[(g, b)]
            self._dev.compute_waits(event)
            return self._dev.on_compute(mine)
        if self.slots[(g, b)] == Slot.RECEIVING:
            self._dev.wait_host(self._events.pop((g, b)))
            self.slots[(g, b)] = Slot.GRADS
        return self._slot(g, b)

    def _drop_kept(self, key: tuple[int, int]) -> None:
        if key in self._kept:
            self._dev.release(self._kept.pop(key)[1])

    def drop_kept(self) -> None:
        """The device's buckets' grads are no longer needed (the window ended)."""
        for key in list(self._kept):
            self._drop_kept(key)

    def wait_all(self) -> None:
        """Returns once every copy down has landed in its slot."""
        self._reap(0)
        for key, state in self.slots.items():
            if state == Slot.RECEIVING:
                self.landed(*key)

    def _reap(self, keep: int) -> None:
        """Frees staging areas whose copy is done; waits for the oldest beyond ``keep`` pending."""
        while self._inflight and (len(self._inflight) > keep or self._dev.done(self._inflight[0][1])):
            _, event, held = self._inflight.popleft()
            self._dev.wait_host(event)
            self._dev.release(held)

    # -- up ---------------------------------------------------------------------------------

    def swap_buffer(self, g: int, other: HostBuffer) -> HostBuffer:
        """Group ``g``'s slots move to ``other``; returns the buffer they were in, with what it holds."""
        old, self.buffers[g] = self.buffers[g], other
        return old

    def writable(self, g: int, b: int) -> Tensor:
        """Bucket ``b``'s slot, to be written with weights from the host: its copies in flight are done."""
        if self.slots[(g, b)] in (Slot.RECEIVING, Slot.UPLOADING):
            self._dev.wait_host(self._events.pop((g, b)))
        self.slots[(g, b)] = Slot.WEIGHTS
        return self._slot(g, b)

    def outputs(self, g: int, i: int, part: slice, host: slice) -> Tensor:
        """Where the kernel writes param ``i``'s new bf16 weights ``part``: its storage (``direct``), or the slot."""
        return self._params[g][i].detach().view(-1)[part] if self.direct else self.buffers[g].tensor[host]

    def up(self, g: int, b: int, wanted: list[bool], source: Tensor | None = None) -> None:
        """Puts this rank's new bf16 weights of bucket ``b`` into the params ``wanted``: the kernel's outputs, or
        those in ``source`` (a host buffer laid out as the slots).

        Call on the side stream, so the upload waits for what the compute stream still does with the weights.
        """
        if source is not None or not self.direct:
            self._upload(g, b, wanted, self.buffers[g].tensor if source is None else source)

    def weights_from(self, g: int, values: Tensor) -> None:
        """Every param of group ``g`` set to ``values`` (this rank's shard) rounded to bf16, as the kernel rounds."""
        for b in range(len(self._layouts[g].buckets)):
            where = self._layouts[g].host_slice(b)
            if where is not None:
                self.writable(g, b).copy_(values[where[1]])
        with self._dev.side_stream():
            for b in range(len(self._layouts[g].buckets)):
                self._upload(g, b, [True] * len(self._params[g]), self.buffers[g].tensor)

    def _upload(self, g: int, b: int, wanted: list[bool], source: Tensor) -> None:
        t = time.perf_counter()
        layout = self._layouts[g]
        piece, bucket = layout.pieces[b], layout.buckets[b]
        if bucket.numel == 0:
            return
        if self.slots[(g, b)] == Slot.RECEIVING:
            raise RuntimeError(f"cpu_adam.OffloadOptimizer: bucket {b} of group {g} is uploaded while its grads land")
        host = source[piece.host : piece.host + piece.numel]
        into, mine = self._dev.piece_on_device(host, bucket.numel, piece.flat - bucket.start)
        self.spread(g, b, wanted, into, mine)
        if source is self.buffers[g].tensor:
            self.slots[(g, b)] = Slot.UPLOADING
            self._events[(g, b)] = self._dev.record()
        else:  # the masters (bf16 masters are the weights), or the spare buffer of overlap="backward"
            self._reading[(g, b)] = self._dev.record()
        self.upload_seconds += time.perf_counter() - t

    def wait_uploads(self) -> None:
        """Returns once the uploads that read host memory other than the slots (the masters) have read it."""
        for event in self._reading.values():
            self._dev.wait_host(event)
        self._reading.clear()

    def device_weights(self, g: int, b: int) -> tuple[Tensor, Tensor]:
        """(a zeroed bf16 buffer of bucket ``b`` on the device, this rank's piece of it): where the device's step
        of the bucket writes its new weights, to be ``spread``."""
        piece, bucket = self._layouts[g].pieces[b], self._layouts[g].buckets[b]
        into = self._dev.scratch(torch.zeros(bucket.numel, dtype=SLOT_DTYPE, device=self._dev.device))
        start = piece.flat - bucket.start
        return into, into[start : start + piece.numel]

    def gather_weights(self, g: int, b: int, mine: Tensor) -> None:
        """This rank's piece of bucket ``b``'s weights, from the params into ``mine`` (its padding left as it is)."""
        segments = self._layouts[g].piece_segments(b)
        first = self._layouts[g].pieces[b].host
        targets = [mine[host.start - first : host.stop - first] for _, _, host in segments]
        if targets:
            torch._foreach_copy_(targets, [self._params[g][i].detach().view(-1)[part] for i, part, _ in segments])

    def spread(self, g: int, b: int, wanted: list[bool], into: Tensor | None, mine: Tensor) -> None:
        """Bucket ``b``'s new weights, this rank's piece ``mine`` (in place in ``into`` on the device, if given),
        gathered from every rank and copied into the params ``wanted``."""
        layout = self._layouts[g]
        bucket = layout.buckets[b]
        gathered = self._world.all_gather(mine, into=into)
        targets, sources = [], []
        for i, lo, hi, _ in layout.segments(bucket.start, bucket.end, 0):
            if wanted[i]:
                start = layout.offsets[i]
                targets.append(self._params[g][i].detach().view(-1)[lo - start : hi - start])
                sources.append(gathered[lo - bucket.start : hi - bucket.start])
        if targets:  # one launch on the device for all the bucket's params, small ones included
            torch._foreach_copy_(targets, sources, non_blocking=True)

    # -- the state of the device's buckets -----------------------------------------------------

    def state_up(self, host: ChunkViews) -> tuple[ChunkViews, Event]:
        """A copy of a bucket's state (its host views) in device memory, queued on the side stream, and the event
        that marks its arrival; from page-locked memory it runs while the device computes."""
        with self._dev.side_stream():
            views = ChunkViews(*(None if t is None else self._dev.hold(self._dev.copied_up(t)) for t in host))
            return views, self._dev.record()

    def state_down(self, device: ChunkViews, host: ChunkViews) -> Event:
        """A bucket's state copied from device memory into its host views, queued on the side stream after what the
        compute stream does with it; the event marks its arrival."""
        with self._dev.side_stream():
            for mine, theirs in zip(device, host):
                if mine is not None:
                    self._dev.copy(theirs, mine)
            return self._dev.record()

    def close(self) -> None:
        self._dev.synchronize()
        self.drop_kept()
        for buffer in self.buffers:
            if buffer is not None:
                buffer.close()

    @property
    def pinned_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b is not None)

    @property
    def pinned(self) -> bool:
        return any(b.pinned for b in self.buffers if b is not None)
