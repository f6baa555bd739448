"""``device_fraction="auto"``: the largest share of the step the device can take without slowing training.

The device kernel steps an element tens of times faster than the host's cores (HBM against host
DRAM), so the best share is the largest the device can hold or feed: its state resident in the
memory the forward and backward leave free, and beyond that streamed, as far as the link moves it
in the shadow of forward and backward. Measured, not assumed: the first step is the host's alone
(no share is known before a backward has shown its memory), and every later step is planned from
what the last ones showed:

- ``busy``: the most memory allocated while grads landed (the activations' peak, roughly),
- ``available``: the memory the allocator can hand out at the step (activations freed),
- ``window_s``: the host's time between steps (the forward and backward, what streaming hides behind),
- the link's rates each way (a short probe, once), and the bytes the host's buckets move already.

On the CPU device the device's kernel would run on the host's own cores: the share is 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from .device import DeviceOps
from .device_store import DeviceStore
from .layout import FlatLayout
from .share import Key, Share, buckets_for, share_of
from .world import World

__all__ = ["Observed", "Plan", "Planner", "plan_share"]

# Of the memory left free, what the share may take: the rest absorbs fragmentation and the next steps' variation.
MEMORY_USE = 0.85
# Of the link's time in the window, what streaming may take: the grads down and weights up of the host's buckets,
# and the variation between steps, keep the rest.
LINK_USE = 0.7


@dataclass(frozen=True)
class Observed:
    """What the last steps showed (bytes, seconds, bytes/s)."""

    total_memory: int
    busy: int  # peak memory allocated during backward, before this share's resident state was added
    available: int  # memory the allocator can hand out at the step
    window_s: float  # forward and backward: the host's time between steps
    up_rate: float
    down_rate: float


@dataclass(frozen=True)
class Plan:
    keys: frozenset[Key]
    budget: int  # bytes of resident state
    fraction: float  # of the elements


def plan_share(
    layouts: list[FlatLayout | None], state_bytes: dict[Key, int], traffic_bytes: dict[Key, int], seen: Observed
) -> Plan:
    """The share for the next steps: buckets in the device's order (``buckets_for``), resident while their state
    fits the memory the backward left free, then streamed while the link can move their state both ways in
    the window (less what the host's buckets move: ``traffic_bytes``, per bucket per direction) and the memory
    at the step holds it."""
    order = sorted(buckets_for(layouts, 1.0))
    resident_room = max(0, int((seen.total_memory - seen.busy) * MEMORY_USE))
    link_room = LINK_USE * seen.window_s * min(seen.up_rate, seen.down_rate)
    link_room -= sum(traffic_bytes.values())  # the host's buckets' grads and weights
    step_room = int(seen.available * MEMORY_USE)
    keys, resident, streamed, crossing = set(), 0, 0, 0
    for key in order:
        size = state_bytes[key]
        if resident + size <= resident_room:
            resident += size
        elif crossing + size - traffic_bytes[key] <= link_room and resident + streamed + size <= step_room:
            streamed += size
            crossing += size - traffic_bytes[key]  # its own grads and weights no longer cross
        else:
            break
        keys.add(key)
    return Plan(frozenset(keys), resident, share_of(layouts, frozenset(keys)))


class Planner:
    """What the share's plan needs, measured as training runs; the resident budget; with ``auto``, the share.

    The link's rates come from one short probe; memory from the allocator at each landing (during
    backward) and at the step; the window from the host's clock between steps.
    """

    def __init__(
        self,
        dev: DeviceOps,
        world: World,
        layouts: list[FlatLayout | None],
        store: DeviceStore,
        share: Share,
        budget: int | None,
    ) -> None:
        self._dev = dev
        self._world = world
        self._layouts = layouts
        self._store = store
        self._share = share
        self.auto = False  # rooms.request_share sets it
        self._budget = budget  # the user's, else measured
        self._busy = 0
        self._available = 0
        self._window_s: float | None = None
        self._ended: float | None = None

    def landed(self) -> None:
        """During backward: the memory the rest of training holds now, beyond the share's own state."""
        if self._dev.is_cuda:
            self._busy = max(self._busy, self._dev.memory().allocated - self._store.nbytes())

    def budget(self) -> int | None:
        """At the step: the bytes of state the device may keep between steps (None: all the share's)."""
        if self._budget is not None or not self._dev.is_cuda:
            return self._budget
        memory = self._dev.memory()
        self._available = memory.available
        return max(0, int((memory.total - self._busy) * MEMORY_USE))

    def step_started(self, now: float) -> None:
        if self._ended is not None:
            self._window_s = now - self._ended

    def step_ended(self, now: float) -> None:
        """After a step: with ``auto``, the share of the next windows planned from what this one showed."""
        self._ended = now
        if not self.auto:
            return
        seen = self.observed()
        if seen is None:  # alike on every rank
            self._share.request(frozenset())
            return
        keys = buckets_for(self._layouts, 1.0)
        state = {key: self._store.state_bytes(key) for key in keys}
        traffic = {(g, b): 2 * self._layouts[g].pieces[b].numel for g, b in keys}  # bf16 grads down, weights up
        planned = len(plan_share(self._layouts, state, traffic, seen).keys)
        # Every rank steps the same buckets on the device (their weights are gathered in one order): the least.
        agreed = -self._world.max_over_ranks([-planned])[0]
        self._share.request(frozenset(sorted(keys)[:agreed]))

    def observed(self) -> Observed | None:
        """What the last steps showed; None before a window was measured, or where the device is the host's cores."""
        if not self._dev.is_cuda or self._window_s is None or not self._busy:
            return None
        memory = self._dev.memory()
        up, down = self._dev.link_rates()
        return Observed(memory.total, self._busy, self._available, self._window_s, up, down)
