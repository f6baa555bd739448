"""Adam over the host state, a chunk at a time: any chunks, in any order, each with the scale it is given.

A chunk is a run of consecutive buckets of one group of about ``KERNEL_CHUNK`` elements of this
rank's shard, all stepped on the host (those the device steps are left out, ``share.py``): one
kernel call each (one parallel region), whose uploads can overlap the next chunk's compute. The
kernel's lists are built from the store's views, the window's grads and the link's outputs;
params that got no grad are left out, and params whose step counts differ get a call per count
(their bias corrections differ): ``runs`` plans them, for the device's stepper too. A chunk's
params count their step once its kernel has run, so a step that raised leaves the bias
corrections as they were.

Counter offsets are the one-process layout's, so stochastic rounding draws the same bits
whatever the world size, bucket size or chunking.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..ops import adam_step, group_counter_base
from .layout import FlatLayout, canonical_offsets
from .link import Link
from .share import Share
from .store import Store

__all__ = ["KERNEL_CHUNK", "Chunk", "Run", "Stepper"]

# One kernel call per chunk of 32M elements: a parallel region per 8M-element bucket cost 5-12%
# (measured on a 16-core host), and the last chunk's upload (64 MB) stays about a millisecond.
KERNEL_CHUNK = 2**25

# (param, slice of its elements, slice of the host buffers, bucket)
Segment = tuple[int, slice, slice, int]


class Chunk(NamedTuple):
    group: int
    first: int  # buckets first..last-1
    last: int


class Run(NamedTuple):
    """Consecutive params of one bucket stepped by one tuple of the kernel's lists."""

    host: slice  # their elements in the host buffers (with no padding between them: padding is never stepped)
    part: slice  # the first param's elements (where its random counters start)
    first: int  # the first param
    bucket: int
    last: int  # the last param


class Stepper:
    def __init__(
        self, store: Store, link: Link, layouts: list[FlatLayout | None], params: list[list[Tensor]], share: Share
    ) -> None:
        self._store = store
        self._link = link
        self._layouts = layouts
        self._params = params
        self._share = share
        self._offsets = [[] if layout is None else canonical_offsets(layout.shapes) for layout in layouts]
        self._chunks: tuple[frozenset, list[list[Chunk]]] = (frozenset(), [])
        self._segments: dict[Chunk, list[Segment]] = {}
        self._members: dict[Chunk, list[int]] = {}
        # The kernel lists of chunks whose params all step alike with un-accumulated grads, kept
        # while the params keep their storage (a direct step writes into it).
        self._lists: dict[Chunk, tuple[list, ...]] = {}
        self._storage = [[] for _ in layouts]

    @property
    def chunks(self) -> list[list[Chunk]]:
        """Per group, the chunks of the buckets the host steps."""
        keys, chunks = self._chunks
        if not chunks or keys is not self._share.keys:
            chunks = [
                [] if layout is None else _chunks(g, layout, KERNEL_CHUNK, self._share)
                for g, layout in enumerate(self._layouts)
            ]
            self._chunks = (self._share.keys, chunks)
        return chunks

    def counter_offset(self, g: int, run: Run) -> int:
        """Where ``run``'s random counters start: its first element's place in the one-process layout."""
        return group_counter_base(g) + self._offsets[g][run.first] + run.part.start

    def check(self, hypers: list[dict[str, Any] | None], got: list[list[bool]]) -> None:
        """Every group's kernel scalars, before any chunk is stepped: a step is all or nothing."""
        for g, hyper in enumerate(hypers):
            if hyper is not None:
                for step in {n + 1 for n, x in zip(self._store.steps[g], got[g]) if x}:
                    adam_step([], [], [], [], step=step, check_only=True, **hyper)

    @property
    def master_is_weight(self) -> bool:
        """Whether the new weights are uploaded from the masters themselves: bf16 masters, which round to themselves,
        so that the kernel writes no bf16 copy (where it writes into the params, ``direct``, it still does)."""
        return self._store.master_dtype == torch.bfloat16 and not self._link.direct

    def upload_source(self, g: int) -> Tensor | None:
        """The host memory group ``g``'s new weights go up from: its masters where they are the weights, else the
        link's slots (None)."""
        return self._store.master(g, slice(None)) if self.master_is_weight else None

    def step(self, chunk: Chunk, hyper: dict[str, Any], grads: dict[tuple[int, int], Tensor], got: list[bool]) -> None:
        """Adam on ``chunk`` with ``hyper`` (its ``grad_scale`` included) over the params that ``got`` a grad; its
        new weights go where ``upload_source`` says."""
        self._check_storage(chunk.group)
        run(self.calls(chunk, hyper, grads, got, weights=not self.master_is_weight))
        self.advance(chunk, got)

    def calls(
        self,
        chunk: Chunk,
        hyper: dict[str, Any],
        grads: dict[tuple[int, int], Tensor],
        got: list[bool],
        *,
        outputs: Tensor | None = None,
        weights: bool = True,
        steps: list[int] | None = None,
    ) -> list[dict[str, Any]]:
        """The kernel calls of a step of ``chunk``, to run now or later (``run``).

        The new bf16 weights go where the link wants them, or into ``outputs`` (a host buffer in
        the layout of the link's), or nowhere (``weights=False``: the state alone). ``steps``: the
        params' step counts before this step, where they are not the store's now (a step deferred).
        """
        return [
            dict(
                params=tensors[0],
                grads=tensors[1],
                exp_avgs=tensors[2],
                exp_avg_sqs=tensors[3],
                bf16_outs=tensors[4] if weights else None,
                counter_offsets=tensors[5],
                state_scales=tensors[6],
                step=step,
                **hyper,
            )
            for step, tensors in self._lists_by_step(chunk, grads, got, outputs, weights, steps).items()
        ]

    def advance(self, chunk: Chunk, got: list[bool]) -> None:
        """The step counts of ``chunk``'s params that ``got`` a grad, once their kernel calls have run."""
        self._store.advance(chunk.group, [i for i in self.members_of(chunk) if got[i]])

    def steps(self, g: int) -> list[int]:
        """Each param's step count (steps taken)."""
        return self._store.steps[g]

    def members_of(self, chunk: Chunk) -> list[int]:
        """The params of ``chunk``'s buckets."""
        if chunk not in self._members:
            bucket_of = self._layouts[chunk.group].bucket_of
            self._members[chunk] = [i for i, b in enumerate(bucket_of) if chunk.first <= b < chunk.last]
        return self._members[chunk]

    def _segments_of(self, chunk: Chunk) -> list[Segment]:
        if chunk not in self._segments:
            layout = self._layouts[chunk.group]
            self._segments[chunk] = [
                (i, part, host, b) for b in range(chunk.first, chunk.last) for i, part, host in layout.piece_segments(b)
            ]
        return self._segments[chunk]

    def forget_lists(self) -> None:
        """The link's buffers changed roles: the kept kernel lists point into the old ones."""
        self._lists.clear()

    def _check_storage(self, g: int) -> None:
        storage = [p.data_ptr() for p in self._params[g]]
        if storage != self._storage[g]:
            self._storage[g] = storage
            for chunk in self.chunks[g]:
                self._lists.pop(chunk, None)

    def _lists_by_step(
        self,
        chunk: Chunk,
        grads: dict[tuple[int, int], Tensor],
        got: list[bool],
        outputs: Tensor | None,
        weights: bool,
        counts: list[int] | None,
    ) -> dict[int, tuple[list, ...]]:
        """The kernel's (masters, grads, exp_avgs, exp_avg_sqs, bf16_outs, counter offsets, state scales), by step.

        Consecutive params of a bucket with no padding between them share one tuple, except where the kernel writes
        straight into each param's storage.
        """
        g = chunk.group
        counts = self._store.steps[g] if counts is None else counts
        buffer = self._link.buffers[g].tensor
        own = weights != self.master_is_weight  # the weights written where step() writes them
        cached = outputs is None and own and counts is self._store.steps[g]
        segments = self._segments_of(chunk)
        steps = {counts[i] + 1 for i, *_ in segments if got[i]}  # the step being taken
        reusable = cached and all(got[i] for i, *_ in segments) and len(steps) == 1
        reusable = reusable and all(grads[(g, b)] is buffer for b in range(chunk.first, chunk.last))
        if reusable and chunk in self._lists:
            return {steps.pop(): self._lists[chunk]}
        out = {}
        for step, runs in self.runs(chunk, got, counts, per_param=cached and self._link.direct).items():
            views = [self._store.views(g, run.host) for run in runs]
            if outputs is not None:
                outs = [outputs[run.host] for run in runs]
            else:
                outs = [self._link.outputs(g, run.first, run.part, run.host) for run in runs] if weights else []
            out[step] = (
                [v.master for v in views],
                [grads[(g, run.bucket)][run.host] for run in runs],
                [v.exp_avg for v in views],
                [v.exp_avg_sq for v in views],
                outs,
                [self.counter_offset(g, run) for run in runs],
                [v.scales for v in views] if views and views[0].scales is not None else [],
            )
        if reusable:
            self._lists[chunk] = next(iter(out.values()))
        return out

    def runs(
        self, chunk: Chunk, got: list[bool], counts: list[int] | None = None, *, per_param: bool = False
    ) -> dict[int, list[Run]]:
        """The runs of ``chunk``'s params that ``got`` a grad, by the step they take (their counts before it:
        ``counts``, the store's by default); ``per_param``: a run per param (the kernel writes each into its own
        storage), else consecutive params of a bucket share one where no padding lies between them.

        Padding is never stepped: with eps=0 Adam makes NaN of its zeros (0 / (0 + 0)), which would land in the
        masters' padding, and with 8-bit moments in the scale of the block a param shares with its padding."""
        counts = self._store.steps[chunk.group] if counts is None else counts
        by_step: dict[int, list[Run]] = {}
        for i, part, host, b in self._segments_of(chunk):
            if not got[i]:
                continue
            runs = by_step.setdefault(counts[i] + 1, [])  # the step being taken
            if not per_param and runs and runs[-1].bucket == b and runs[-1].host.stop == host.start:
                runs[-1] = runs[-1]._replace(host=slice(runs[-1].host.start, host.stop), last=i)
            else:
                runs.append(Run(host, part, i, b, i))
        return by_step


def run(calls: list[dict[str, Any]], *, preview: bool = False) -> None:
    """Runs kernel calls made by ``Stepper.calls`` (``preview``: the bf16 weights alone, no state written)."""
    for kwargs in calls:
        adam_step(**kwargs, preview=preview)


def _chunks(g: int, layout: FlatLayout, size: int, share: Share) -> list[Chunk]:
    """Runs of consecutive buckets the host steps, each ending once it holds ``size`` elements."""
    runs, first, numel = [], None, 0
    for b, piece in enumerate(layout.pieces):
        if share.on_device(g, b):
            if first is not None:
                runs.append(Chunk(g, first, b))
            first, numel = None, 0
            continue
        first = b if first is None else first
        numel += piece.numel
        if numel >= size:
            runs.append(Chunk(g, first, b + 1))
            first, numel = None, 0
    if first is not None:
        runs.append(Chunk(g, first, len(layout.pieces)))
    return runs
