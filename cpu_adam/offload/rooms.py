"""The offload optimizer's rooms, built once in the order they depend on each other, and what they
hold between them: the host and device bytes, the master weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .. import device_kernel
from .._precision import state_dtype
from .auto import Planner
from .device import DeviceOps
from .device_stepper import DeviceStepper
from .device_store import DeviceStore
from .handover import check_sources, hand_over, target_device
from .hooks import Hooks
from .layout import FlatLayout
from .link import Link
from .overlap import BackwardOverlap, NoOverlap
from .params import ModelSide, check_no_shared_memory, check_params, check_unclaimed
from .schedule import schedule_for
from .share import Share, buckets_for
from .stepper import Stepper
from .store import HostStore, Store
from .window import Window
from .world import World, world_of

__all__ = [
    "Options",
    "Rooms",
    "begin_share",
    "build",
    "master_weights",
    "memory_stats",
    "request_share",
    "synced_state",
]


@dataclass(frozen=True)
class Options:
    """How the rooms are laid out and what they hold."""

    bucket_size: int
    master_dtype: torch.dtype
    state_precision: str
    stochastic_rounding: bool
    max_inflight_buckets: int
    overlap: str
    device_fraction: float | str
    device_budget: int | None  # bytes of device memory the device's share keeps between steps; beyond it, it streams

    @property
    def state_dtype(self) -> torch.dtype:
        return state_dtype(self.state_precision)


@dataclass(frozen=True)
class Rooms:
    options: Options
    dev: DeviceOps
    world: World
    layouts: list[FlatLayout | None]
    store: Store
    model: ModelSide
    link: Link
    window: Window
    stepper: Stepper
    share: Share
    device_store: DeviceStore
    device_stepper: DeviceStepper
    planner: Planner
    overlap: NoOverlap | BackwardOverlap
    hooks: Hooks


def build(
    trainable: list[list[Tensor]],
    device: str | torch.device | None,
    process_group: Any | None,
    options: Options,
    seed: int | None,
    hyper_of: Callable[[int, float], dict[str, Any]],
    clip_at: Callable[[], float | None],
) -> tuple[Rooms, int]:
    """The rooms over the ``trainable`` params of each group, and the seed every rank uses.

    With ``device`` the params are handed over to it (from the CPU or the meta device); without,
    they are checked to be bf16 on one device already. Everything is checked, and the ranks agree,
    before anything is allocated, so a refused optimizer leaves the model alone.
    """
    if device is None:
        dev = DeviceOps(check_params(trainable))
    else:
        dev = DeviceOps(target_device(device))
        check_sources([p for ps in trainable for p in ps], dev.device)
        check_no_shared_memory([p for ps in trainable for p in ps if not p.is_meta])
    check_unclaimed(trainable)
    world = world_of(process_group, dev.device)
    world.check_same(
        "the parameters and options",
        (
            [[tuple(p.shape) for p in ps] for ps in trainable],
            options.bucket_size,
            str(options.master_dtype),
            options.state_precision,
            options.stochastic_rounding,
            options.device_fraction,
        ),
        "build the optimizer on the same model, param groups and options on every rank",
    )
    _check_kernel_for(options.device_fraction)  # before anything is handed over
    # Not drawn from torch's generator: building the optimizer must not shift the user's random
    # stream, and replicas seeded per rank must still round alike.
    seed = world.rank0_int(0 if seed is None else seed, "rank 0's seed")
    if device is None:  # ranks initialised with other seeds would train a patchwork
        for ps in trainable:
            for p in ps:
                world.broadcast_from_rank0(p.detach())
    layouts = [
        FlatLayout([p.shape for p in ps], options.bucket_size, world_size=world.size, rank=world.rank) if ps else None
        for ps in trainable
    ]
    store = HostStore(layouts, options.master_dtype, options.state_dtype, pinnable=dev.is_cuda)
    if options.master_dtype == torch.bfloat16:  # the masters are the weights: they go up as they are
        for g, layout in enumerate(layouts):
            if layout is not None:
                store.pin(g, master_only=True)
    model = ModelSide(trainable, layouts, dev.device)
    if device is not None:
        hand_over(model, layouts, store, world)
        check_params(trainable)
    share = Share(layouts)  # empty until request_share below
    link = Link(dev, world, layouts, trainable, options.max_inflight_buckets, share)
    window = Window(dev, world, link, layouts, share)
    stepper = Stepper(store, link, layouts, trainable, share)
    device_store = DeviceStore(dev, layouts, store, link, link.gather_weights, options.master_dtype)
    device_stepper = DeviceStepper(device_store, link, stepper, layouts)
    planner = Planner(dev, world, layouts, device_store, share, options.device_budget)
    overlap = (
        NoOverlap()
        if options.overlap == "none"
        else BackwardOverlap(dev, world, layouts, window, stepper, store, link, hyper_of, share, clip_at)
    )
    hooks = Hooks(dev, trainable, layouts, link, window, schedule_for(world, layouts), overlap, device_store, planner)
    rooms = Rooms(
        options, dev, world, layouts, store, model, link, window, stepper, share, device_store, device_stepper,
        planner, overlap, hooks,
    )  # fmt: skip
    request_share(rooms, options.device_fraction)
    return rooms, seed


def memory_stats(rooms: Rooms) -> dict[str, Any]:
    """Bytes held, measured from the allocated tensors (this process's shard on the host)."""
    layouts = [layout for layout in rooms.layouts if layout is not None]
    params = sum(sum(layout.numels) for layout in layouts)
    master, states = rooms.store.nbytes()
    pinned = rooms.link.pinned_bytes
    accumulator = rooms.window.accumulator_bytes
    overlap = rooms.overlap.extra_bytes
    host = master + states + pinned + accumulator + overlap
    return {
        "params": params,
        "world_size": rooms.world.size,
        "shard_elements": sum(layout.shard_numel for layout in layouts),  # this rank's, padding included
        "host_bytes": host,
        "host_bytes_per_param": host / params if params else math.nan,  # no param to share them: undefined
        "master_bytes": master,
        "state_bytes": states,
        "pinned_bytes": pinned,
        "pinned": rooms.link.pinned,
        "accumulator_bytes": accumulator,
        "overlap_bytes": overlap,  # the spare bf16 buffer of overlap="backward"
        "weights_bytes": sum(p.numel() * p.element_size() for ps in rooms.model.params for p in ps),
        "device_bytes": rooms.dev.held_bytes,
        "device_peak_bytes": rooms.dev.peak_bytes,
        "device_share": rooms.share.fraction,  # of this rank's elements, stepped on the device
        "device_state_bytes": rooms.device_store.nbytes(),  # their masters and moments, in device memory now
        "device_streamed_bytes": rooms.device_store.streamed_bytes(),  # of them, each way per step
    }


def request_share(rooms: Rooms, fraction: float | str) -> float | str:
    """The device's share from the next window with no grads yet (this one if it has none): a fraction, or "auto"
    (the planner's, after each step). Returns ``fraction``."""
    _check_kernel_for(fraction)
    auto = fraction == "auto"
    rooms.planner.auto = auto and device_kernel.available()
    if not auto:
        rooms.share.request(buckets_for(rooms.layouts, fraction))
        if not rooms.window.begun:
            begin_share(rooms)
    return fraction


def begin_share(rooms: Rooms) -> None:
    """A window begins with the share last requested. Where it changed, the host store is made whole for the
    buckets that move before any backward reads it: the deferred steps of overlap="backward" committed (a bucket
    joining the device takes its state up from the host store), and the state of the buckets leaving the device
    copied back (the previews of the host's buckets read it as their grads land)."""
    if rooms.share.begin():
        rooms.overlap.settle()
        rooms.device_store.keep_only(rooms.share.keys)


def _check_kernel_for(fraction: float | str) -> None:
    """A share of the step on the device needs the device kernel ("auto" plans none without it)."""
    if fraction != "auto" and fraction > 0 and not device_kernel.available():
        raise RuntimeError(f"cpu_adam.OffloadOptimizer: device_fraction={fraction}: {device_kernel.missing_reason()}")


def synced_state(rooms: Rooms) -> bool:
    """The host store made whole: every commit run, the device's state copied down, the masters taken from weights
    written by others (on the device too); returns whether any master was taken."""
    rooms.overlap.settle()
    rooms.device_store.write_back()
    synced = not rooms.model.in_sync() and rooms.model.sync_masters(rooms.store)
    if synced:
        rooms.device_store.reload()
    return synced


def master_weights(rooms: Rooms) -> list[Tensor]:
    """The host master weight of each trainable param (param_groups order, tied params once), as views."""
    if rooms.world.size > 1:
        raise RuntimeError(
            "cpu_adam.OffloadOptimizer.master_weights: with a process group each rank holds a shard of the "
            "masters; gather the ranks' state_dict() and use cpu_adam.distributed.consolidate_state_dict"
        )
    synced_state(rooms)
    return [
        rooms.store.master(g, slice(*layout.param_range(i))).view(shape)
        for g, layout in enumerate(rooms.layouts)
        if layout is not None
        for i, shape in enumerate(layout.shapes)
    ]
