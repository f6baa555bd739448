"""CPUAdam: torch.optim.Optimizer over the fused, vectorized CPU kernel."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _global_optimizer_post_hooks

from ._compiled_step import GroupStep, adam_step_groups
from ._group_steps import group_steps
from ._precision import (
    MOMENTS,
    SCALES,
    resolved_precision,
    state_dtype,
)
from ._saved_state import split_moments
from ._turn import Turn, one_at_a_time
from ._validation import check_hyper_parameters, check_param_group, check_step_count, check_torch_flags, checked_seed
from .clipping import ASK, check_max_grad_norm, clipped
from .fsdp2 import checkpoint_form, places

logger = logging.getLogger(__name__)

_OWN_KEYS = (
    "bias_correction",
    "fp32_optimizer_states",
    "state_precision",
    "stochastic_rounding",
    "seed",
    "decoupled_weight_decay",
)
_UNSUPPORTED_FLAGS = ("amsgrad", "capturable", "differentiable")


_local = places.local


def _busy(verb: str) -> RuntimeError:
    """A step, a load or an add_param_group while another thread is in one of them: refused before anything changes
    (the other goes on as if alone)."""
    return RuntimeError(
        f"CPUAdam.{verb}: another thread is stepping this optimizer (or loading or adding to it) right now; two at "
        "once would update the same state. Call step(), load_state_dict() and add_param_group() from one thread, "
        "or guard them with a lock of your own"
    )


class CPUAdam(torch.optim.Optimizer):
    """Adam / AdamW for CPU parameters, one fused vectorized pass per step.

    Math in float32, in ``torch.optim.AdamW``'s order, for float32 or bfloat16
    params and grads (a grad may differ in dtype from its param). Param groups
    hold torch's key ``decoupled_weight_decay`` for the mode, so state dicts load
    both ways between this optimizer and ``torch.optim.AdamW`` / ``Adam``.

    Args:
        adamw_mode: decoupled weight decay (AdamW); False adds ``weight_decay * p``
            to the grad (Adam with L2).
        bias_correction: divide the moments by ``1 - beta**step``.
        amsgrad: not supported; True raises.
        state_precision: how ``exp_avg`` and ``exp_avg_sq`` are kept: "fp32" (the
            default), "bf16" (half the bytes), or "8bit": uint8 codes shaped like the
            param plus ``state_scales``, a float32 scale per moment per block of 256
            elements (``cpu_adam.quant8``; 2.03 bytes per param for both moments), for
            every tensor, small ones included (docs/cpu_adam.md says why).
        fp32_optimizer_states: DeepSpeed's shorthand, True for "fp32" and False for
            "bf16"; passing it with a ``state_precision`` it contradicts raises.
        stochastic_rounding: round bfloat16 param stores stochastically (updates below half
            an ulp still move weights on average); float32 params ignore it.
        seed: the random bits of stochastic rounding and 8-bit codes (default 0, not drawn:
            replicas seeded per rank still step alike). Saved in the state dict.
        max_grad_norm: clip inside the step by ``clip_grad_norm_``'s factor of the global
            norm (float64, ``cpu_adam.fsdp2.norm``; DTensors over their meshes); no pass
            rewrites the grads, and a non-finite norm skips the step (``skipped_steps``).
            ``grad_norm`` holds the last norm. May be changed between steps; not saved.
            Under DeepSpeed it is refused: clip with DeepSpeed's ``gradient_clipping``.
        norm_group: plain params on several ranks: None if each rank's grads are all of
            them (DDP), or the process group whose ranks hold parts of them; left unsaid
            there, ``max_grad_norm`` refuses to guess.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        *,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        fp32_optimizer_states: bool | None = None,
        state_precision: str | None = None,
        stochastic_rounding: bool = False,
        seed: int | None = None,
        max_grad_norm: float | None = None,
        norm_group: object = ASK,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        check_torch_flags(
            foreach=foreach, fused=fused, amsgrad=amsgrad, capturable=capturable, differentiable=differentiable
        )
        del foreach, fused  # every step is one fused pass: both implementations of torch give these numbers
        if weight_decay is None:  # as the optimizer it stands in for: torch.optim.AdamW or torch.optim.Adam
            weight_decay = 1e-2 if adamw_mode else 0.0
        check_hyper_parameters("CPUAdam", lr, betas, eps, weight_decay)
        state_precision = resolved_precision("CPUAdam", state_precision, fp32_optimizer_states)
        if seed is None:  # not drawn: replicas seeded per rank (DDP) must still round alike
            seed = 0
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": adamw_mode,
            "bias_correction": bias_correction,
            "amsgrad": False,
            "maximize": maximize,
            "fp32_optimizer_states": state_precision == "fp32",
            "state_precision": state_precision,
            "stochastic_rounding": stochastic_rounding,
            "seed": checked_seed("CPUAdam", seed),
        }
        self._turn = Turn()  # before torch's __init__, which calls add_param_group
        self.max_grad_norm = check_max_grad_norm("CPUAdam", max_grad_norm)
        self.norm_group = norm_group
        self.grad_norm: Tensor | None = None
        super().__init__(params, defaults)

    def __getstate__(self) -> dict[str, Any]:
        # A process group does not pickle: a copy asks for it again (max_grad_norm refuses until it is set).
        group = self.__dict__.get("norm_group", ASK)
        own = {
            "max_grad_norm": self.__dict__.get("max_grad_norm"),
            "norm_group": group if group in (None, ASK) else ASK,
        }
        return {**super().__getstate__(), **own}

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Unpickled or copied (torch's __getstate__ keeps defaults, state and groups alone): a lock of its own. Within
        # load_state_dict, torch's load calls this too: the lock held stays the one.
        self.__dict__.setdefault("_turn", Turn())
        self.__dict__.setdefault("max_grad_norm", None)
        self.__dict__.setdefault("norm_group", ASK)
        self.__dict__.setdefault("grad_norm", None)
        # Groups loaded from torch.optim.Adam/AdamW lack our keys (and only those are added:
        # keys torch's own __setstate__ puts in the defaults would change the state dict).
        for group in self.param_groups:
            for key in _OWN_KEYS:
                if key in self.defaults:
                    group.setdefault(key, self.defaults[key])

    @one_at_a_time(_busy)
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self._settled("add_param_group")
        if isinstance(param_group, dict):  # torch's add_param_group refuses anything else
            owner = f"CPUAdam param group {len(self.param_groups)}"
            if "state_precision" in param_group or "fp32_optimizer_states" in param_group:
                precision = resolved_precision(
                    owner, param_group.get("state_precision"), param_group.get("fp32_optimizer_states")
                )
                param_group = {
                    **param_group,
                    "state_precision": precision,
                    "fp32_optimizer_states": precision == "fp32",
                }
            _check_group(f"CPUAdam param group {len(self.param_groups)}", {**self.defaults, **param_group})
        super().add_param_group(param_group)

    @torch.no_grad()
    @one_at_a_time(_busy)  # not when compiled: a compiled step is one opaque op (_compiled_step.py)
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        behind = self._settled("step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for index, group in enumerate(self.param_groups):  # all before any is stepped: a refused step changes nothing
            _check_group(f"CPUAdam param group {index}", group)
        if self._only_creates_state():
            for group in self.param_groups:
                self._init_group(group, [], [], [], [], [], [], [])
            return loss
        clip = self._clip_factor()
        if clip is None:
            return loss
        unit_of = behind.unit_of if behind is not None else None
        groups = [self._group_steps(index, group, clip, unit_of) for index, group in enumerate(self.param_groups)]
        if behind is None:
            adam_step_groups("CPUAdam", [step for parts in groups for step in parts.values()])
            return loss
        behind.launch(groups)
        if self._optimizer_step_post_hooks or _global_optimizer_post_hooks:  # they read what the step wrote
            behind.settle()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        behind = self.__dict__.get("_behind")
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if set_to_none or behind is None or any(g.grad_fn is not None for g in grads) or not behind.zero_grads(grads):
            super().zero_grad(set_to_none)

    def _settled(self, verb: str) -> Any:
        """The handle of the step behind the forward (``cpu_adam.fsdp2.StepBehindForward``; None if off), with no
        step of it in flight: what follows sees every unit stepped."""
        behind = self.__dict__.get("_behind")
        if behind is not None:
            if torch.compiler.is_compiling():
                raise RuntimeError(
                    f"CPUAdam.{verb}: a step behind the forward runs eagerly; compile the model, not the optimizer's "
                    "step, or call remove() on the handle of cpu_adam.fsdp2.step_behind_forward"
                )
            behind.settle()
        return behind

    def _only_creates_state(self) -> bool:
        """A first step with lr 0 and all-zero grads, torch.distributed.checkpoint's way to create an
        optimizer's state before it loads one (``_init_optim_state``): it creates the state and counts no
        step, so that it changes nothing (torch's AdamW counts it: its first real step is its second)."""
        if self.state or torch.compiler.is_compiling():
            return False
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        lrs_zero = all(float(g["lr"]) == 0.0 for g in self.param_groups)
        return bool(grads) and lrs_zero and not any(bool(_local(g).any()) for g in grads)

    def _clip_factor(self) -> float | None:
        """What the grads are multiplied by in the step: clip_grad_norm_'s factor with ``max_grad_norm``, else 1;
        None where the norm is not finite: the step is skipped (nothing changes; counted in ``skipped_steps``)."""
        max_grad_norm = check_max_grad_norm("CPUAdam", self.max_grad_norm)  # may be set between steps
        if max_grad_norm is None:
            return 1.0
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        self.grad_norm, factor = clipped("CPUAdam", grads, max_grad_norm, self.__dict__.get("norm_group", ASK))
        if factor is None:
            self.skipped_steps = self.__dict__.get("skipped_steps", 0) + 1
            logger.warning(
                "cpu_adam.CPUAdam: gradient norm is %s, step skipped (%d skipped so far)",
                float(self.grad_norm),
                self.skipped_steps,
            )
        return factor

    def _group_steps(
        self, index: int, group: dict[str, Any], clip: float = 1.0, unit_of: Callable[[Tensor], int] | None = None
    ) -> dict[int, GroupStep]:
        """The group's part of the step: one GroupStep, or one per unit that ``unit_of`` puts its params in."""
        tensors: tuple[list[Tensor], ...] = ([], [], [], [], [], [])  # params, grads, moments, steps, 8-bit scales
        indices: list[int] = []
        self._init_group(group, *tensors, indices)
        return group_steps(index, group, tensors, indices, self._shard_start, clip, unit_of)

    def _shard_start(self, p: Tensor) -> int:
        """Where ``p``'s local shard starts in its whole param (0 for a plain tensor), found once per param."""
        starts = self.__dict__.setdefault("_shard_starts", {})
        if id(p) not in starts:
            starts[id(p)] = places.shard_start(p)
        return starts[id(p)]

    def _init_group(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        steps: list[Tensor],
        state_scales: list[Tensor],
        indices: list[int],
    ) -> None:
        """Appends the local tensors of the params that have grads (and the block scales of 8-bit states),
        and the params' places in the group; state is created on a param's first step.

        Named and shaped as torch's optimizers' method, which torch.compile runs in Python instead of
        tracing it.
        """
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                dtype = state_dtype(group["state_precision"])
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                for key in MOMENTS:
                    state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                if dtype == torch.uint8:  # an all-zero block's scale is 1
                    blocks = places.local_blocks(_local(p).numel(), self._shard_start(p))
                    state[SCALES] = torch.ones(2, blocks, dtype=torch.float32)
            params.append(_local(p))
            grads.append(_local(p.grad))
            exp_avgs.append(_local(state["exp_avg"]))
            exp_avg_sqs.append(_local(state["exp_avg_sq"]))
            steps.append(state["step"])
            if SCALES in state:
                state_scales.append(state[SCALES])
            indices.append(i)

    def state_dict(self) -> dict[str, Any]:
        """torch's state dict, but for 8-bit moments of DTensor params: their block scales as each
        element's exponents (``checkpoint_form.EXPONENTS``), int8 DTensors sharded like the param, so that
        torch.distributed.checkpoint reshards them with the codes."""
        self._settled("state_dict")
        params = [p for g in self.param_groups for p in g["params"]]  # torch's state dict indexes them so
        return checkpoint_form.with_exponents(super().state_dict(), params, self.state, self._shard_start)

    @one_at_a_time(_busy)
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this optimizer's or torch Adam/AdamW's state dict.

        Refused while another thread steps this optimizer (or loads into it), before anything changes.

        Hyper-parameters come from the state dict, as in torch, and are checked before anything
        changes; the moments keep the precision this optimizer was built with
        (``state_precision``), converted directly from what was saved: float moments are
        quantized into an 8-bit optimizer, 8-bit ones dequantized into a float one
        (``cpu_adam.quant8``). (torch's own load
        would cast them to the param dtype first, losing float32 moments of bfloat16 params.)
        Load hooks see the whole state dict, as with torch's optimizers.
        """
        self._settled("load_state_dict")
        state_dict = state_dict.copy()
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            if returned is not None:
                state_dict = returned
        _check_loadable(state_dict, self.defaults)
        keep_precisions = [(g["fp32_optimizer_states"], g["state_precision"]) for g in self.param_groups]
        params = [p for g in self.param_groups for p in g["params"]]
        dtype_of = {id(p): state_dtype(g["state_precision"]) for g in self.param_groups for p in g["params"]}
        loaded, without_moments = split_moments(state_dict, params, dtype_of, self._shard_start)
        with _load_hooks_paused(self):  # they ran above, on the state dict with its moments
            super().load_state_dict(without_moments)
        for group, (fp32, precision) in zip(self.param_groups, keep_precisions):
            group["fp32_optimizer_states"] = fp32
            group["state_precision"] = precision
        for p in params:
            if id(p) in loaded:
                self.state[p].update(loaded[id(p)])
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)


def _check_group(owner: str, group: dict[str, Any]) -> None:
    compiling = torch.compiler.is_compiling()
    if not compiling:  # a compiled step checks the values when it runs (adam_step_groups)
        check_param_group(owner, group)
        checked_seed(owner, group["seed"])
    # While compiling, dynamo shows every param group with capturable=True (for its CUDA graphs);
    # the group itself is unchanged.
    ignored = ("capturable",) if compiling else ()
    unsupported = [flag for flag in _UNSUPPORTED_FLAGS if group.get(flag) and flag not in ignored]
    if unsupported:
        raise ValueError(
            f"{owner}: CPUAdam supports none of {', '.join(_UNSUPPORTED_FLAGS)}; "
            f"set {' and '.join(unsupported)} False in the param group"
        )


def _check_loadable(state_dict: dict[str, Any], defaults: dict[str, Any]) -> None:
    for index, saved in enumerate(state_dict["param_groups"]):
        _check_group(f"CPUAdam.load_state_dict: param group {index}", {**defaults, **saved})
    for key, saved in state_dict["state"].items():
        if isinstance(saved, dict) and "step" in saved:
            check_step_count(f"CPUAdam.load_state_dict: the state of param {key}", saved["step"])


@contextmanager
def _load_hooks_paused(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    hooks = optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks
    optimizer._optimizer_load_state_dict_pre_hooks = OrderedDict()
    optimizer._optimizer_load_state_dict_post_hooks = OrderedDict()
    try:
        yield
    finally:
        optimizer._optimizer_load_state_dict_pre_hooks, optimizer._optimizer_load_state_dict_post_hooks = hooks
