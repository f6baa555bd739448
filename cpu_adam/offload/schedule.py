"""When a bucket's grads go down: a policy per world, asked by the hooks, answering with buckets to send.

A bucket is a key ``(group, bucket)``. Each event returns the keys to send now, in order:
- ``opening``: a staging area is about to open for the key (it may send others first);
- ``completed``: every param of the key has been packed;
- ``graph_task_ended``: one autograd graph task ended (reentrant checkpointing nests them);
- ``backward_ended``: the user's backward ended; ``all_sent`` follows once its buckets were sent.

``owes_peers``: whether a backward that raised half-way must still send its remaining buckets
and end like any other, because the other ranks wait in the same collectives (ZeRO).

``EarlyFlush`` (a single process) sends a bucket as soon as it is complete, and sends the oldest
open bucket early when more than ``OPEN_BUCKETS`` are open (params that never arrive, or arrive in
another order than their registration), so device memory for grads stays a few buckets. Params
still to come re-open it: a second contribution, which the window sums.

``FixedOrder`` (ZeRO) sends in one order on every rank, whatever order the grads come in (as DDP
reduces its buckets), so ranks whose graphs differ still pair the same reduce-scatters: first the
last bucket first, as backward produces the grads of the last layers first; after the first
backward, the order in which rank 0's buckets filled.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

from .layout import FlatLayout
from .world import GroupWorld, World

__all__ = ["OPEN_BUCKETS", "EarlyFlush", "FixedOrder", "Schedule", "schedule_for"]

Key = tuple[int, int]

# Staging areas open at once (partly packed buckets) before the oldest is sent early.
OPEN_BUCKETS = 2


class Schedule(Protocol):
    owes_peers: bool

    def opening(self, key: Key, shape: torch.Size) -> list[Key]: ...

    def completed(self, key: Key) -> list[Key]: ...

    def sent(self, key: Key) -> None: ...

    def graph_task_ended(self) -> list[Key]: ...

    def backward_ended(self) -> list[Key]: ...

    def all_sent(self) -> None: ...

    def reset(self) -> None: ...


class EarlyFlush:
    owes_peers = False

    def __init__(self) -> None:
        self._open: deque[Key] = deque()  # buckets with a staging area, oldest first

    def opening(self, key: Key, shape: torch.Size) -> list[Key]:
        early = [self._open[0]] if len(self._open) >= OPEN_BUCKETS else []
        self._open.append(key)
        return early

    def completed(self, key: Key) -> list[Key]:
        return [key]

    def sent(self, key: Key) -> None:
        self._open.remove(key)

    def graph_task_ended(self) -> list[Key]:
        return list(self._open)

    def backward_ended(self) -> list[Key]:
        return []

    def all_sent(self) -> None:
        pass

    def reset(self) -> None:
        self._open.clear()


class FixedOrder:
    owes_peers = True

    def __init__(self, world: GroupWorld, layouts: list[FlatLayout | None]) -> None:
        self._world = world
        self._sequence = [
            (g, b)
            for g in reversed(range(len(layouts)))
            if layouts[g] is not None
            for b in reversed(range(len(layouts[g].buckets)))
        ]
        self._order = {key: n for n, key in enumerate(self._sequence)}
        self._next = 0  # position in the sequence of the next bucket to send in this backward
        self._ready: set[Key] = set()
        self._learned = False
        self._filled: list[Key] = []  # the first backward's buckets, in the order they filled

    def opening(self, key: Key, shape: torch.Size) -> list[Key]:
        if self._order[key] < self._next:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: a parameter of shape {tuple(shape)} got a second grad in one "
                "backward after its bucket was reduced across the ranks (reentrant activation checkpointing with a "
                "parameter used in several segments, or used both inside and outside one). With a process group, "
                "use torch.utils.checkpoint(..., use_reentrant=False), or keep each parameter in one segment"
            )
        return []

    def completed(self, key: Key) -> list[Key]:
        if not self._learned:
            self._filled.append(key)
        self._ready.add(key)
        due = []
        while self._next < len(self._sequence) and self._sequence[self._next] in self._ready:
            due.append(self._sequence[self._next])
            self._ready.discard(due[-1])
            self._next += 1
        return due

    def sent(self, key: Key) -> None:
        pass

    def graph_task_ended(self) -> list[Key]:
        return []

    def backward_ended(self) -> list[Key]:
        """Every bucket not sent yet, in order (a bucket no grad came for on this rank goes as zeros)."""
        due = self._sequence[self._next :]
        self._next = 0
        self._ready.clear()
        return due

    def all_sent(self) -> None:
        """After the first backward, every rank takes rank 0's fill order (a collective: after the sends)."""
        if self._learned:
            return
        # Every rank takes the order in which rank 0's buckets filled (as DDP rebuilds its buckets):
        # a bucket that fills early is reduced early, where the initial order can hold many.
        self._learned = True
        seen = set(self._filled)
        order = self._filled + [key for key in self._sequence if key not in seen]
        index = torch.tensor([self._order[key] for key in order], dtype=torch.int64, device=self._world.device)
        self._world.broadcast_from_rank0(index, "rank 0's bucket order")
        self._sequence = [self._sequence[n] for n in index.tolist()]
        self._order = {key: n for n, key in enumerate(self._sequence)}

    def reset(self) -> None:
        self._next = 0
        self._ready.clear()


def schedule_for(world: World, layouts: list[FlatLayout | None]) -> Schedule:
    return FixedOrder(world, layouts) if isinstance(world, GroupWorld) else EarlyFlush()
