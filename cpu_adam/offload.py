"""The offload optimizer: bf16 weights on the device, master weights and Adam states in host RAM.

Data flow per step (``_device.py`` turns the copies and waits into no-ops on the CPU):
- construction: the model stays an ordinary model, each param with its own device storage;
  the flat layout of each param group (buckets, ZeRO pieces) exists in host buffers only.
- backward (``_grads.py``): hooks pack the grads into buckets that go down, on a side stream,
  into one pinned bf16 host buffer per group; device memory for grads stays a few buckets.
- step: wait for the copies, take the global norm (clipping scale, non-finite skip), run the
  kernel bucket by bucket writing bf16 weights into the pinned buffer in place of the grads,
  and copy each bucket's weights up into the params' own storage while the next computes. The
  compute stream waits on the upload's event, so the next forward is ordered after it without
  the host waiting. Params that got no grad in the window are left alone, as torch does.

Gradient accumulation sums the micro-batches' grads in an fp32 host accumulator, allocated
when a bucket is sent down a second time before a step (4 bytes per param, in ``memory_stats``).

ZeRO (``process_group``): each rank owns piece ``rank`` of every bucket (``_flat.py``). Buckets
are reduce-scattered on the device as they fill, each rank steps its pieces, and each updated
piece goes up into a bucket buffer on the device, is all-gathered there and copied into the
params, on the side stream while the next piece computes. Grads are summed by the collectives;
the kernel's ``grad_scale`` carries the 1/N of the average (and the clipping), so averaging
costs no pass. The grad norm is all-reduced; rank 0's weights are broadcast at construction.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ._collectives import ShardComm
from ._device import DeviceOps
from ._flat import check_shard, from_legacy_layout, full_numel, full_to_shard
from ._grads import GradCollector
from ._group import GroupBuffers
from ._handover import check_sources, hand_over, target_device
from ._offloaded_grad import OffloadedGrad
from ._precision import MOMENTS, SCALES, converted_moments, resolved_precision, state_dtype
from ._threads import check_threads
from ._transfers import Transfers
from ._validation import check_hyper_parameters, check_param_group, check_step_count, checked_seed
from .ops import adam_step, group_counter_base
from .quant8 import BLOCK

__all__ = ["OffloadOptimizer"]

logger = logging.getLogger(__name__)

# One kernel call per chunk of 32M elements: a parallel region per 8M-element bucket cost 5-12%
# (measured on a 16-core host), and the last chunk's upload (64 MB) stays about a millisecond.
KERNEL_CHUNK = 2**25
DEFAULT_BUCKET_SIZE = 2**23  # elements: 16 MiB of bf16 grads per copy, far past PCIe's small-copy overheads
# Format 2 lays params out on 256-element boundaries (an 8-bit scale block); format 1 used 64.
STATE_DICT_FORMAT = "cpu_adam.OffloadOptimizer/2"
LEGACY_FORMAT = "cpu_adam.OffloadOptimizer/1"
OWNER = "cpu_adam.OffloadOptimizer"


def _check_no_shared_memory(params: list[Tensor]) -> None:
    """Two param objects over the same memory would each be stepped, one overwriting the other."""
    spans = sorted(
        [
            (p.untyped_storage().data_ptr(), p.storage_offset() * p.element_size(), p.numel() * p.element_size(), p)
            for p in params
            if p.numel() > 0
        ],
        key=lambda span: span[:3],
    )
    for (storage, start, size, p), (next_storage, next_start, _, q) in zip(spans, spans[1:]):
        if storage == next_storage and next_start < start + size:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: the parameters of shape {tuple(p.shape)} and {tuple(q.shape)} share "
                "memory (views of one tensor), so each would be stepped and overwrite the other. Tie them by "
                "using one Parameter object (module.b.weight = module.a.weight), or .clone() one of them"
            )


def _checked_max_grad_norm(value: Any) -> float | None:
    # Checked on every assignment (a scheduler's, a loaded state dict's): a norm <= 0 would turn
    # descent into ascent or ignore the grads.
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"cpu_adam.OffloadOptimizer: max_grad_norm must be a finite number > 0, or None for no clipping; "
            f"got {value!r}"
        )
    return float(value)


def _chunks(group: GroupBuffers, size: int) -> list[tuple[int, int]]:
    """Runs of consecutive buckets of about ``size`` elements of this rank's shard: one kernel call each."""
    runs, first, numel = [], 0, 0
    for b, piece in enumerate(group.layout.pieces):
        numel += piece.numel
        if numel >= size:
            runs.append((first, b + 1))
            first, numel = b + 1, 0
    if first < len(group.layout.pieces):
        runs.append((first, len(group.layout.pieces)))
    return runs


def _param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
    """Param groups as dicts, each param listed once (a tied param is stepped once)."""
    items = list(params)
    if not items:
        raise ValueError("cpu_adam.OffloadOptimizer got an empty parameter list")
    groups = [dict(g) for g in items] if isinstance(items[0], dict) else [{"params": items}]
    for group in groups:
        ps = group["params"]
        ps = [ps] if isinstance(ps, Tensor) else list(ps)
        seen: set[int] = set()
        group["params"] = [p for p in ps if not (id(p) in seen or seen.add(id(p)))]
    return groups


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
    first step); they are moved to ``device`` as bf16 one at a time (``_handover.py``).

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
    ) -> None:
        check_hyper_parameters(OWNER, lr, betas, eps, weight_decay)
        self.state_precision = resolved_precision(OWNER, state_precision, fp32_optimizer_states)
        seed = None if seed is None else checked_seed(OWNER, seed)
        if master_weights_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"master_weights_dtype must be torch.float32 or torch.bfloat16, got {master_weights_dtype}"
            )
        if stochastic_rounding and master_weights_dtype != torch.bfloat16:
            raise ValueError(
                "stochastic_rounding applies to bf16 master weights: pass master_weights_dtype=torch.bfloat16"
            )
        if max_inflight_buckets < 1:
            raise ValueError(f"max_inflight_buckets must be at least 1, got {max_inflight_buckets}")

        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        self._building = True
        super().__init__(_param_groups(params), defaults)
        self._building = False

        self.max_grad_norm = max_grad_norm
        self.master_weights_dtype = master_weights_dtype
        self.state_dtype = state_dtype(self.state_precision)
        self.stochastic_rounding = stochastic_rounding
        # Not drawn from torch's generator: building the optimizer must not shift the user's random
        # stream, and replicas seeded per rank must still round alike.
        self.seed = 0 if seed is None else seed
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        # Seconds the last step spent waiting for grads to come down, on the norm, on the kernel.
        self.step_timings: dict[str, float] = {}
        self.bucket_size = bucket_size
        self._closed = False
        self._warned_no_grads = False

        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        if device is None:
            self._dev = DeviceOps(self._check_params(trainable))
        else:  # a model on the CPU or the meta device, handed over (see _handover.py)
            self._dev = DeviceOps(target_device(device))
            check_sources([p for ps in trainable for p in ps], self._dev.device)
            _check_no_shared_memory([p for ps in trainable for p in ps if not p.is_meta])
        _check_unclaimed(trainable)
        # Before anything is allocated, so a bad group leaves the model alone.
        self._comm = None if process_group is None else ShardComm(process_group, self._dev.device)
        self.world_size, self.rank = (1, 0) if self._comm is None else (self._comm.world_size, self._comm.rank)
        if self._comm is not None:
            check_threads(self.rank, self.world_size)
            layout = [[tuple(p.shape) for p in ps] for ps in trainable]
            self._comm.check_same(
                "the parameters and options",
                (layout, bucket_size, str(master_weights_dtype), self.state_precision, stochastic_rounding),
                "build the optimizer on the same model, param groups and options on every rank",
            )
            self.seed = self._seed_of_rank0(self.seed)
            if device is None:  # ranks initialised with other seeds would train a patchwork
                for ps in trainable:
                    for p in ps:
                        self._comm.broadcast_from_rank0(p.detach())
        self._groups = [
            GroupBuffers(
                ps,
                self._dev,
                bucket_size,
                master_weights_dtype,
                self.state_dtype,
                world_size=self.world_size,
                rank=self.rank,
            )
            if ps
            else None
            for ps in trainable
        ]
        # Params from the meta device, filled with NaN when materialised: written before the first step?
        self._unwritten: list[Tensor] = []
        if device is not None:
            self._unwritten = hand_over(self._groups, self._dev.device, self._comm)
            self._check_params(trainable)
        self._transfers = Transfers(self._dev, self._comm, max_inflight_buckets)
        self._grads = GradCollector(self._dev, self._groups, self._transfers, self._comm)
        # Wrappers that copy this __dict__ (Lightning's) are other objects: they must not close it.
        # An id, not a weak reference: the cycle collector clears those before __del__ runs.
        self._owner_id = id(self)
        _claim(trainable, self)

    # -- construction -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise NotImplementedError(
                "cpu_adam.OffloadOptimizer lays params out in flat buffers when it is built: "
                "pass every param group to the constructor"
            )
        check_param_group(f"{OWNER} param group {len(self.param_groups)}", {**self.defaults, **param_group})
        super().add_param_group(param_group)

    @staticmethod
    def _check_params(groups: list[list[Tensor]]) -> torch.device:
        params = [p for ps in groups for p in ps]
        if not params:
            raise ValueError("cpu_adam.OffloadOptimizer: no parameter requires grad, nothing to train")
        for p in params:
            if p.dtype != torch.bfloat16:
                raise TypeError(
                    f"cpu_adam.OffloadOptimizer: a parameter of shape {tuple(p.shape)} is {p.dtype}; the offload "
                    "optimizer trains bf16 weights (master weights stay in host RAM). Convert the model first: "
                    "model.to(torch.bfloat16)"
                )
            if p.layout != torch.strided or not p.is_contiguous():
                raise TypeError(
                    f"cpu_adam.OffloadOptimizer: parameters must be dense, contiguous tensors; one of shape "
                    f"{tuple(p.shape)} is not (layout {p.layout}): make it contiguous before building the optimizer"
                )
        _check_no_shared_memory(params)
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: trainable parameters are on several devices ({', '.join(devices)}); "
                "put the whole model on one device (model.to(device)) before building the optimizer"
            )
        return params[0].device

    # -- step ---------------------------------------------------------------------------------

    @property
    def max_grad_norm(self) -> float | None:
        """The clipping threshold of the global grad norm; None does not clip."""
        return self._max_grad_norm

    @max_grad_norm.setter
    def max_grad_norm(self, value: float | None) -> None:
        self._max_grad_norm = _checked_max_grad_norm(value)

    _step_supports_amp_scaling = True  # so torch.amp.GradScaler hands its scale to step(), which refuses it

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step on the grads of the backward passes since the last step or zero_grad."""
        self._check_usable()
        self._check_written()
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
        if self._comm is not None:
            self._comm.check_alive()  # also after a backward that failed on it
        self._grads.check_finished()
        if not self._grads.has_grads:  # with ZeRO, the ranks shared which params got grads
            self._warn_no_grads()
            return loss  # no grads: like torch's optimizers, leave every param as it is
        factor = self._grads.grad_factor()  # what clip_grad_norm_ multiplied the grads by
        t0 = time.perf_counter()
        self._grads.wait_all()
        t1 = time.perf_counter()
        self._check_param_storage()
        self._sync_masters()
        norm = self._global_norm()
        self.last_grad_norm = norm
        t2 = time.perf_counter()
        if not math.isfinite(norm * factor):
            self.skipped_steps += 1
            logger.warning(
                "cpu_adam.OffloadOptimizer: gradient norm is %s, step skipped (%d skipped so far)",
                norm,
                self.skipped_steps,
            )
        else:
            scale = factor
            if self.max_grad_norm is not None:  # of the grads as the caller left them
                scale *= min(1.0, self.max_grad_norm / (norm * factor + 1e-6))
            scale /= self.world_size  # the collectives summed the ranks' grads: this makes it their mean
            options = zip(self.param_groups, self._groups)
            hypers = [None if group is None else self._hyper(o, scale) for o, group in options]
            self._check_scalars(hypers)
            with self._dev.side_stream():  # uploads wait for what the compute stream still does with the weights
                for g, (group, hyper) in enumerate(zip(self._groups, hypers)):
                    if group is not None:
                        self._step_group(g, group, hyper)
                        group.note_versions()  # the optimizer's own writes
                event = self._dev.record()
            self._dev.compute_waits(event)
        self._grads.reset()
        self.step_timings = {"grads_wait_s": t1 - t0, "norm_s": t2 - t1, "adam_s": time.perf_counter() - t2}
        return loss

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

    def _check_written(self) -> None:
        if any(p.numel() > 0 and bool(p.isnan().all()) for p in self._unwritten):
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: the model was built on the meta device and a param is still all NaN, "
                "as the optimizer filled it: load the weights (model.load_state_dict(state_dict)) or initialise "
                "them before the first step"
            )
        self._unwritten = []

    def _check_param_storage(self) -> None:
        """Params changed after construction (dtype, device, shape) would be trained wrongly: refuse."""
        for group in self._groups:
            if group is None:
                continue
            storage = [p.data_ptr() for p in group.params]
            if storage != group.storage:
                group.storage, group.kernel_lists = storage, {}
            for p, shape in zip(group.params, group.layout.shapes):
                if p.dtype != torch.bfloat16 or p.device != self._dev.device or p.shape != shape:
                    raise RuntimeError(
                        f"cpu_adam.OffloadOptimizer: a parameter built as {tuple(shape)} bfloat16 on "
                        f"{self._dev.device} is now {tuple(p.shape)} {p.dtype} on {p.device} (the model was converted "
                        "or moved after the optimizer was built, e.g. model.float() or model.cuda()). Move and convert "
                        "the model first (model.to(device, torch.bfloat16)), then build the optimizer"
                    )
                if not p.is_contiguous():
                    raise RuntimeError(
                        f"cpu_adam.OffloadOptimizer: the parameter of shape {tuple(shape)} is no longer contiguous; "
                        "keep the params' storage contiguous (the optimizer writes the updated weights into it)"
                    )

    def _global_norm(self) -> float:
        """The norm of the window's grads (of their mean over the ranks with ZeRO), before any scaling."""
        sq = sum(float(x.sum()) for x in self._grads.window_sq() if x is not None)
        return math.sqrt(sq) / self.world_size

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

    def _check_scalars(self, hypers: list[dict[str, Any] | None]) -> None:
        """Every group's kernel scalars, before any group is stepped: a step is all or nothing."""
        for group, hyper in zip(self._groups, hypers):
            if group is not None:
                for step in {n + 1 for n, got in zip(group.steps, group.got) if got}:
                    adam_step([], [], [], [], step=step, check_only=True, **hyper)

    def _step_group(self, g: int, group: GroupBuffers, hyper: dict[str, Any]) -> None:
        # Chunk by chunk (whole buckets): each chunk's uploads overlap the next chunk's compute.
        for first, last in _chunks(group, KERNEL_CHUNK):
            for step, tensors in self._kernel_lists(g, group, first, last).items():
                adam_step(
                    *tensors[:4],
                    bf16_outs=tensors[4],
                    counter_offsets=tensors[5],
                    state_scales=tensors[6],
                    step=step,
                    **hyper,
                )
            in_place = self._dev.host_addressable and self._comm is None  # the kernel wrote into the params
            for b in range(first, last):
                self._transfers.up(group, b, group.got, in_place=in_place)
        # Counted once the kernel has run: a step that raised leaves the bias corrections as they were.
        group.steps = [n + got for n, got in zip(group.steps, group.got)]

    def _kernel_lists(self, g: int, group: GroupBuffers, first: int, last: int) -> dict[int, tuple[list, ...]]:
        """The kernel's (masters, grads, exp_avgs, exp_avg_sqs, bf16_outs, counter offsets, state scales)
        of buckets ``first..last-1``, by step count.

        Params that got no grad are left out. Consecutive params of a bucket (with the zero
        padding between them) share one tuple, except where the kernel writes straight into each
        param's storage (one process on the CPU). Counter offsets are the one-process layout's, so
        stochastic rounding draws the same bits whatever the world size, bucket size or chunking.
        A chunk whose params all step alike, with no accumulated grads, keeps its lists.
        """
        key = (first, last)
        if key not in group.chunk_plans:
            group.chunk_plans[key] = [
                (i, part, host, b) for b in range(first, last) for i, part, host in group.piece_segments(b)
            ]
        plan = [s for s in group.chunk_plans[key] if group.got[s[0]]]
        steps = {group.steps[i] + 1 for i, *_ in plan}  # the step being taken
        reusable = len(plan) == len(group.chunk_plans[key]) and len(steps) == 1
        reusable = reusable and all(group.buckets[b].flushes <= 1 for b in range(first, last))
        if reusable and key in group.kernel_lists:
            return {steps.pop(): group.kernel_lists[key]}
        direct = self._dev.host_addressable and self._comm is None  # the kernel writes into the params
        by_step: dict[int, list[list]] = {}
        for i, part, host, b in plan:
            runs = by_step.setdefault(group.steps[i] + 1, [])
            if not direct and runs and runs[-1][3] == b and runs[-1][4] == i - 1:
                runs[-1][0], runs[-1][4] = slice(runs[-1][0].start, host.stop), i
            else:
                runs.append([host, part, i, b, i])  # its first param's part (where its counters start), its last param
        out = {}
        for step, runs in by_step.items():
            out[step] = (
                [group.master[h] for h, *_ in runs],
                [self._grads.grads_of(group, b)[h] for h, _, _, b, _ in runs],
                [group.exp_avg[h] for h, *_ in runs],
                [group.exp_avg_sq[h] for h, *_ in runs],
                [group.weights(i)[part] if direct else group.grads.tensor[h] for h, part, i, _, _ in runs],
                [group_counter_base(g) + group.counter_offsets[i] + part.start for _, part, i, _, _ in runs],
                [group.scales_of(h) for h, *_ in runs] if group.state_scales is not None else [],
            )
        if reusable:
            group.kernel_lists[key] = next(iter(out.values()))
        return out

    def master_weights(self) -> list[Tensor]:
        """The host master weight of each trainable param (param_groups order, tied params once), as views."""
        if self._comm is not None:
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer.master_weights: with a process group each rank holds a shard of the "
                "masters; gather the ranks' state_dict() and use cpu_adam.distributed.consolidate_state_dict"
            )
        self._sync_masters()
        views = []
        for group in self._groups:
            if group is not None:
                for i, shape in enumerate(group.layout.shapes):
                    lo, hi = group.layout.param_range(i)
                    views.append(group.master[lo:hi].view(shape))
        return views

    def _sync_masters(self) -> None:
        """Masters from the weights: all of them before the first step, then those written by others."""
        for group in self._groups:
            if group is None:
                continue
            written = None if not group.master_synced else set(group.written_since())
            if written == set():
                continue
            for b in range(len(group.layout.buckets)):
                for i, part, host in group.piece_segments(b):
                    if written is None:
                        group.master[host].copy_(group.weights(i)[part])
                    elif i in written:
                        weights = group.weights(i)[part].to("cpu")
                        # The weights written back as they were (model.load_state_dict(model.state_dict())):
                        # the master keeps the bits below bf16's.
                        if not torch.equal(weights, group.master[host].to(torch.bfloat16)):
                            group.master[host].copy_(weights)
            group.master_synced = True
            group.note_versions()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the grads of the backward passes so far (a failed one's too): a new window begins."""
        self._grads.wait_all()
        self._grads.reset()
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
        self._grads.remove_hooks()
        self.zero_grad()  # no placeholder grads left on the params
        self._dev.synchronize()
        for group in self._groups:
            if group is not None:
                group.grads.close()
        _release(self)

    # -- memory and checkpoints ---------------------------------------------------------------

    def memory_stats(self) -> dict[str, Any]:
        """Bytes held, measured from the allocated tensors (this process's shard on the host)."""

        def nbytes(t: Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()

        groups = [g for g in self._groups if g is not None]
        params = sum(sum(g.layout.numels) for g in groups)
        master = sum(nbytes(g.master) for g in groups)
        states = sum(nbytes(g.exp_avg) + nbytes(g.exp_avg_sq) + nbytes(g.state_scales) for g in groups)
        pinned = sum(g.grads.nbytes for g in groups)
        accumulator = sum(nbytes(g.accumulator) for g in groups)
        host = master + states + pinned + accumulator
        return {
            "params": params,
            "world_size": self.world_size,
            "shard_elements": sum(g.layout.shard_numel for g in groups),  # this rank's, padding included
            "host_bytes": host,
            "host_bytes_per_param": host / params,
            "master_bytes": master,
            "state_bytes": states,
            "pinned_bytes": pinned,
            "pinned": any(g.grads.pinned for g in groups),
            "accumulator_bytes": accumulator,
            "weights_bytes": sum(p.numel() * p.element_size() for g in groups for p in g.params),
            "device_bytes": self._transfers.device_bytes,
            "device_peak_bytes": self._transfers.device_peak_bytes,
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
        state = {}
        for g, group in enumerate(self._groups):
            if group is None:
                continue
            state[g] = {
                "step": max(group.steps),
                "param_steps": list(group.steps),
                "shapes": [tuple(s) for s in group.layout.shapes],
            }
            if any(group.steps):
                self._sync_masters()
                state[g].update(master=group.master, exp_avg=group.exp_avg, exp_avg_sq=group.exp_avg_sq)
                if group.state_scales is not None:
                    state[g][SCALES] = group.state_scales
        param_groups = []
        index = 0
        for options in self.param_groups:
            saved = {k: v for k, v in options.items() if k != "params"}
            saved["params"] = list(range(index, index + len(options["params"])))
            index += len(options["params"])
            param_groups.append(saved)
        state_dict = {
            "format": STATE_DICT_FORMAT,
            "state": state,
            "param_groups": param_groups,
            "seed": self.seed,
            "skipped_steps": self.skipped_steps,
            "max_grad_norm": self.max_grad_norm,
        }
        if self._comm is not None:
            state_dict["zero"] = {"rank": self.rank, "world_size": self.world_size, "bucket_size": self.bucket_size}
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
        legacy = state_dict.get("format") == LEGACY_FORMAT
        if state_dict.get("format") != STATE_DICT_FORMAT and not legacy:
            raise ValueError(
                f"cpu_adam.OffloadOptimizer.load_state_dict: not a {STATE_DICT_FORMAT} state dict "
                f"(format {state_dict.get('format')!r})"
            )
        if legacy and "zero" in state_dict:
            raise ValueError(
                "cpu_adam.OffloadOptimizer.load_state_dict: this ZeRO shard was saved in format 1, whose pieces were "
                "cut on other boundaries; consolidate the shards with the cpu_adam version that saved them "
                "(cpu_adam.distributed.consolidate_state_dict) and load the full state dict"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(saved_groups)} param groups, this optimizer {len(self.param_groups)}"
            )
        for g, group in enumerate(self._groups):
            saved = state_dict["state"].get(g)
            if (group is None) != (saved is None) or (
                group is not None and [tuple(s) for s in saved["shapes"]] != [tuple(s) for s in group.layout.shapes]
            ):
                raise ValueError(f"param group {g} of the state dict holds other parameters than this optimizer's")
            if (
                saved is not None
                and saved["step"] != 0
                and not all(k in saved for k in ("master", "exp_avg", "exp_avg_sq"))
            ):
                raise ValueError(f"param group {g} of the state dict has taken steps but lacks its masters or moments")
        max_grad_norm = _checked_max_grad_norm(state_dict["max_grad_norm"])
        _check_loadable(state_dict)
        zero = state_dict.get("zero")
        problem: ValueError | None = None
        try:
            if zero is not None:
                check_shard(zero, self.rank, self.world_size, self.bucket_size)
            loaded = [
                None if group is None else self._loaded_tensors(g, group, state_dict["state"][g], zero is None, legacy)
                for g, group in enumerate(self._groups)
            ]
        except ValueError as error:
            problem = error
        if self._comm is not None:  # a rank that cannot load must not leave the others waiting in a collective
            self._comm.check_same(
                "whether the state dict loads",
                problem is None,
                "the ranks where it does not load raised the reason: fix the state dict they were given",
            )
        if problem is not None:
            raise problem
        if self._comm is not None:
            self._comm.check_same(
                "the kind of state dict loaded",
                zero is None,
                "every rank must load its own shard, or every rank the same full state dict",
            )
        self._grads.wait_all()
        self._dev.synchronize()
        with torch.no_grad():
            for g, group in enumerate(self._groups):
                if group is None:
                    continue
                saved = state_dict["state"][g]
                group.steps = [int(x) for x in saved.get("param_steps", [saved["step"]] * len(group.params))]
                group.reset_moments()  # a group that had not stepped saves none
                if not loaded[g]:  # nor masters: they stay (the weights, or a handed-over model's values)
                    continue
                for name, tensor in loaded[g].items():
                    getattr(group, name).copy_(tensor)
                group.master_synced = True
                # The device weights from the masters, rounded to bf16 as the kernel rounds its outputs.
                group.grads.tensor.copy_(group.master)
                with self._dev.side_stream():
                    for b in range(len(group.layout.buckets)):
                        self._transfers.up(group, b, [True] * len(group.params))
                group.note_versions()
                self._dev.synchronize()  # before the host buffer receives grads again
        for options, saved in zip(self.param_groups, saved_groups):
            options.update({k: v for k, v in saved.items() if k != "params"})
        self.seed = self._seed_of_rank0(int(state_dict["seed"]))  # shards of 0.2 may hold one per rank
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.max_grad_norm = max_grad_norm
        self._grads.reset()
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _seed_of_rank0(self, seed: int) -> int:
        """Rank 0's seed on every rank: one stream of random bits whatever the world size, so a
        resharded resume draws the same bits."""
        if self._comm is None:
            return seed
        t = torch.tensor([seed], dtype=torch.int64, device=self._comm.device)
        self._comm.broadcast_from_rank0(t, "rank 0's seed")
        return int(t.item())

    def _loaded_tensors(
        self, g: int, group: GroupBuffers, saved: dict[str, Any], full: bool, legacy: bool
    ) -> dict[str, Tensor]:
        """This rank's masters and moments from a saved group, in this optimizer's precision.

        Checked before anything is loaded: the caller copies them in only once every group passed.
        """
        if "master" not in saved:
            return {}
        tensors = {name: saved[name] for name in ("master", *MOMENTS, SCALES) if name in saved}
        where = f"cpu_adam.OffloadOptimizer.load_state_dict: param group {g}"
        if (SCALES in tensors) != (tensors["exp_avg"].dtype == torch.uint8):
            raise ValueError(f"{where}: 8-bit (uint8) moments come with their state_scales, float moments without")
        numel = group.layout.shard_numel
        if full:
            numel = full_numel(group.layout.shapes, legacy=legacy)
        for name, t in tensors.items():
            expected = (2, numel // BLOCK) if name == SCALES else (numel,)
            if tuple(t.shape) != expected:
                raise ValueError(
                    f"{where}: {name} has shape {tuple(t.shape)} where this optimizer's params need {expected} "
                    f"({'a full state dict' if full else 'a shard of this layout'})"
                )
        if legacy:
            tensors = {name: from_legacy_layout(t, group.layout.shapes) for name, t in tensors.items()}
        moments = {name: t for name, t in tensors.items() if name != "master"}
        tensors = {"master": tensors["master"], **converted_moments(moments, self.state_dtype, torch.device("cpu"))}
        if full:
            tensors = {
                name: full_to_shard(t, group.layout, per=BLOCK if name == SCALES else 1) for name, t in tensors.items()
            }
        return tensors

    def __del__(self) -> None:
        # Only the optimizer itself: Lightning's wrapper copies this __dict__ and must not close it.
        try:
            if self.__dict__.get("_owner_id") == id(self):
                self.close()
        except Exception:
            pass


def _check_loadable(state_dict: dict[str, Any]) -> None:
    where = f"{OWNER}.load_state_dict"
    for g, options in enumerate(state_dict["param_groups"]):
        check_param_group(f"{where}: param group {g}", options)
    for g, saved in state_dict["state"].items():
        for count in [saved["step"], *saved.get("param_steps", [])]:
            check_step_count(f"{where}: param group {g}", count)
    checked_seed(where, state_dict["seed"])
    check_step_count(f"{where}: skipped_steps", state_dict["skipped_steps"])


def _check_unclaimed(groups: list[list[Tensor]]) -> None:
    """Refuses params that another live OffloadOptimizer trains: its hooks would take their grads."""
    for ps in groups:
        for p in ps:
            ref = getattr(p, "_cpu_adam_offload_owner", None)
            other = ref() if ref is not None else None
            if other is not None and not other._closed:
                raise RuntimeError(
                    f"cpu_adam.OffloadOptimizer: a parameter of shape {tuple(p.shape)} is already trained by another "
                    "OffloadOptimizer, whose hooks would take its grads. Call close() on the old optimizer (or "
                    "delete every reference to it, schedulers included) before building a new one"
                )


def _claim(groups: list[list[Tensor]], owner: OffloadOptimizer) -> None:
    for ps in groups:
        for p in ps:
            p._cpu_adam_offload_owner = weakref.ref(owner)


def _release(owner: OffloadOptimizer) -> None:
    for group in owner._groups:
        for p in group.params if group is not None else []:
            ref = getattr(p, "_cpu_adam_offload_owner", None)
            if ref is not None and ref() is owner:
                del p._cpu_adam_offload_owner
