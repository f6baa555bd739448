"""Which buckets the device steps: the share of each group's elements whose Adam runs where the weights are.

A bucket's state lives, and is stepped, either in host RAM (by the CPU kernel) or in device memory
(by the device kernel, ``cpu_adam.device_kernel``): both give the same bits, so the share changes
nothing but the time. The device takes each group's first buckets (the model's first layers:
their grads land last in backward, so their copies down would be the last to finish, and the next
forward needs their weights first) up to its share of the group's elements.

The share is set between windows: a backward's grads stay on the device or go down as their
buckets' places were when it began, and the state moves at the change (``DeviceStore.place``).
"""

from __future__ import annotations

import math

from .layout import FlatLayout

__all__ = ["Key", "Share", "buckets_for", "share_of"]

Key = tuple[int, int]  # (group, bucket)


def buckets_for(layouts: list[FlatLayout | None], fraction: float) -> frozenset[Key]:
    """Each group's first buckets holding ``fraction`` of its elements, to the nearest bucket boundary; a bucket of
    zero-size params alone holds no state to step anywhere, and stays the host's."""
    keys = set()
    for g, layout in enumerate(layouts):
        if layout is None or fraction <= 0:
            continue
        want, taken = fraction * layout.numel, 0
        for b, bucket in enumerate(layout.buckets):
            if taken + bucket.numel / 2 > want and fraction < 1:
                break
            if bucket.numel:
                keys.add((g, b))
            taken += bucket.numel
    return frozenset(keys)


def share_of(layouts: list[FlatLayout | None], keys: frozenset[Key]) -> float:
    """The share of this rank's elements that the buckets ``keys`` hold."""
    total = sum(layout.shard_numel for layout in layouts if layout is not None)
    mine = sum(layouts[g].pieces[b].numel for g, b in keys)
    return mine / total if total else 0.0


class Share:
    """The buckets the device steps in this window, and the share of the elements they hold."""

    def __init__(self, layouts: list[FlatLayout | None]) -> None:
        self._layouts = layouts
        self.keys: frozenset[Key] = frozenset()
        self._requested: frozenset[Key] | None = None

    def on_device(self, g: int, b: int) -> bool:
        return (g, b) in self.keys

    def request(self, keys: frozenset[Key]) -> None:
        """The buckets the device is to step from the next window on (``begin``); the step moves their state."""
        self._requested = keys

    def begin(self) -> bool:
        """A window begins: the buckets last requested are the device's. Returns whether they changed."""
        before = self.keys
        if self._requested is not None:
            self.keys, self._requested = self._requested, None
        return self.keys != before

    @property
    def fraction(self) -> float:
        """The share of this rank's elements the device steps."""
        return share_of(self._layouts, self.keys)


def checked_fraction(value: object) -> float | str:
    """A ``device_fraction`` argument: a number in [0, 1], or "auto"."""
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(
            f"cpu_adam.OffloadOptimizer: device_fraction is the share of each group's elements the device steps, a "
            f'number in [0, 1] or "auto"; got {value!r}'
        )
    return float(value)


def checked_budget(value: object) -> int | None:
    """A ``device_budget`` argument: bytes (an int >= 0), or None for as much as the share needs."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"cpu_adam.OffloadOptimizer: device_budget is the bytes of device memory the device's share keeps between "
            f"steps (the rest of its state streams), an int >= 0 or None; got {value!r}"
        )
    return value
