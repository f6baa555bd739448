"""The state of the buckets the device steps, in device memory: the store's second implementation.

Each such bucket's piece is laid out as in the host store (masters, moments, 8-bit scales). Up to
a budget of device memory the state is resident: copied up when the bucket joins the device's
share, back when it leaves, and in between its host copy is stale (``write_back`` makes the host
store whole, for a state dict; ``reload`` takes it up again, after a load or masters taken from
weights written by others). Beyond the budget it streams: the host store stays its home, and each
step copies it up when the bucket's grads land in backward (as the activations free memory) and
back down after the device has stepped it, during the next forward, all on the link's side
stream. With bf16 master weights the device keeps no master: the weights are the master (a bf16
master rounds to itself), so only the moments live or travel here. Step counts stay in the host
store, one list for both.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .device import DeviceOps, Event
from .layout import FlatLayout
from .link import Link
from .share import Key
from .store import ChunkViews, HostStore

__all__ = ["DeviceStore"]


class DeviceStore:
    def __init__(
        self,
        dev: DeviceOps,
        layouts: list[FlatLayout | None],
        host: HostStore,
        link: Link,
        weights_into: Callable[[int, int, Tensor], None],
        master_dtype: torch.dtype,
    ) -> None:
        self._dev = dev
        self._layouts = layouts
        self._host = host
        self._link = link
        self._weights_into = weights_into  # (g, b, piece): the params' piece of bucket b, copied into it
        self._keeps_master = master_dtype == torch.float32
        self._resident: dict[Key, ChunkViews] = {}
        self.streamed: frozenset[Key] = frozenset()
        self._fetched: dict[Key, tuple[ChunkViews, Event]] = {}  # streamed state up for this step
        self._stepped: set[Key] = set()  # fetched state the device has written
        self._down: Event = None  # the last copy of streamed state down

    @property
    def keys(self) -> frozenset[Key]:
        return frozenset(self._resident) | self.streamed

    # -- where the state lives ------------------------------------------------------------------

    def place(self, keys: frozenset[Key], budget: int | None) -> None:
        """The state of ``keys`` on the device: resident for the first of them whose state fits ``budget`` bytes
        (None: all), streamed for the rest; the state of the others in the host store."""
        self.keep_only(keys)
        resident, used = set(), 0
        for key in sorted(keys):
            size = self.state_bytes(key)
            if budget is None or used + size <= budget:
                resident.add(key)
                used += size
        for key in [key for key in self._resident if key not in resident]:  # streamed from now on
            self._evict(key)
        for key in sorted(resident - set(self._resident)):
            views, event = self._link.state_up(self._host_views(key))
            self._dev.wait_host(event)
            self._resident[key] = views
        self.streamed = frozenset(keys - resident)
        for key in [key for key in self._fetched if key not in self.streamed]:  # resident now: up from the host
            self._dev.release(list(_tensors(self._fetched.pop(key)[0])))
        for g in {g for g, _ in self.streamed}:
            self._host.pin(g)

    def keep_only(self, keys: frozenset[Key]) -> None:
        """The buckets not in ``keys`` leave the device: their state back in the host store, their memory given back."""
        self._dev.wait_host(self._down)
        for key in [key for key in self._resident if key not in keys]:
            self._evict(key)
        for key in self.streamed - keys:
            self._masters_from_weights(key)  # a streamed bucket leaving: its master was the weights
        self.streamed &= keys

    def views(self, key: Key) -> ChunkViews:
        """Bucket ``key``'s state on the device, for the compute stream (streamed state fetched if it is not)."""
        if key in self._resident:
            return self._resident[key]
        self.fetch(key)
        views, event = self._fetched[key]
        self._dev.compute_waits(event)
        return ChunkViews(*(None if t is None else self._dev.on_compute(t) for t in views))

    def fetch(self, key: Key) -> None:
        """A streamed bucket's state on its way up (once per step); a resident's or a host bucket's: nothing."""
        if key in self.streamed and key not in self._fetched:
            self._fetched[key] = self._link.state_up(self._host_views(key))

    def stepped(self, key: Key) -> None:
        self._stepped.add(key)

    def release(self) -> None:
        """The streamed state goes back: what the device stepped on its way down, the rest dropped."""
        for key, (views, _) in self._fetched.items():
            if key in self._stepped:
                self._down = self._link.state_down(views, self._host_views(key))
            self._dev.release(list(_tensors(views)))
        self._fetched.clear()
        self._stepped.clear()

    # -- the host store made whole, and taken up again -----------------------------------------------

    def write_back(self) -> None:
        """The host store made whole: the resident state copied down, the streamed state's copies waited for, and
        with bf16 masters the weights copied into the masters."""
        for key in self._resident:
            self._write_back(key)
        self._dev.wait_host(self._down)
        for key in self.streamed:
            self._masters_from_weights(key)

    def reload(self) -> None:
        """The host store's state taken up again where the device holds it (resident, or fetched this step)."""
        for views, key in [(v, k) for k, v in self._resident.items()] + [(v, k) for k, (v, _) in self._fetched.items()]:
            for mine, host in zip(views, self._host_views(key)):
                if mine is not None:
                    mine.copy_(host)

    def close(self) -> None:
        """Device memory given back; the state is not copied down."""
        for views in [*self._resident.values(), *(views for views, _ in self._fetched.values())]:
            self._dev.release(list(_tensors(views)))
        self._resident.clear()
        self._fetched.clear()

    # -- bytes ------------------------------------------------------------------------------------

    def state_bytes(self, key: Key) -> int:
        """Bytes of bucket ``key``'s state in device memory (its master with fp32 masters, moments, 8-bit scales)."""
        return sum(t.numel() * t.element_size() for t in _tensors(self._host_views(key)))

    def nbytes(self) -> int:
        """Bytes held now: the resident state, and streamed state fetched for this step."""
        held = [*self._resident.values(), *(views for views, _ in self._fetched.values())]
        return sum(t.numel() * t.element_size() for views in held for t in _tensors(views))

    def streamed_bytes(self) -> int:
        """Bytes of streamed state each step moves each way."""
        return sum(self.state_bytes(key) for key in self.streamed)

    # -- a bucket's state ---------------------------------------------------------------------------

    def _write_back(self, key: Key) -> None:
        self._dev.wait_host(self._link.state_down(self._resident[key], self._host_views(key)))
        self._masters_from_weights(key)

    def _evict(self, key: Key) -> None:
        """A resident bucket's state back in the host store, and its device memory given back."""
        self._write_back(key)
        self._dev.release(list(_tensors(self._resident.pop(key))))

    def _masters_from_weights(self, key: Key) -> None:
        if not self._keeps_master:
            g, b = key
            master = self._host.master(g, self._layouts[g].host_slice(b)[1])
            weights = torch.zeros(master.numel(), dtype=master.dtype, device=self._dev.device)
            self._weights_into(g, b, weights)
            master.copy_(weights)

    def _host_views(self, key: Key) -> ChunkViews:
        """The host store's views of bucket ``key``'s piece, the master left out where the weights are the master."""
        g, b = key
        views = self._host.views(g, self._layouts[g].host_slice(b)[1])
        return views if self._keeps_master else views._replace(master=None)


def _tensors(views: ChunkViews) -> list[Tensor]:
    return [t for t in views if t is not None]
