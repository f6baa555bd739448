"""Streams, events and copies for the device that holds the model's weights.

On a CUDA device grads go down and weights go up on a side stream, ordered by events. On the
CPU the "device" memory is host memory: there is nothing to copy or wait for, so every
operation here degrades to a no-op or a plain call, and the optimizer runs one code path on
both (the grad staging area *is* the host buffer, and the kernel writes the weights in place).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from ._pinned import HostBuffer

__all__ = ["DeviceOps"]

Event = Any  # torch.cuda.Event on CUDA, None on the CPU


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

    @property
    def host_addressable(self) -> bool:
        """True when device tensors are host memory the kernel can read and write directly."""
        return not self.is_cuda

    def is_capturing(self) -> bool:
        """True while the current stream is being captured into a CUDA graph."""
        return self.is_cuda and torch.cuda.is_current_stream_capturing()

    def host_buffer(self, numel: int, dtype: torch.dtype) -> HostBuffer:
        return HostBuffer(numel, dtype, pin=self.is_cuda)

    def staging(self, host_slice: Tensor) -> Tensor:
        """Where a bucket's grads are packed on the device before going down to ``host_slice``."""
        if self.host_addressable:
            return host_slice
        # Zeros: padding between params must reach the host as zero grads.
        return torch.zeros(host_slice.numel(), dtype=host_slice.dtype, device=self.device)

    @contextmanager
    def side_stream(self) -> Iterator[None]:
        """Runs the block on the side stream, after all work queued so far on the compute stream."""
        if self._side is None:
            yield
            return
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._side):
            yield

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
