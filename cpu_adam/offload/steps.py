"""One optimizer step over the rooms, in the order it reads: the grads landed, the state in place, then Adam.

``ready`` waits for the grads, takes the masters of weights written by others, and puts the
device's share of the state in place; ``take`` steps with the window's scale: the host's buckets
a chunk at a time with their uploads (or the previews of ``overlap="backward"``), then the
device's buckets. What can fail is checked first (the scalars, the device's kernel calls), so
the host's failures leave the device's state unchanged and a step is all or nothing.
"""

from __future__ import annotations

import time
from typing import Any

from .rooms import Rooms, synced_state
from .window import Finished

__all__ = ["hyper", "ready", "take"]


def ready(r: Rooms) -> bool:
    """The masters those of the weights, and the device's share of the state in place (the grads have landed);
    returns whether masters were taken from weights written since the last step (previews read other numbers)."""
    r.link.wait_uploads()  # the last step's, from the masters, long done: the masters may be written again
    r.model.check_storage()
    synced = not r.model.in_sync() and synced_state(r)  # in sync, the state is whole where the step needs it
    r.device_store.place(r.share.keys, r.planner.budget())
    return synced


def take(r: Rooms, hypers: list[dict[str, Any] | None], finished: Finished, synced: bool) -> tuple[bool, float]:
    """Adam on every bucket with its group's ``hypers``; returns whether the host's part took the previews made
    during backward, and the host's seconds launching the device's part."""
    r.stepper.check(hypers, finished.got)
    device_part = r.device_stepper.prepare(hypers, finished)  # what may fail there, before anything changes
    with r.dev.uploading():  # after what the compute stream still does with the weights
        overlapped = r.overlap.upload(hypers, finished, synced)
        for g, hyper in enumerate(hypers):
            if overlapped or hyper is None:  # a group of frozen params alone has no store to upload from
                continue
            source = r.stepper.upload_source(g)
            for chunk in r.stepper.chunks[g]:
                r.stepper.step(chunk, hyper, finished.grads, finished.got[g])
                for b in range(chunk.first, chunk.last):  # overlapping the next chunk's compute
                    r.link.up(g, b, finished.got[g], source)
    t = time.perf_counter()
    r.device_stepper.run(device_part)  # queued on the device behind the backward, in its order
    launch_s = time.perf_counter() - t
    for g, hyper in enumerate(hypers):
        if hyper is not None:
            r.model.note_versions(g)  # the optimizer's own writes
    return overlapped, launch_s


def hyper(options: dict[str, Any], scale: float, stochastic_rounding: bool, seed: int) -> dict[str, Any]:
    """A param group's kernel arguments, with the window's grad ``scale``."""
    beta1, beta2 = options["betas"]
    return dict(
        lr=float(options["lr"]),
        beta1=float(beta1),
        beta2=float(beta2),
        eps=float(options["eps"]),
        weight_decay=float(options["weight_decay"]),
        adamw_mode=bool(options["adamw_mode"]),
        grad_scale=scale,
        stochastic_rounding=stochastic_rounding,
        seed=seed,
    )
