"""The offload optimizer: bf16 weights on the device, master weights and Adam states in host RAM.

Data flow per step (``_device.py`` turns the copies and waits into no-ops on the CPU):
- construction: each param group's trainable params are copied into one flat bf16 device
  buffer and re-pointed as views of it; host buffers hold this process's shard of it.
- backward (``_grads.py``): hooks pack the grads into buckets that go down, on a side stream,
  into one pinned bf16 host buffer per group; device memory for grads stays a few buckets.
- step: wait for the copies, take the global norm (clipping scale, non-finite skip), run the
  kernel chunk by chunk writing bf16 weights into the pinned buffer in place of the grads,
  and copy each chunk up while the next computes. The compute stream waits on the upload's
  event, so the next forward is ordered after it without the host waiting.

Gradient accumulation sums the micro-batches' grads in an fp32 host accumulator, allocated
when a second backward comes before a step (4 bytes per param, reported by ``memory_stats``).

ZeRO (``process_group``): each rank owns piece ``rank`` of every bucket (``_flat.py``). Buckets
are reduce-scattered on the device as they fill, each rank steps its pieces, and each updated
piece goes up and is all-gathered into the flat weights on the side stream while the next
piece computes. Grads are summed by the collectives; the kernel's ``grad_scale`` carries the
1/N of the average (and the clipping), so averaging costs no pass. The grad norm is all-reduced.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from ._collectives import ShardComm
from ._device import DeviceOps
from ._grads import GradCollector, GroupBuffers
from .distributed import check_shard, check_threads, full_to_shard
from .ops import adam_step
from .optimizer import check_hyper_parameters

__all__ = ["OffloadOptimizer"]

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_SIZE = 2**23  # elements: 16 MiB of bf16 grads per copy, far past PCIe's small-copy overheads
STATE_DICT_FORMAT = "cpu_adam.OffloadOptimizer/1"
_MASK64 = (1 << 64) - 1


def _chunk_seed(seed: int, group: int, start: int) -> int:
    # splitmix64: chunks and groups get independent streams of rounding bits from one seed.
    x = (seed + 0x9E3779B97F4A7C15 * ((group << 40) + start + 1)) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


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
    ``betas``, ``eps``, ``weight_decay``), all on one device: a CUDA GPU, or the CPU. Trainable
    params become views of one flat buffer per group; frozen ones are left alone. Grads are
    taken from the params during backward (``param.grad`` is None afterwards): clip with
    ``max_grad_norm``, read the norm from ``last_grad_norm``. Host bytes per param: 14 (fp32
    master and states), 10 (bf16 states), 8 (bf16 master and states), see ``memory_stats()``.

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
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        adamw_mode: bool = True,
        fp32_optimizer_states: bool = True,
        master_weights_dtype: torch.dtype = torch.float32,
        max_grad_norm: float | None = None,
        process_group: Any | None = None,
        bucket_size: int = DEFAULT_BUCKET_SIZE,
        max_inflight_buckets: int = 2,
        stochastic_rounding: bool = False,
        seed: int | None = None,
    ) -> None:
        check_hyper_parameters("cpu_adam.OffloadOptimizer", float(lr), betas, eps, weight_decay)
        if master_weights_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(
                f"master_weights_dtype must be torch.float32 or torch.bfloat16, got {master_weights_dtype}"
            )
        if stochastic_rounding and master_weights_dtype != torch.bfloat16:
            raise ValueError(
                "stochastic_rounding applies to bf16 master weights: pass master_weights_dtype=torch.bfloat16"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
        if max_inflight_buckets < 1:
            raise ValueError(f"max_inflight_buckets must be at least 1, got {max_inflight_buckets}")

        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=adamw_mode)
        self._building = True
        super().__init__(_param_groups(params), defaults)
        self._building = False

        self.max_grad_norm = max_grad_norm
        self.master_weights_dtype = master_weights_dtype
        self.state_dtype = torch.float32 if fp32_optimizer_states else torch.bfloat16
        self.stochastic_rounding = stochastic_rounding
        # Drawn only when used: building the optimizer must not shift the user's random stream.
        if seed is None:
            seed = int(torch.randint(2**62, (1,)).item()) if stochastic_rounding else 0
        self.seed = int(seed)
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        # Seconds the last step spent waiting for grads to come down, on the norm, on the kernel.
        self.step_timings: dict[str, float] = {}
        self._chunk = self.bucket_size = bucket_size

        trainable = [[p for p in g["params"] if p.requires_grad] for g in self.param_groups]
        self._dev = DeviceOps(self._check_params(trainable))
        # Before the params become views of the flat buffers, so a bad group leaves the model alone.
        self._comm = None if process_group is None else ShardComm(process_group, self._dev.device)
        self.world_size, self.rank = (1, 0) if self._comm is None else (self._comm.world_size, self._comm.rank)
        if self._comm is not None:
            check_threads(self.rank, self.world_size)
            layout = [[tuple(p.shape) for p in ps] for ps in trainable]
            self._comm.check_same(
                "the parameters and options",
                (layout, bucket_size, str(master_weights_dtype), str(self.state_dtype), stochastic_rounding),
                "build the optimizer on the same model, param groups and options on every rank",
            )
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
        self._grads = GradCollector(self._dev, self._groups, max_inflight_buckets, self._comm)

    # -- construction -------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if not self._building:
            raise NotImplementedError(
                "cpu_adam.OffloadOptimizer lays params out in flat buffers when it is built: "
                "pass every param group to the constructor"
            )
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
            if p.layout != torch.strided:
                raise TypeError(f"cpu_adam.OffloadOptimizer: parameters must be dense tensors, got {p.layout}")
        devices = sorted({str(p.device) for p in params})
        if len(devices) > 1:
            raise RuntimeError(
                f"cpu_adam.OffloadOptimizer: trainable parameters are on several devices ({', '.join(devices)}); "
                "put the whole model on one device (model.to(device)) before building the optimizer"
            )
        return params[0].device

    # -- step ---------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Adam step on the grads of the backward passes since the last step or zero_grad."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._comm is not None:
            self._comm.check_alive()  # also after a backward that failed on it
        if self._grads.micro == 0:
            return loss  # no grads: like torch's optimizers, leave every param as it is
        t0 = time.perf_counter()
        self._grads.wait_all()
        t1 = time.perf_counter()
        self._sync_masters()
        norm = self._global_norm()
        self.last_grad_norm = norm
        t2 = time.perf_counter()
        if not math.isfinite(norm):
            self.skipped_steps += 1
            logger.warning(
                "cpu_adam.OffloadOptimizer: gradient norm is %s, step skipped (%d skipped so far)",
                norm,
                self.skipped_steps,
            )
        else:
            scale = 1.0
            if self.max_grad_norm is not None:
                scale = min(1.0, self.max_grad_norm / (norm + 1e-6))
            scale /= self.world_size  # the collectives summed the ranks' grads: this makes it their mean
            with self._dev.side_stream():  # uploads wait for what the compute stream still does with the weights
                for g, (options, group) in enumerate(zip(self.param_groups, self._groups)):
                    if group is not None:
                        self._step_group(g, options, group, scale)
                event = self._dev.record()
            self._dev.compute_waits(event)
        self._grads.reset()
        self.step_timings = {"grads_wait_s": t1 - t0, "norm_s": t2 - t1, "adam_s": time.perf_counter() - t2}
        return loss

    def _global_norm(self) -> float:
        """The norm of the grads averaged over the ranks (the plain grad norm with one process)."""
        sq = self._grads.sq_norm()
        if self._comm is None:
            return math.sqrt(sq)
        self._comm.check_same(
            "the order of the grad buckets' reduce-scatters in this step",
            self._grads.launch_order,
            "their backward passes produced grads in different orders (e.g. a parameter used on some ranks only), "
            "so the grads were reduced wrongly; every rank must run the same graph each step",
        )
        total = torch.tensor([sq], dtype=torch.float64, device=self._dev.device)
        self._comm.all_reduce_sum(total)
        return math.sqrt(float(total)) / self.world_size

    def _step_group(self, g: int, options: dict[str, Any], group: GroupBuffers, scale: float) -> None:
        grads = self._grads.grads_of(group)
        beta1, beta2 = options["betas"]
        group.step += 1
        if self._comm is None:
            outs = group.flat if self._dev.host_addressable else group.grads.tensor
            n = group.layout.shard_numel
            # Chunks let each upload overlap the next chunk's compute; with no upload, one call.
            chunk = n if self._dev.host_addressable else self._chunk
            pieces = [(slice(start, min(n, start + chunk)), None) for start in range(0, n, chunk)]
        else:
            # Each bucket's piece is gathered as soon as it is computed, while the next one computes.
            outs = group.grads.tensor
            pieces = [(h, b) for b, (_, h) in enumerate(group.device_pieces()) if h.stop > h.start]
        for c, b in pieces:
            adam_step(
                [group.master[c]],
                [grads[c]],
                [group.exp_avg[c]],
                [group.exp_avg_sq[c]],
                step=group.step,
                lr=float(options["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=float(options["eps"]),
                weight_decay=float(options["weight_decay"]),
                adamw_mode=bool(options["adamw_mode"]),
                grad_scale=scale,
                bf16_outs=[outs[c]],
                stochastic_rounding=self.stochastic_rounding,
                seed=_chunk_seed(self.seed, g, c.start) if self.stochastic_rounding else 0,
            )
            if b is None:
                self._dev.copy(group.flat[c], outs[c])
            else:
                self._publish(group, b)

    def _publish(self, group: GroupBuffers, b: int) -> None:
        """Uploads this rank's new bf16 weights of bucket ``b`` (in the host buffer) and all-gathers the bucket.

        Call on the side stream. On a GPU the piece goes up into its own place in the flat weights
        and the all-gather runs in place (NCCL allows it when the input is the rank's slice of the
        output); on the CPU the host buffer is the all-gather's input.
        """
        piece, bucket = group.layout.pieces[b], group.layout.buckets[b]
        if bucket.numel == 0:
            return
        host = group.grads.tensor[piece.host : piece.host + piece.numel]
        if not self._dev.host_addressable:
            mine = group.flat[piece.flat : piece.flat + piece.numel]
            self._dev.copy(mine, host)
            host = mine
        self._comm.all_gather(group.flat[bucket.start : bucket.end], host)

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
        for group in self._groups:
            if group is not None and not group.master_synced:
                for weights, h in group.device_pieces():
                    group.master[h].copy_(weights)
                group.master_synced = True

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Discards the grads of the backward passes so far: a new accumulation window begins."""
        self._grads.wait_all()
        self._grads.reset()
        for options in self.param_groups:
            for p in options["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.detach_().zero_()

    # -- memory and checkpoints ---------------------------------------------------------------

    def memory_stats(self) -> dict[str, Any]:
        """Bytes held, measured from the allocated tensors (this process's shard on the host)."""

        def nbytes(t: Tensor | None) -> int:
            return 0 if t is None else t.untyped_storage().nbytes()

        groups = [g for g in self._groups if g is not None]
        params = sum(sum(g.layout.numels) for g in groups)
        master = sum(nbytes(g.master) for g in groups)
        states = sum(nbytes(g.exp_avg) + nbytes(g.exp_avg_sq) for g in groups)
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
            "weights_bytes": sum(nbytes(g.flat) for g in groups),
            "device_bytes": self._grads.device_bytes,
            "device_peak_bytes": self._grads.device_peak_bytes,
        }

    def state_dict(self) -> dict[str, Any]:
        """Masters, Adam states, step counts, hyper-parameters (max_grad_norm too), seed, skipped steps.

        With a process group: this rank's shard of the masters and states, and under ``"zero"``
        the rank, world size and bucket size that say how the shard was cut.

        Tensors are references to the live buffers (as with torch's optimizers): save or copy
        the dict before the next step.
        """
        self._sync_masters()
        state = {}
        for g, group in enumerate(self._groups):
            if group is not None:
                state[g] = {
                    "step": group.step,
                    "master": group.master,
                    "exp_avg": group.exp_avg,
                    "exp_avg_sq": group.exp_avg_sq,
                    "shapes": [tuple(s) for s in group.layout.shapes],
                }
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
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores a ``state_dict()`` and sets the device weights from the loaded masters.

        Takes a full state dict (one process's, or consolidated from a ZeRO run) on any number
        of ranks, each rank keeping its slice; or, with a process group, this rank's own shard.
        With a process group every rank must call it (the weights are all-gathered).
        """
        if state_dict.get("format") != STATE_DICT_FORMAT:
            raise ValueError(
                f"cpu_adam.OffloadOptimizer.load_state_dict: not a {STATE_DICT_FORMAT} state dict "
                f"(format {state_dict.get('format')!r})"
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
        zero = state_dict.get("zero")
        if zero is not None:
            check_shard(zero, self.rank, self.world_size, self.bucket_size)
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
                for name in ("master", "exp_avg", "exp_avg_sq"):
                    tensor = saved[name] if zero is not None else full_to_shard(saved[name], group.layout)
                    getattr(group, name).copy_(tensor)
                group.step = int(saved["step"])
                group.master_synced = True
                if self._comm is None:
                    group.flat.copy_(group.master)
                else:
                    group.grads.tensor.copy_(group.master)  # rounded to bf16 as the kernel rounds its outputs
                    with self._dev.side_stream():
                        for b in range(len(group.layout.buckets)):
                            self._publish(group, b)
                    self._dev.synchronize()  # before the host buffer receives grads again
        for options, saved in zip(self.param_groups, saved_groups):
            options.update({k: v for k, v in saved.items() if k != "params"})
        self.seed = int(state_dict["seed"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.max_grad_norm = state_dict["max_grad_norm"]
        self._grads.reset()

    def __del__(self) -> None:
        # Pending copies must finish before the pinned buffers are unregistered and freed.
        try:
            self._grads.remove_hooks()
            self._dev.synchronize()
        except Exception:
            pass
