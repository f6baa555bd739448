"""Exact-size page-locked host buffers.

torch's pinned allocator (``pin_memory=True``) caches blocks rounded up to a power of two, so a
9 GiB buffer would lock 16 GiB of RAM. Here plain memory from ``torch.zeros`` is registered with
the CUDA runtime instead: it locks exactly the bytes asked for, and is unregistered before the
memory is freed (unregistering after the free could leave the driver holding a stale range).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["HostBuffer"]


class HostBuffer:
    """A zero-filled 1-D host tensor of exactly ``numel`` elements, page-locked when ``pin``.

    Keep this object alive for as long as asynchronous copies may touch ``tensor``: views of
    the tensor keep its memory valid, but not its registration.
    """

    def __init__(self, numel: int, dtype: torch.dtype, *, pin: bool) -> None:
        self.tensor: Tensor = torch.zeros(numel, dtype=dtype)
        self._registered_ptr: int | None = None
        if pin and numel > 0:
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
