"""The offload optimizer's face: a ``torch.optim.Optimizer`` whose step reads wait -> scale -> step -> upload.

The rooms it wires together (one concept each):
- ``params.py``: the model's side (checks, ownership, weights written by others); ``handover.py``
  moves a CPU or meta model onto the device;
- ``hooks.py`` packs grads during backward; ``schedule.py`` says when a bucket goes down;
- ``link.py`` moves every byte between device and host through pinned slots;
- ``window.py`` sums what a window's backward passes sent and turns it into one scale or a skip;
- ``store.py`` holds masters, moments and step counts; ``stepper.py`` runs Adam over them a chunk
  at a time; ``steps.py`` is one step over the rooms;
- ``share.py`` says which buckets the device steps instead (``auto.py`` plans it), ``device_store.py``
  holds their state in device memory and ``device_stepper.py`` runs the device kernel over it;
- ``world.py`` is the ranks (a single process is a world of one); ``state_dict.py`` the format.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .._precision import resolved_precision, state_dtype
from .._signals import interrupts_deferred
from .._turn import Turn, one_at_a_time
from .._validation import check_hyper_parameters, check_param_group, checked_seed
from . import refusals, steps
from . import rooms as house
from . import state_dict as checkpoint
from .options import DEFAULT_BUCKET_SIZE, check_options, checked_max_grad_norm
from .params import claim, param_groups, release
from .placeholder import OffloadedGrad
from .share import checked_budget, checked_fraction

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
    ``step()`` uploads the previews (made again where clipping or a hyper-parameter changed the
    numbers); where the grads changed, and with ``"none"`` (the default), the step runs after
    backward. Both give the same bits (``overlap.py``).

    ``device_fraction`` (a number in [0, 1], or "auto", the default) is the share of each group's
    elements that the device steps where the weights are, its state in device memory (up to
    ``device_budget`` bytes; beyond, streamed in the shadow of forward and backward): the same bits
    as the host's step, whatever the share (``share.py``, docs/offload.md). "auto" plans it from
    the memory and time each step shows (0 on a CPU device); 0.0 keeps all state on the host.

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
        device_fraction: float | str = "auto",
        device_budget: int | None = None,
    ) -> None:
        check_hyper_parameters(OWNER, lr, betas, eps, weight_decay)
        self.state_precision = resolved_precision(OWNER, state_precision, fp32_optimizer_states)
        seed = None if seed is None else checked_seed(OWNER, seed)
        check_options(master_weights_dtype, stochastic_rounding, max_inflight_buckets, overlap)
        device_fraction = checked_fraction(device_fraction)
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
        # Seconds the last step spent waiting for grads to come down (and previews), on the norm, on the
        # kernel and the uploads, on the uploads alone.
        self.step_timings: dict[str, float] = {}
        self.bucket_size = bucket_size
        self._closed = False
        self._warned_no_grads = False
        self._turn = Turn()

        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        # Frozen when the flat layout was made: unfrozen later, they would never be trained.
        self._frozen = [p for g in self.param_groups for p in g["params"] if not p.requires_grad]
        options = house.Options(
            bucket_size,
            master_weights_dtype,
            self.state_precision,
            stochastic_rounding,
            max_inflight_buckets,
            overlap,
            device_fraction,
            checked_budget(device_budget),
        )
        hyper_of = lambda g, scale: self._hyper(g, scale)  # noqa: E731
        self._rooms, self.seed = house.build(
            trainable, device, process_group, options, seed, hyper_of, lambda: self._max_grad_norm
        )
        self._device_fraction = device_fraction
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
    def device_fraction(self) -> float | str:
        """The share of each group's elements whose Adam runs on the device (its state in device memory), bitwise
        as on the host, or "auto" (planned from measured memory and rates: ``auto.py``). Set between steps (on every
        rank alike): it applies from the next window that has no grads yet, and the state moves at its step.
        ``memory_stats()["device_share"]`` is the share in effect."""
        return self._device_fraction

    @device_fraction.setter
    def device_fraction(self, value: float | str) -> None:
        self._device_fraction = house.request_share(self._rooms, checked_fraction(value))

    @property
    def world_size(self) -> int:
        return self._rooms.world.size

    @property
    def rank(self) -> int:
        return self._rooms.world.rank

    # -- step ---------------------------------------------------------------------------------

    _step_supports_amp_scaling = True  # so torch.amp.GradScaler hands its scale to step(), which refuses it

    # torch.compile runs the step eagerly (a graph break), and each method below that reaches the host state:
    # they wait on copies and a worker thread. Traced, a step cut short by a compile error left close() waiting
    # on the worker forever, and a traced close() left the optimizer open. torch's optimizers run zero_grad and
    # their state dict calls eagerly too.
    @torch.compiler.disable
    @torch.no_grad()
    @one_at_a_time(lambda _: refusals.step_busy())
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step on the grads of the backward passes since the last step or zero_grad."""
        refusals.check_open(self._closed, "step")
        refusals.check_not_capturing(self._rooms.dev)
        self._rooms.model.check_written()
        refusals.check_unfrozen(self._frozen)
        if getattr(self, "grad_scale", None) is not None or getattr(self, "found_inf", None) is not None:
            self.grad_scale = self.found_inf = None
            raise refusals.grad_scaler_refused()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for g, options in enumerate(self.param_groups):  # edited groups, refused before anything changes
            check_param_group(f"{OWNER} param group {g}", options)
        r = self._rooms
        r.world.check_alive()  # also after a backward that failed on it
        r.window.check_finished()
        if not r.window.has_grads:  # with ZeRO, the ranks shared which params got grads
            self._warn_no_grads()
            return loss  # no grads: like torch's optimizers, leave every param as it is
        with interrupts_deferred():  # Ctrl-C lands after the step, not between the state and the weights
            self._apply()
        return loss

    def _apply(self) -> None:
        r = self._rooms
        t0 = time.perf_counter()
        r.planner.step_started(t0)
        uploads_s, wait_s = r.link.upload_seconds, r.overlap.wait_seconds
        r.link.wait_all()
        t1 = time.perf_counter()
        synced = steps.ready(r)
        finished = r.window.finish(self.max_grad_norm)
        self.last_grad_norm = finished.norm
        self.last_step_overlapped, launch_s = False, 0.0
        t2 = time.perf_counter()
        if finished.scale is None:
            self.skipped_steps += 1
            logger.warning(
                "cpu_adam.OffloadOptimizer: gradient norm is %s, step skipped (%d skipped so far)",
                finished.norm,
                self.skipped_steps,
            )
        else:
            hypers = [None if layout is None else self._hyper(g, finished.scale) for g, layout in enumerate(r.layouts)]
            self.last_step_overlapped, launch_s = steps.take(r, hypers, finished, synced)
        r.planner.step_ended(time.perf_counter())
        self._new_window()
        # adam_s includes uploads_s: the host's part of the uploads (all of them where the device is the host).
        self.step_timings = {"grads_wait_s": t1 - t0, "norm_s": t2 - t1, "adam_s": time.perf_counter() - t2}
        self.step_timings["uploads_s"] = r.link.upload_seconds - uploads_s
        self.step_timings["overlap_wait_s"] = r.overlap.wait_seconds - wait_s  # for the worker's passes
        self.step_timings["device_launch_s"] = launch_s  # queuing the device's part (running it, on the CPU device)

    def _hyper(self, g: int, scale: float) -> dict[str, Any]:
        return steps.hyper(self.param_groups[g], scale, self.stochastic_rounding, self.seed)

    def _new_window(self) -> None:
        self._rooms.window.reset()
        self._rooms.hooks.reset()
        self._rooms.link.drop_kept()
        self._rooms.device_store.release()  # streamed state fetched for a step not taken
        self._rooms.overlap.reset()
        house.begin_share(self._rooms)

    def _warn_no_grads(self) -> None:
        if not self._warned_no_grads:
            self._warned_no_grads = True
            refusals.warn_no_grads()

    @torch.compiler.disable
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the grads of the backward passes so far (a failed one's too): a new window begins."""
        self._rooms.hooks.abandon()
        self._rooms.link.wait_all()
        self._new_window()
        for options in self.param_groups:
            for p in options["params"]:
                if p.grad is not None:
                    if set_to_none or isinstance(p.grad, OffloadedGrad):
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    @torch.compiler.disable
    def close(self) -> None:
        """Detaches the optimizer from its params: hooks removed, copies finished, pinned memory released.

        Params can then be given to a new optimizer. Called by ``__del__`` too.
        """
        if self._closed:
            return
        self._closed = True
        self._rooms.hooks.remove()
        try:
            self.zero_grad()  # no placeholder grads left on the params; with ZeRO, a failed backward's collectives
        except RuntimeError as error:  # the other ranks are gone: close all the same
            logger.warning("cpu_adam.OffloadOptimizer.close: %s", error)
            self._new_window()
        self._rooms.overlap.close()
        self._rooms.link.close()
        self._rooms.device_store.close()
        self._rooms.store.close()
        release(self._rooms.model.params, self)

    # -- memory and checkpoints ---------------------------------------------------------------

    @torch.compiler.disable
    def master_weights(self) -> list[Tensor]:
        """The host master weight of each trainable param (param_groups order, tied params once), as views."""
        return house.master_weights(self._rooms)

    @torch.compiler.disable
    def memory_stats(self) -> dict[str, Any]:
        """Bytes held, measured from the allocated tensors (this process's shard on the host)."""
        return house.memory_stats(self._rooms)

    @torch.compiler.disable
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
        refusals.check_open(self._closed, "state_dict")
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        house.synced_state(self._rooms)
        scalars = checkpoint.Scalars(self.seed, self.skipped_steps, self.max_grad_norm)
        state_dict = checkpoint.save(self._rooms, self.param_groups, scalars)
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        return state_dict

    @torch.compiler.disable
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a ``state_dict()`` and sets the device weights from the loaded masters.

        Takes a full state dict (one process's, or consolidated from a ZeRO run) on any number
        of ranks, each rank keeping its slice; or, with a process group, this rank's own shard.
        With a process group every rank must call it (the weights are all-gathered). Everything is
        checked before anything changes. Load hooks run as with torch's optimizers.
        """
        refusals.check_open(self._closed, "load_state_dict")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        self._rooms.overlap.settle()
        self.seed, self.skipped_steps, self.max_grad_norm = checkpoint.load(self._rooms, self.param_groups, state_dict)
        self._rooms.device_store.reload()
        self._new_window()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise refusals.copy_refused()

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        raise refusals.copy_refused()

    def __del__(self) -> None:
        # Only the optimizer itself: Lightning's wrapper copies this __dict__ and must not close it.
        try:
            if self.__dict__.get("_owner_id") == id(self):
                self.close()
        except Exception:
            pass
