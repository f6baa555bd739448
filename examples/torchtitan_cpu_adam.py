"""CPUAdam in torchtitan, without forking it: an optimizer container that knows the name "CPUAdam".

torchtitan builds its optimizers from names (``ParamGroupConfig.optimizer_name``) that its
``OptimizersContainer`` resolves to classes; this subclass adds ``"CPUAdam"`` and leaves the rest
(its FQN-keyed state dict for DCP, the zero-grad lr=0 state initialisation, the LR schedulers, the
checkpointer) as torchtitan wrote it. Put this file on ``PYTHONPATH`` and name a config of it:

    PYTHONPATH=examples torchrun --nproc-per-node 8 -m torchtitan.train \\
        --module torchtitan_cpu_adam --config llama3_70b_cpu_adam

With ``training.enable_cpu_offload`` (FSDP2's ``CPUOffloadPolicy``) each rank's fp32 shards and
grads live in host RAM and CPUAdam steps them there. torchtitan's ``implementation`` setting
("fused", "foreach", ...) only lands in CPUAdam's param groups, where it changes nothing (every
CPUAdam step is one fused pass); its "fused_opt_states_bf16" hook is for torch's Adam alone: ask
CPUAdam for bf16 moments with ``state_precision="bf16"`` instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.optim import Optimizer
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig

from cpu_adam import CPUAdam, fsdp2


class CPUAdamOptimizers(OptimizersContainer):
    """torchtitan's optimizer container, with ``optimizer_name="CPUAdam"`` resolving to CPUAdam; with
    ``step_behind_forward``, each CPUAdam steps behind the next forward of the model part it holds
    (``self.behind_forward``: their handles)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):  # its own Config: torchtitan's build() makes its owner
        step_behind_forward: bool = False
        """CPUAdam's step() queues the step and returns; the next forward runs while the host steps."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        super().__init__(config, model_parts=model_parts)
        self.behind_forward: list[fsdp2.StepBehindForward] = []
        if config.step_behind_forward:
            for optimizer in self.optimizers:
                if isinstance(optimizer, CPUAdam):
                    self.behind_forward.append(fsdp2.step_behind_forward(self._part_of(optimizer), optimizer))

    def _part_of(self, optimizer: Optimizer) -> nn.Module:
        """The model part whose params ``optimizer`` holds (torchtitan builds one optimizer a part and name)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return next(part for part in self.model_parts if any(id(p) in held for p in part.parameters()))

    @staticmethod
    def _resolve_optimizer_factory(name: str) -> Callable[..., Optimizer]:
        if name == "CPUAdam":
            return CPUAdam
        return OptimizersContainer._resolve_optimizer_factory(name)


def cpu_adam_optimizers(lr: float = 8e-4, step_behind_forward: bool = False, **kwargs: Any) -> CPUAdamOptimizers.Config:
    """torchtitan's ``default_adamw`` with CPUAdam: one catch-all group, torchtitan's defaults.

    ``step_behind_forward``: the step runs behind the next forward (see this module's docstring).
    kwargs go to CPUAdam: ``state_precision="bf16"`` for bf16 moments, ``stochastic_rounding=True``
    for a bf16 model (``training.dtype="bfloat16"``), ...
    """
    hyper = {"lr": lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, **kwargs}
    group = ParamGroupConfig(pattern=r".*", optimizer_name="CPUAdam", optimizer_kwargs=hyper)
    return CPUAdamOptimizers.Config(
        param_groups=[group], implementation="for-loop", step_behind_forward=step_behind_forward
    )


def llama3_70b_cpu_adam() -> Any:
    """torchtitan's Llama 3 70B config (8 GPUs) with FSDP2's CPU offload and CPUAdam (bf16 moments)."""
    from torchtitan.models.llama3.config_registry import llama3_70b

    config = llama3_70b()
    config.optimizer = cpu_adam_optimizers(lr=3e-4, state_precision="bf16")
    config.training.enable_cpu_offload = True
    return config
