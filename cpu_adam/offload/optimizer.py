"""The offload optimizer's face: a ``torch.optim.Optimizer`` whose step reads wait -> scale -> step -> upload.

The rooms it wires together (one concept each):
- ``params.py``: the model's side (checks, ownership, weights written by others); ``handover.py``
  moves a CPU or meta model onto the device;
- ``hooks.py`` packs grads during backward; ``schedule.py`` says when a bucket goes down;
- ``link.py`` moves every byte between device and host through pinned slots;
- ``window.py`` sums what a window's backward passes sent and turns it into one scale or a skip;
- ``store.py`` holds masters, moments and step counts; ``stepper.py`` runs Adam over them a chunk
  at a time;
- ``world.py`` is the ranks (a single process is a world of one); ``state_dict.py`` the format.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .._precision import resolved_precision, state_dtype
from .._validation import check_hyper_parameters, check_param_group, checked_seed
from . import state_dict as checkpoint
from .device import DeviceOps
from .handover import check_sources, hand_over, target_device
from .hooks import Hooks
from .layout import FlatLayout
from .link import Link
from .options import DEFAULT_BUCKET_SIZE, check_options, checked_max_grad_norm
from .overlap import overlap_for
from .params import ModelSide, check_no_shared_memory, check_params, check_unclaimed, claim, param_groups, release
from .placeholder import OffloadedGrad
from .schedule import schedule_for
from .stepper import Stepper
from .store import HostStore
from .window import Window
from .world import world_of

__all__ = ["OffloadOptimizer"]

logger = logging.getLogger("cpu_adam.offload")
OWNER = "cpu_adam.OffloadOptimizer"


class OffloadOptimizer(torch.optim.Optimizer):
    """Adam/AdamW for a bf16 model on a GPU whose master weights and Adam states live in host RAM.

    ``params`` are the model's bf16 parameters (or param groups with their own ``lr``,
    ``betas``, ``eps``, ``weight_decay``), all on one device: a CUDA GPU, or the CPU. Params keep
    their own storage (the model stays an ordinary model); frozen ones are left alone. Grads are
    taken from the params during backward (``param.grad`` then holds a placeholder that answers
    its norm and scaling, so ``torch.nn.utils.clip_grad_norm_`` works, and raises on other uses):
    clip with it or with ``max_grad_norm``; ``last_grad_norm`` holds the last step's norm.
    ``close()`` detaches the optimizer from its params (hooks removed, host buffers released).
    ``state_precision`` keeps the moments as "fp32" (the default), "bf16" or "8bit" (uint8 codes
    with a float32 scale per block of 256 elements, as CPUAdam's, ``cpu_adam.quant8``);
    ``fp32_optimizer_states`` is DeepSpeed's shorthand for the first two. Host bytes per param,
    the pinned bf16 buffer included: 14 (fp32 master and states), 10 (bf16 states), 8 (bf16
    master and states), 8.03 (8-bit states), 6.03 (bf16 master and 8-bit states), see
    ``memory_stats()``.

    With ``device`` the params may be on the CPU (any float dtype: their values become the master
    weights at full precision) or on the meta device (their weights must be written before the
    first step); they are moved to ``device`` as bf16 one at a time (``handover.py``).

    ``overlap="backward"`` keeps the state one step behind: a worker thread commits the deferred
    step and previews the new one as each bucket's grads land (+2 bytes per param), and
    ``step()`` uploads the previews where they all hold; otherwise, and with ``"none"`` (the
    default), the step runs after backward. Both give the same bits (``overlap.py``).

    With ``process_group`` (a ``torch.distributed`` group, e.g. ``dist.group.WORLD``) the ranks
    train one data-parallel model: grads are averaged over the ranks as DDP does, and each rank
    keeps 1/N of the host state (host bytes per param divided by N). Every rank must build the
    optimizer on the same model and call backward and ``step`` alike. ``state_dict()`` is then
    this rank's shard: ``cpu_adam.distributed.consolidate_state_dict`` joins the shards into a
    full state dict, which any number of ranks can load.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool | None = None,
        state_precision: str | None = None,
        master_weights_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        process_group: Any | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        max_inflight_buckets: int = 2,
        stochastic_rounding: bool = False,
        seed: int | None = None,
        device: str | torch.device | None = None,
        overlap: str = "none",
    ) -> None:
        check_hyper_parameters(OWNER, lr, betas, eps, weight_decay)
        self.state_precision = resolved_precision(OWNER, state_precision, fp32_optimizer_states)
        seed = None if seed is None else checked_seed(OWNER, seed)
        check_options(master_weights_dtype, stochastic_rounding, max_inflight_buckets)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        self._building = True
        super().__init__(param_groups(params), defaults)
        self._building = False

        self.max_grad_norm = max_grad_norm
        self.master_weights_dtype = master_weights_dtype
        self.state_dtype = state_dtype(self.state_precision)
        self.stochastic_rounding = stochastic_rounding
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self.last_step_overlapped = False  # whether the last step's previews held (overlap="backward")
        # Seconds the last step spent waiting for grads to come down, on the norm, on the kernel.
        self.step_timings: dict[str, float] = {}
        self.bucket_size = bucket_size
        self._closed = False
        self._warned_no_grads = False

        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        if device is None:
            self._dev = DeviceOps(check_params(trainable))
        else:  # a model on the CPU or the meta device, handed over (see handover.py)
            self._dev = DeviceOps(target_device(device))
            check_sources([p for ps in trainable for p in ps], self._dev.device)
            check_no_shared_memory([p for ps in trainable for p in ps if not p.is_meta])
        check_unclaimed(trainable)
        # Before anything is allocated, so a bad group leaves the model alone.
        self._world = world = world_of(process_group, self._dev.device)
        world.check_same(
            "the parameters and options",
            (
                [[tuple(p.shape) for p in ps] for ps in trainable],
                bucket_size,
                str(master_weights_dtype),
                self.state_precision,
                stochastic_rounding,
            ),
            "build the optimizer on the same model, param groups and options on every rank",
        )
        # Not drawn from torch's generator: building the optimizer must not shift the user's random
        # stream, and replicas seeded per rank must still round alike.
        self.seed = world.rank0_int(0 if seed is None else seed, "rank 0's seed")
        if device is None:  # ranks initialised with other seeds would train a patchwork
            for ps in trainable:
                for p in ps:
                    world.broadcast_from_rank0(p.detach())
        self._layouts = [
            FlatLayout([p.shape for p in ps], bucket_size, world_size=world.size, rank=world.rank) if ps else None
            for ps in trainable
        ]
        self._store = HostStore(self._layouts, master_weights_dtype, self.state_dtype)
        self._model = ModelSide(trainable, self._layouts, self._dev.device)
        if device is not None:
            hand_over(self._model, self._layouts, self._store, world)
            check_params(trainable)
        self._link = Link(self._dev, world, self._layouts, trainable, max_inflight_buckets)
        self._window = Window(world, self._link, self._layouts)
        self._stepper = Stepper(self._store, self._link, self._layouts, trainable)
        self._overlap = overlap_for(
            overlap,
            self._dev,
            world,
            self._layouts,
            self._window,
            self._stepper,
            self._link,
            lambda g, scale: self._hyper(self.param_groups[g], scale),
        )
        self._hooks = Hooks(
            self._dev,
            trainable,
            self._layouts,
            self._link,
            self._window,
            schedule_for(world, self._layouts),
            self._overlap,
        )
        self._rooms = checkpoint.Rooms(
            self._layouts, self._store, self._model, self._link, self._dev, world, bucket_size, self.state_dtype
        )
        # Wrappers that copy this __dict__ (Lightning's) are other objects: they must not close it.
        # An id, not a weak reference: the cycle collector clears those before __del__ runs.
        self._owner_id = id(self)
        claim(trainable, self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise NotImplementedError(
                "cpu_adam.OffloadOptimizer lays params out in flat buffers when it is built: "
                "pass every param group to the constructor"
            )
        check_param_group(f"{OWNER} param group {len(self.param_groups)}", {**self.defaults, **param_group})
        super().add_param_group(param_group)

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold of the global grad norm; None does not clip."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._max_grad_norm = checked_max_grad_norm(value)

    @property
    def world_size(self) -> int:
        return self._world.size

    @property
    def rank(self) -> int:
        return self._world.rank

    # -- step ---------------------------------------------------------------------------------

    _step_supports_amp_scaling = True  # so torch.amp.GradScaler hands its scale to step(), which refuses it

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step on the grads of the backward passes since the last step or zero_grad."""
        self._check_usable()
        self._model.check_written()
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            self.grad_scale = self.found_inf = None
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer does not take a GradScaler: bf16 has float32's exponent range, so loss "
                "scaling is not needed. Call loss.backward() and optimizer.step() without the scaler; clip with "
                "clip_grad_norm_ or max_grad_norm, and non-finite grads skip the step by themselves"
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, options in enumerate(self.param_groups):  # edited groups, refused before anything changes
            check_param_group(f"{OWNER} param group {g}", options)
        self._world.check_alive()  # also after a backward that failed on it
        self._window.check_finished()
        if not self._window.has_grads:  # with ZeRO, the ranks shared which params got grads
            self._warn_no_grads()
            return loss  # no grads: like torch's optimizers, leave every param as it is
        t0 = time.perf_counter()
        self._link.wait_all()
        self._overlap.settle()  # this window's previews, and the commits of the step before
        t1 = time.perf_counter()
        self._model.check_storage()
        synced = self._model.sync_masters(self._store)
        self.last_step_overlapped = False
        finished = self._window.finish(self.max_grad_norm)
        self.last_grad_norm = finished.norm
        t2 = time.perf_counter()
        if finished.scale is None:
            self.skipped_steps += 1
            logger.warning(
                "cpu_adam.OffloadOptimizer: gradient norm is %s, step skipped (%d skipped so far)",
                finished.norm,
                self.skipped_steps,
            )
        else:
            hypers = [
                None if layout is None else self._hyper(o, finished.scale)
                for o, layout in zip(self.param_groups, self._layouts)
            ]
            self._stepper.check(hypers, finished.got)
            previews = self._overlap.previews(hypers, finished, synced)
            self.last_step_overlapped = previews is not None
            with self._dev.side_stream():  # uploads wait for what the compute stream still does with the weights
                for g, hyper in enumerate(hypers):
                    if hyper is None:
                        continue
                    for chunk in self._stepper.chunks[g]:  # each chunk's uploads overlap the next chunk's compute
                        if previews is None:
                            self._stepper.step(chunk, hyper, finished.grads, finished.got[g])
                        for b in range(chunk.first, chunk.last):
                            self._link.up(g, b, finished.got[g], None if previews is None else previews[g])
                    self._model.note_versions(g)  # the optimizer's own writes
                event = self._dev.record()
            self._dev.compute_waits(event)
            if previews is not None:
                self._overlap.defer(hypers, finished)  # the state, committed during the next backward
        self._new_window()
        self.step_timings = {"grads_wait_s": t1 - t0, "norm_s": t2 - t1, "adam_s": time.perf_counter() - t2}
        return loss

    def _hyper(self, options: dict[str, Any], scale: float) -> dict[str, Any]:
        beta1, beta2 = options["betas"]
        return dict(
            lr=float(options["lr"]),
            beta1=float(beta1),
            beta2=float(beta2),
            eps=float(options["eps"]),
            weight_decay=float(options["weight_decay"]),
            adamw_mode=bool(options["adamw_mode"]),
            grad_scale=scale,
            stochastic_rounding=self.stochastic_rounding,
            seed=self.seed,
        )

    def _new_window(self) -> None:
        self._window.reset()
        self._hooks.reset()
        self._overlap.reset()

    def _warn_no_grads(self) -> None:
        if not self._warned_no_grads:
            self._warned_no_grads = True
            warnings.warn(
                "cpu_adam.OffloadOptimizer.step(): no grad reached its params since the last step, so nothing was "
                "updated. Call backward() before step(); if the model's params were replaced after the optimizer "
                "was built (load_state_dict(assign=True), modules re-created), build the optimizer again over the "
                "new params",
                RuntimeWarning,
                stacklevel=3,
            )

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("cpu_adam.OffloadOptimizer: this optimizer was closed; build a new one to train")
        if self._dev.is_capturing():
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: step() cannot be captured in a CUDA graph: it waits on the host for the "
                "grads and runs Adam on the CPU. Capture the forward only, or train without CUDA graphs"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the grads of the backward passes so far (a failed one's too): a new window begins."""
        self._link.wait_all()
        self._new_window()
        for options in self.param_groups:
            for p in options["params"]:
                if p.grad is not None:
                    if set_to_none or isinstance(p.grad, OffloadedGrad):
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    def close(self) -> None:
        """Detaches the optimizer from its params: hooks removed, copies finished, pinned memory released.

        Params can then be given to a new optimizer. Called by ``__del__`` too.
        """
        if self._closed:
            return
        self._closed = True
        self._hooks.remove()
        self.zero_grad()  # no placeholder grads left on the params
        self._overlap.close()
        self._link.close()
        release(self._model.params, self)

    # -- memory and checkpoints ---------------------------------------------------------------

    def master_weights(self) -> list[Tensor]:
        """The host master weight of each trainable param (param_groups order, tied params once), as views."""
        if self._world.size > 1:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer.master_weights: with a process group each rank holds a shard of the "
                "masters; gather the ranks' state_dict() and use cpu_adam.distributed.consolidate_state_dict"
            )
        self._overlap.settle()
        self._model.sync_masters(self._store)
        return [
            self._store.master(g, slice(*layout.param_range(i))).view(shape)
            for g, layout in enumerate(self._layouts)
            if layout is not None
            for i, shape in enumerate(layout.shapes)
        ]

    def memory_stats(self) -> dict[str, Any]:
        """Bytes held, measured from the allocated tensors (this process's shard on the host)."""
        layouts = [layout for layout in self._layouts if layout is not None]
        params = sum(sum(layout.numels) for layout in layouts)
        master, states = self._store.nbytes()
        pinned = self._link.pinned_bytes
        accumulator = self._window.accumulator_bytes
        overlap = self._overlap.extra_bytes
        host = master + states + pinned + accumulator + overlap
        return {
            "params": params,
            "world_size": self._world.size,
            "shard_elements": sum(layout.shard_numel for layout in layouts),  # this rank's, padding included
            "host_bytes": host,
            "host_bytes_per_param": host / params,
            "master_bytes": master,
            "state_bytes": states,
            "pinned_bytes": pinned,
            "pinned": self._link.pinned,
            "accumulator_bytes": accumulator,
            "overlap_bytes": overlap,  # the previews' bf16 weights with overlap="backward"
            "weights_bytes": sum(p.numel() * p.element_size() for ps in self._model.params for p in ps),
            "device_bytes": self._dev.held_bytes,
            "device_peak_bytes": self._dev.peak_bytes,
        }

    def state_dict(self) -> dict[str, Any]:
        """Masters, Adam states, step counts, hyper-parameters (max_grad_norm too), seed, skipped steps.

        With a process group: this rank's shard of the masters and states, and under ``"zero"``
        the rank, world size and bucket size that say how the shard was cut.

        Tensors are references to the live buffers (as with torch's optimizers): save or copy
        the dict before the next step. A group that has not stepped holds no tensors, as torch's
        optimizers create state at the first step: accelerate's ``prepare`` moves a state dict to
        the device and loads it back, which must not put the host state on the GPU. Loading such a
        dict zeroes the moments and keeps the masters (a handed-over model's fp32 values too).
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        self._overlap.settle()
        scalars = checkpoint.Scalars(self.seed, self.skipped_steps, self.max_grad_norm)
        state_dict = checkpoint.save(self._rooms, self.param_groups, scalars)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a ``state_dict()`` and sets the device weights from the loaded masters.

        Takes a full state dict (one process's, or consolidated from a ZeRO run) on any number
        of ranks, each rank keeping its slice; or, with a process group, this rank's own shard.
        With a process group every rank must call it (the weights are all-gathered). Everything is
        checked before anything changes. Load hooks run as with torch's optimizers.
        """
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        self._overlap.settle()
        self.seed, self.skipped_steps, self.max_grad_norm = checkpoint.load(self._rooms, self.param_groups, state_dict)
        self._new_window()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __del__(self) -> None:
        # Only the optimizer itself: Lightning's wrapper copies this __dict__ and must not close it.
        try:
            if self.__dict__.get("_owner_id") == id(self):
                self.close()
        except Exception:
            pass
