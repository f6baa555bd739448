"""Which form of a Triton kernel runs: compiled on a CUDA device, interpreted on CPU tensors.

Triton's interpreter runs a kernel's own Python with numpy, one program at a time: float32
operations rounded once each, as on the GPU with fusion off, so the tests on a machine without a
GPU run the very code a GPU compiles. The interpreter only calls helpers that are interpreted
too, so each module a kernel reaches gets a twin namespace in which its own ``@triton.jit`` functions (not
Triton's, which the interpreter recognises by identity) are interpreted ones: kernels call helpers
by their names, never as attributes of a module.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

__all__ = ["for_device"]

_namespaces: dict[str, dict[str, Any]] = {}
_twins: dict[int, InterpretedFunction] = {}


def for_device(kernel: JITFunction, device: torch.device) -> Any:
    """``kernel`` itself on CUDA, its interpreted twin elsewhere."""
    return kernel if device.type == "cuda" else _twin(kernel)


def _twin(jit: JITFunction) -> InterpretedFunction:
    if id(jit) not in _twins:
        fn = jit.fn
        namespace = _namespace(fn.__module__)
        copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
        _twins[id(jit)] = InterpretedFunction(copy)
    return _twins[id(jit)]


def _namespace(module: str) -> dict[str, Any]:
    if module not in _namespaces:
        namespace = _namespaces[module] = dict(vars(sys.modules[module]))
        for name, value in list(namespace.items()):
            if isinstance(value, JITFunction) and not value.fn.__module__.startswith("triton"):
                namespace[name] = _twin(value)
    return _namespaces[module]
