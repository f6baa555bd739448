"""CPUAdam: torch.optim.Optimizer over the fused, vectorized CPU kernel."""

from __future__ import annotations

import sys
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from . import ops

MOMENTS = ("exp_avg", "exp_avg_sq")
_OWN_KEYS = ("bias_correction", "fp32_optimizer_states", "stochastic_rounding", "seed", "decoupled_weight_decay")


def _local(t: Tensor) -> Tensor:
    """The tensor the kernel updates: a DTensor's local shard, else the tensor itself."""
    # Importing torch.distributed.tensor costs most of a second; until someone has
    # imported it, no DTensor can exist.
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


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
        fp32_optimizer_states: keep ``exp_avg`` and ``exp_avg_sq`` in float32;
            False keeps them in bfloat16 whatever the params' dtype (half the bytes).
        stochastic_rounding: round bfloat16 param stores stochastically, so that
            updates below half a bfloat16 ulp still move weights on average.
            float32 params ignore it.
        seed: the stochastic rounding stream; by default drawn from torch's
            generator at construction. Saved in the state dict.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        *,
        adamw_mode: bool = True,
        bias_correction: bool = True,
        amsgrad: bool = False,
        fp32_optimizer_states: bool = True,
        stochastic_rounding: bool = False,
        seed: int | None = None,
        maximize: bool = False,
        foreach: bool | None = None,
        fused: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
    ) -> None:
        if amsgrad:
            raise ValueError(
                "CPUAdam does not implement amsgrad; use torch.optim.AdamW(amsgrad=True) for it, or drop amsgrad=True"
            )
        if capturable or differentiable:
            raise ValueError(
                "CPUAdam supports neither capturable=True (CUDA graph capture of the step) nor differentiable=True "
                "(autograd through the step); use torch.optim.AdamW for those"
            )
        del foreach, fused  # every step is one fused pass: both implementations of torch give these numbers
        if weight_decay is None:  # as the optimizer it stands in for: torch.optim.AdamW or torch.optim.Adam
            weight_decay = 1e-2 if adamw_mode else 0.0
        ops.check_hyper_parameters("CPUAdam", float(lr), betas, eps, weight_decay)
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,)).item())
        defaults = {
            "lr": lr,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "decoupled_weight_decay": adamw_mode,
            "bias_correction": bias_correction,
            "amsgrad": False,
            "maximize": maximize,
            "fp32_optimizer_states": fp32_optimizer_states,
            "stochastic_rounding": stochastic_rounding,
            "seed": seed,
        }
        super().__init__(params, defaults)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        # Groups loaded from torch.optim.Adam/AdamW lack our keys (and only those are added:
        # keys torch's own __setstate__ puts in the defaults would change the state dict).
        for group in self.param_groups:
            for key in _OWN_KEYS:
                if key in self.defaults:
                    group.setdefault(key, self.defaults[key])

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        calls = [call for index, group in enumerate(self.param_groups) for call in self._kernel_calls(index, group)]
        if len(calls) > 1:  # each call is all or nothing; checked together first, so is the whole step
            for kwargs, _ in calls:
                ops.adam_step(**kwargs, check_only=True)
        for kwargs, states in calls:
            ops.adam_step(**kwargs)
            for state in states:  # counted once the kernel has run: a step that raised changes no count
                state["step"] += 1
        return loss

    def _kernel_calls(self, index: int, group: dict[str, Any]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        """The group's ``ops.adam_step`` arguments, one call per step count, each with the states it advances."""
        if group.get("amsgrad") or group.get("capturable") or group.get("differentiable"):
            raise ValueError(
                "CPUAdam supports none of amsgrad, capturable and differentiable; set them False in the param group"
            )
        # Params whose step counts differ (added later, or without grads on some
        # steps) need their own bias corrections: one kernel call per count.
        by_step: dict[int, list[Tensor]] = defaultdict(list)
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self._state_for(p, group)
            by_step[int(state["step"].item()) + 1].append(p)  # the step being taken
        beta1, beta2 = group["betas"]
        offsets = {}
        if group["stochastic_rounding"]:  # each param at its place in the group's counter space
            offsets = dict(
                zip(map(id, group["params"]), ops.back_to_back(group["params"], ops.group_counter_base(index)))
            )
        calls = []
        for step, params in by_step.items():
            states = [self.state[p] for p in params]
            kwargs = dict(
                params=[_local(p) for p in params],
                grads=[_local(p.grad) for p in params],
                exp_avgs=[_local(s["exp_avg"]) for s in states],
                exp_avg_sqs=[_local(s["exp_avg_sq"]) for s in states],
                step=step,
                lr=float(group["lr"]),
                beta1=float(beta1),
                beta2=float(beta2),
                eps=group["eps"],
                weight_decay=group["weight_decay"],
                adamw_mode=group["decoupled_weight_decay"],
                bias_correction=group["bias_correction"],
                grad_scale=-1.0 if group.get("maximize") else 1.0,  # maximize: the step climbs the grad
                stochastic_rounding=group["stochastic_rounding"],
                seed=group["seed"],
                counter_offsets=[offsets[id(p)] for p in params] if offsets else None,
            )
            calls.append((kwargs, states))
        return calls

    def _state_for(self, p: Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            dtype = _state_dtype(group)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in MOMENTS:
                state[key] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads this optimizer's or torch Adam/AdamW's state dict.

        Hyper-parameters come from the state dict, as in torch; the moments keep
        the dtype this optimizer was built with (``fp32_optimizer_states``),
        converted directly from what was saved. (torch's own load would cast them
        to the param dtype first, losing float32 moments of bfloat16 params.)
        """
        keep_fp32_states = [g["fp32_optimizer_states"] for g in self.param_groups]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        moments = {
            i: {k: v for k, v in s.items() if k in MOMENTS} for i, s in state_dict["state"].items() if i in saved_ids
        }
        # Steps are cloned: torch's load keeps the saved step tensors, which a live
        # optimizer that produced them would go on incrementing in place.
        without_moments = {
            "state": {
                i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items() if k not in MOMENTS}
                for i, s in state_dict["state"].items()
            },
            "param_groups": state_dict["param_groups"],
        }
        for saved in without_moments["state"].values():
            if "step" in saved and not torch.is_tensor(saved["step"]):  # torch < 1.12 and DeepSpeed save a number
                saved["step"] = torch.tensor(float(saved["step"]), dtype=torch.float32)
        super().load_state_dict(without_moments)
        for group, fp32 in zip(self.param_groups, keep_fp32_states):
            group["fp32_optimizer_states"] = fp32
        group_of = {id(p): g for g in self.param_groups for p in g["params"]}
        for saved_id, p in zip(saved_ids, params):
            dtype = _state_dtype(group_of[id(p)])
            for key, value in moments.get(saved_id, {}).items():
                self.state[p][key] = value.to(device=p.device, dtype=dtype, copy=True)


def _state_dtype(group: dict[str, Any]) -> torch.dtype:
    return torch.float32 if group["fp32_optimizer_states"] else torch.bfloat16
