"""The device that holds the model's weights: streams, events, copies, and pinned host memory.

On a CUDA device grads go down and weights go up on a side stream, ordered by events. On the
CPU the "device" memory is host memory: there is nothing to copy or wait for, so every
operation here degrades to a no-op or a plain call, and the optimizer runs one code path on
both. Whether the device is the host is asked here and nowhere else.

Pinned buffers are page-locked at exact size: torch's pinned allocator (``pin_memory=True``)
caches blocks rounded up to a power of two, so a 9 GiB buffer would lock 16 GiB of RAM. Here
plain memory from ``torch.zeros`` is registered with the CUDA runtime instead, and unregistered
before the memory is freed (unregistering after the free could leave the driver holding a stale
range).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["DeviceOps", "Event", "HostBuffer", "Memory"]

Event = Any  # torch.cuda.Event on CUDA, None on the CPU
_PROBE_BYTES = 64 << 20  # the link's probe: past small copies' overheads, a few milliseconds


class Memory(NamedTuple):
    allocated: int
    available: int  # what the caching allocator can hand out: free on the device, and blocks it keeps
    total: int


class HostBuffer:
    """A zero-filled 1-D host tensor of exactly ``numel`` elements, page-locked when ``pin``.

    Keep this object alive for as long as asynchronous copies may touch ``tensor``: views of
    the tensor keep its memory valid, but not its registration.
    """

    def __init__(self, numel: int, dtype: torch.dtype, *, pin: bool) -> None:
        self.tensor: Tensor = torch.zeros(numel, dtype=dtype)
        self._registered_ptr: int | None = None
        if pin:
            self.pin()

    def pin(self) -> None:
        """Page-locks the memory (once), so that copies to and from a CUDA device run asynchronously."""
        if self._registered_ptr is None and self.tensor.numel() > 0:
            ptr = self.tensor.data_ptr()
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(ptr, self.nbytes, 0))
            self._registered_ptr = ptr

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def pinned(self) -> bool:
        return self._registered_ptr is not None

    def close(self) -> None:
        """Unregisters the memory; the caller must have finished every copy that uses it."""
        ptr, self._registered_ptr = self._registered_ptr, None
        if ptr is not None:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostUnregister(ptr))

    def __del__(self) -> None:
        # At interpreter shutdown the CUDA runtime may already be gone; nothing left to protect.
        with contextlib.suppress(Exception):
            self.close()


class DeviceOps:
    def __init__(self, device: torch.device) -> None:
        if device.type not in ("cuda", "cpu"):
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: parameters on {device} are not supported; "
                "put the model on a CUDA device (or on the CPU when there is none)"
            )
        self.device = device
        self.is_cuda = device.type == "cuda"
        self._side = torch.cuda.Stream(device=device) if self.is_cuda else None
        self.held_bytes = 0  # what the optimizer holds in device memory now
        self.peak_bytes = 0
        self._link_rates: tuple[float, float] | None = None

    @property
    def host_addressable(self) -> bool:
        """True when device tensors are host memory the kernel can read and write directly."""
        return not self.is_cuda

    def is_capturing(self) -> bool:
        """True while the current stream is being captured into a CUDA graph."""
        return self.is_cuda and torch.cuda.is_current_stream_capturing()

    def host_buffer(self, numel: int, dtype: torch.dtype) -> HostBuffer:
        return HostBuffer(numel, dtype, pin=self.is_cuda)

    def kernel_writes_params(self, world_size: int) -> bool:
        """Whether the kernel writes the new weights straight into the params: the device is the host, and
        no other rank's weights need gathering."""
        return self.host_addressable and world_size == 1

    def staging(self, host_slice: Tensor, numel: int) -> Tensor:
        """Where ``numel`` grads are packed on the device before ``host_slice`` receives them: that very
        slice where the device is the host and the slice takes all of them."""
        if self.host_addressable and host_slice.numel() == numel:
            return host_slice
        # Zeros: padding between params must reach the host as zero grads.
        return self.hold(torch.zeros(numel, dtype=host_slice.dtype, device=self.device))

    def writable_host(self, host_slice: Tensor) -> Tensor | None:
        """``host_slice`` where device work may write into it directly (the device is the host), else None."""
        return host_slice if self.host_addressable else None

    def piece_on_device(self, host: Tensor, numel: int, at: int) -> tuple[Tensor | None, Tensor]:
        """(a device buffer of ``numel`` elements holding ``host`` at offset ``at``, that part of it), queued;
        on the host device (None, ``host``) itself."""
        if self.host_addressable:
            return None, host
        buffer = self.scratch(torch.empty(numel, dtype=host.dtype, device=self.device))
        piece = buffer[at : at + host.numel()]
        self.copy(piece, host)
        return buffer, piece

    def scratch(self, t: Tensor) -> Tensor:
        """A short-lived device tensor: counted in the peak, not held."""
        if not self.host_addressable:
            self.peak_bytes = max(self.peak_bytes, self.held_bytes + _nbytes(t))
        return t

    def on_compute(self, t: Tensor) -> Tensor:
        """``t``, which the side stream made, is used by the compute stream from now on: its memory is not handed
        out again before that work is done."""
        if self.is_cuda:
            t.record_stream(torch.cuda.current_stream(self.device))
        return t

    def memory(self) -> Memory:
        """The device's memory now, as the caching allocator sees it (a CUDA device), within the process's share
        where one is set (``torch.cuda.set_per_process_memory_fraction``: a GPU smaller than this one)."""
        free, total = torch.cuda.mem_get_info(self.device)
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda device: 1.0)(self.device)
        return capped_memory(
            free, total, torch.cuda.memory_reserved(self.device), torch.cuda.memory_allocated(self.device), fraction
        )

    def link_rates(self) -> tuple[float, float]:
        """Bytes/s of page-locked copies up and down (a CUDA device), from one short probe, once."""
        if self._link_rates is None:
            host = torch.empty(_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
            device = torch.empty(_PROBE_BYTES, dtype=torch.uint8, device=self.device)
            rates = []
            with self.side_stream():
                for dst, src in ((device, host), (host, device)):
                    dst.copy_(src, non_blocking=True)  # once to warm up, then timed
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    dst.copy_(src, non_blocking=True)
                    end.record()
                    end.synchronize()
                    rates.append(_PROBE_BYTES / (start.elapsed_time(end) * 1e-3))
            self._link_rates = (rates[0], rates[1])
        return self._link_rates

    def to_host(self, t: Tensor) -> Tensor:
        """``t`` (a small device tensor) copied to page-locked host memory, queued on the current stream: valid once
        an event recorded after it has completed. On the host device, ``t`` itself."""
        if self.host_addressable:
            return t
        return torch.empty(t.shape, dtype=t.dtype, pin_memory=self.is_cuda).copy_(t, non_blocking=self.is_cuda)

    def copied_up(self, host: Tensor) -> Tensor:
        """A copy of host tensor ``host`` in device memory (its own memory also where the device is the host),
        queued on the current stream."""
        return torch.empty(host.shape, dtype=host.dtype, device=self.device).copy_(host, non_blocking=self.is_cuda)

    def hold(self, t: Tensor) -> Tensor:
        """Counts a device tensor the optimizer keeps until ``release``."""
        if not self.host_addressable:
            self.held_bytes += _nbytes(t)
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)
        return t

    def release(self, tensors: list[Tensor]) -> None:
        if not self.host_addressable:
            self.held_bytes -= sum(_nbytes(t) for t in tensors)

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        """Runs the block on the side stream, after all work queued so far on the compute stream."""
        if self._side is None:
            yield
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            yield

    @contextmanager
    def uploading(self) -> Iterator[None]:
        """The block's uploads run on the side stream, and later work on the compute stream waits for them, also
        where the block raised (a failed step puts the weights it had uploaded back)."""
        try:
            with self.side_stream():
                yield
        finally:
            self.compute_waits(self.record())

    def copy(self, dst: Tensor, src: Tensor) -> None:
        """Asynchronous on CUDA (pinned host memory); skipped when both are the same memory."""
        if dst.data_ptr() == src.data_ptr() and dst.dtype == src.dtype and dst.device == src.device:
            return
        dst.copy_(src, non_blocking=self.is_cuda)

    def record(self) -> Event:
        """An event marking everything queued so far on the side stream."""
        if self._side is None:
            return None
        event = torch.cuda.Event()
        event.record(self._side)
        return event

    def done(self, event: Event) -> bool:
        return event is None or event.query()

    def wait_host(self, event: Event) -> None:
        if event is not None:
            event.synchronize()

    def compute_waits(self, event: Event) -> None:
        """Later work on the compute stream (the next forward) waits for ``event``; the host does not."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        if self._side is not None:
            self._side.synchronize()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


def capped_memory(free: int, total: int, reserved: int, allocated: int, fraction: float = 1.0) -> Memory:
    """The memory the allocator can still hand out: the device's free memory and the free blocks it keeps, but no
    more than a process share of ``fraction`` of ``total`` leaves beyond what it has reserved."""
    cap = int(total * fraction)
    return Memory(allocated, min(free, max(0, cap - reserved)) + reserved - allocated, cap)
