"""While a step is in flight, every op of the thread that called ``step()`` that reads or writes a tensor of the
step waits for the unit that owns it: FSDP2's gather of a unit (its pre-forward unshard, a prefetch, an explicit
``unshard()``) reads that unit's shards and waits for that unit alone; ``state_dict()``, ``clip_grad_norm_``, an
EMA or ``full_tensor()`` read every unit's tensors and so wait for every unit; a backward waits for the whole step.

It is a torch function mode on that thread's stack, so it sees torch's ops on tensors (plain, DTensor, and their
local shards) but not other threads. Reading an attribute (``p.grad``, ``p.shape``) or metadata (``size()``) does
not wait: it reads no element. Handing out the elements (``data_ptr()``, ``untyped_storage()``, ``.data``) waits, so a
C library or a serializer that reads through them reads the stepped values if it asks on this thread.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

__all__ = ["ReadGuard"]

_METADATA = frozenset(
    getattr(Tensor, name)
    for name in (
        "size",
        "stride",
        "dim",
        "numel",
        "nelement",
        "is_contiguous",
        "storage_offset",
        "element_size",
        "is_pinned",
        "get_device",
        "is_floating_point",
        "is_complex",
        "is_inference",
        "__len__",
    )
)
_ALIASES = frozenset({"data"})  # attributes that hand out the elements under another tensor object
_WHOLE_STEP = (Tensor.backward, torch.autograd.backward, torch.autograd.grad)


class ReadGuard(TorchFunctionMode):
    """Waits, before an op, for the units whose tensors the op takes (``unit_of``: id of a tensor -> its unit)."""

    def __init__(
        self,
        unit_of: dict[int, int],
        held: list[Tensor],
        wait_unit: Callable[[int], None],
        wait_all: Callable[[], None],
        finished: Callable[[], bool],
    ) -> None:
        super().__init__()
        self._unit_of = unit_of
        self._held = held  # the guarded tensors stay alive, so that their ids stay theirs
        self._wait_unit = wait_unit
        self._wait_all = wait_all
        self._finished = finished

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._finished():
            if func in _WHOLE_STEP:
                self._wait_all()
            elif not _reads_no_element(func):
                for unit in self._units_of(itertools.chain(args, kwargs.values())):
                    self._wait_unit(unit)
        return func(*args, **kwargs)

    def _units_of(self, values: Iterable[object]) -> list[int]:
        unit_of = self._unit_of
        units: list[int] = []
        for value in values:
            for each in value if type(value) in (list, tuple) else (value,):
                unit = unit_of.get(id(each))
                if unit is not None and unit not in units:
                    units.append(unit)
        return units


def _reads_no_element(func: object) -> bool:
    if func in _METADATA:
        return True
    if getattr(func, "__name__", None) in ("__get__", "__set__"):  # an attribute of a tensor
        return getattr(getattr(func, "__self__", None), "__name__", None) not in _ALIASES
    return False
