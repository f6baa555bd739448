"""The state of the buckets the device steps, in device memory: the store's second implementation.

Each such bucket's piece is held as the host store lays it out (masters, moments, 8-bit scales),
copied up when the bucket joins the device's share and back when it leaves. While a bucket is on
the device its host copy is stale; ``write_back`` makes the host store whole (for a state dict,
the masters), ``reload`` takes the host store's state up again (after a load, or masters taken
from weights written by others). With bf16 master weights the device keeps no master: the
weights are the master (a bf16 master rounds to itself), so only the moments live here.
Step counts stay in the host store, one list for both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .device import DeviceOps
from .layout import FlatLayout
from .share import Key
from .store import ChunkViews, HostStore

__all__ = ["DeviceStore"]


class DeviceStore:
    def __init__(
        self,
        dev: DeviceOps,
        layouts: list[FlatLayout | None],
        host: HostStore,
        weights_into: Callable[[int, int, Tensor], None],
        master_dtype: torch.dtype,
    ) -> None:
        self._dev = dev
        self._layouts = layouts
        self._host = host
        self._weights_into = weights_into  # (g, b, piece): the params' piece of bucket b, copied into it
        self._keeps_master = master_dtype == torch.float32
        self._views: dict[Key, ChunkViews] = {}

    @property
    def keys(self) -> set[Key]:
        return set(self._views)

    def views(self, key: Key) -> ChunkViews:
        """Bucket ``key``'s piece on the device; ``master`` is None where the weights are the master."""
        return self._views[key]

    def place(self, keys: frozenset[Key]) -> None:
        """The state of ``keys`` on the device, that of the others in the host store."""
        for key in [key for key in self._views if key not in keys]:
            self._write_back(key)
            self._dev.release([t for t in self._views.pop(key) if t is not None])
        for key in sorted(keys - set(self._views)):
            host = self._host_views(key)
            if host is not None:
                self._views[key] = ChunkViews(*(None if t is None else self._copy_up(t) for t in host))

    def write_back(self) -> None:
        """The host store made whole: the device's state (and with bf16 masters, the weights) copied down."""
        for key in self._views:
            self._write_back(key)

    def reload(self) -> None:
        """The host store's state of the device's buckets copied up again."""
        for key, views in self._views.items():
            for mine, host in zip(views, self._host_views(key)):
                if mine is not None:
                    mine.copy_(host)

    def close(self) -> None:
        self.place(frozenset())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for views in self._views.values() for t in views if t is not None)

    def _write_back(self, key: Key) -> None:
        host = self._host_views(key)
        for mine, theirs in zip(self._views[key], host):
            if mine is not None:
                theirs.copy_(mine)
        if not self._keeps_master:
            g, b = key
            master = self._host.master(g, self._layouts[g].host_slice(b)[1])
            weights = torch.zeros(master.numel(), dtype=master.dtype, device=self._dev.device)
            self._weights_into(g, b, weights)
            master.copy_(weights)

    def _copy_up(self, t: Tensor) -> Tensor:
        """A copy of host tensor ``t`` in device memory (its own memory, also where the device is the host)."""
        return self._dev.hold(torch.empty(t.shape, dtype=t.dtype, device=self._dev.device).copy_(t))

    def _host_views(self, key: Key) -> ChunkViews | None:
        """The host store's views of bucket ``key``'s piece, the master left out where the weights are the master."""
        g, b = key
        where = self._layouts[g].host_slice(b)
        if where is None:
            return None
        views = self._host.views(g, where[1])
        return views if self._keeps_master else views._replace(master=None)
