"""What the offload optimizer refuses, each with the fix named: the uses that would train wrongly."""

from __future__ import annotations

import sys
import warnings

from torch import Tensor

from .device import DeviceOps

__all__ = [
    "check_not_capturing",
    "check_not_compiled_autograd",
    "check_open",
    "check_unfrozen",
    "copy_refused",
    "grad_scaler_refused",
    "step_busy",
]


def check_open(closed: bool, verb: str) -> None:
    if closed:
        raise RuntimeError(
            f"cpu_adam.OffloadOptimizer.{verb}: this optimizer was closed (close()), and its params may be trained "
            "by another one now; build a new optimizer over them (and load a state dict saved before close())"
        )


def check_not_capturing(dev: DeviceOps) -> None:
    if dev.is_capturing():
        raise RuntimeError(
            "cpu_adam.OffloadOptimizer: step() cannot be captured in a CUDA graph: it waits on the host for the "
            "grads and runs Adam on the CPU. Capture the forward only, or train without CUDA graphs"
        )


def check_not_compiled_autograd() -> None:
    compiled_autograd = sys.modules.get("torch._dynamo.compiled_autograd")  # never imported: not in use
    if getattr(compiled_autograd, "in_compiled_autograd_region", False):
        raise RuntimeError(
            "cpu_adam.OffloadOptimizer: backward runs under compiled autograd (torch._dynamo.config."
            "compiled_autograd), but the optimizer's grad hooks copy each grad to host memory as backward makes it "
            "and need the autograd engine to say when backward ends. Turn compiled autograd off: torch.compile(model) "
            "compiles the backward too, and the hooks run after it"
        )


def check_unfrozen(frozen: list[Tensor]) -> None:
    """Params frozen when the flat layout was made are not in it: unfrozen later, they would never be trained."""
    if any(p.requires_grad for p in frozen):
        raise RuntimeError(
            "cpu_adam.OffloadOptimizer: a param that was frozen (requires_grad=False) when the optimizer was built "
            "now requires grad, and would never be trained: its layout in host memory is made at construction. "
            "Build the optimizer after unfreezing (close() the old one; keep its state with state_dict())"
        )


def grad_scaler_refused() -> RuntimeError:
    return RuntimeError(
        "cpu_adam.OffloadOptimizer does not take a GradScaler: bf16 has float32's exponent range, so loss "
        "scaling is not needed. Call loss.backward() and optimizer.step() without the scaler; clip with "
        "clip_grad_norm_ or max_grad_norm, and non-finite grads skip the step by themselves"
    )


def step_busy() -> RuntimeError:
    return RuntimeError(
        "cpu_adam.OffloadOptimizer.step() is already running in another thread: two steps at once would "
        "each update the same state. Call step() from one thread (the one that runs backward)"
    )


def copy_refused() -> TypeError:
    return TypeError(
        "cpu_adam.OffloadOptimizer cannot be copied or pickled: it holds hooks on the model's params, pinned "
        "host memory and a worker thread. Save optimizer.state_dict() (cpu_adam.save_checkpoint), and load it "
        "into a new OffloadOptimizer built over the params"
    )


def warn_no_grads() -> None:
    warnings.warn(
        "cpu_adam.OffloadOptimizer.step(): no grad reached its params since the last step, so nothing was "
        "updated. Call backward() before step(); if the model's params were replaced after the optimizer "
        "was built (load_state_dict(assign=True), modules re-created), build the optimizer again over the "
        "new params",
        RuntimeWarning,
        stacklevel=5,
    )
