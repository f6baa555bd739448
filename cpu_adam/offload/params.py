"""The model's side: which params the optimizer takes, that they stay as it took them, and weights written by others.

The model stays an ordinary model: each param keeps its own device storage, and the optimizer
refuses params it would train wrongly (another dtype, another device, shared memory, already
trained by another optimizer), when it is built and again at each step. The masters follow the
weights: all of them are taken before the first step, and afterwards those of params someone
else wrote (``model.load_state_dict``, an in-place init), seen through the params' version
counters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .layout import FlatLayout
from .store import Store

__all__ = ["WEIGHTS_DTYPE", "ModelSide", "check_params", "check_unclaimed", "claim", "param_groups", "release"]

WEIGHTS_DTYPE = torch.bfloat16  # the model's weights on the device, the only dtype the optimizer trains

# Which live optimizer trains each param. Kept beside the params, not on them: an attribute would
# travel with the model into torch.save and pickle, which cannot take a weak reference.
# By id, with a weak reference to the param that drops the entry with it (a tensor's == compares
# elements, so tensors cannot be the keys of a WeakKeyDictionary).
_OWNERS: dict[int, tuple[weakref.ref[Tensor], weakref.ref[Any]]] = {}


def _owner_of(p: Tensor) -> Any:
    param, owner = _OWNERS.get(id(p), (None, None))
    return owner() if param is not None and param() is p else None


def param_groups(params: Iterable[Any]) -> list[dict[str, Any]]:
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


def check_params(groups: list[list[Tensor]]) -> torch.device:
    """The one device of the trainable params, once they are checked to be trainable here."""
    params = [p for ps in groups for p in ps]
    if not params:
        raise ValueError("cpu_adam.OffloadOptimizer: no parameter requires grad, nothing to train")
    if all(p.is_meta for p in params):
        raise RuntimeError(
            "cpu_adam.OffloadOptimizer: the params are on the meta device (no memory yet). Pass the device to train "
            "on, OffloadOptimizer(model.parameters(), device='cuda'), and the optimizer gives each param its "
            "storage there; load the weights before the first step"
        )
    for p in params:
        if p.dtype != WEIGHTS_DTYPE:
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
    check_no_shared_memory(params)
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise RuntimeError(
            f"cpu_adam.OffloadOptimizer: trainable parameters are on several devices ({', '.join(devices)}); "
            "put the whole model on one device (model.to(device)) before building the optimizer"
        )
    return params[0].device


def check_no_shared_memory(params: list[Tensor]) -> None:
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


# -- ownership: one live optimizer per param ---------------------------------------------------


def check_unclaimed(groups: list[list[Tensor]]) -> None:
    """Refuses params that another live OffloadOptimizer trains: its hooks would take their grads."""
    for ps in groups:
        for p in ps:
            other = _owner_of(p)
            if other is not None and not other._closed:
                raise RuntimeError(
                    f"cpu_adam.OffloadOptimizer: a parameter of shape {tuple(p.shape)} is already trained by another "
                    "OffloadOptimizer, whose hooks would take its grads. Call close() on the old optimizer (or "
                    "delete every reference to it, schedulers included) before building a new one"
                )


def claim(groups: list[list[Tensor]], owner: Any) -> None:
    for ps in groups:
        for p in ps:
            key = id(p)
            _OWNERS[key] = (weakref.ref(p, lambda _, key=key: _OWNERS.pop(key, None)), weakref.ref(owner))


def release(groups: list[list[Tensor]], owner: Any) -> None:
    for ps in groups:
        for p in ps:
            if _owner_of(p) is owner:
                del _OWNERS[id(p)]


class ModelSide:
    """The trainable params of each group, as built, and whether their weights and the masters agree."""

    def __init__(self, params: list[list[Tensor]], layouts: list[FlatLayout | None], device: torch.device) -> None:
        self.params = params
        self._layouts = layouts
        self.device = device
        self.synced = [False] * len(params)  # the masters were taken from the weights
        # The params' version counters when weights and masters last agreed.
        self._versions: list[list[int]] = [[] for _ in params]
        self.unwritten: list[Tensor] = []  # from the meta device, filled with NaN: written before the first step?

    def weights(self, g: int, i: int) -> Tensor:
        """Param ``i``'s own storage, flat."""
        return self.params[g][i].detach().view(-1)

    def note_versions(self, g: int) -> None:
        """The weights and the masters agree now (synced, or the optimizer just wrote the weights)."""
        self._versions[g] = [p._version for p in self.params[g]]

    def _written_since(self, g: int) -> set[int]:
        return {i for i, (p, seen) in enumerate(zip(self.params[g], self._versions[g])) if p._version != seen}

    def in_sync(self) -> bool:
        """Whether the weights are what the masters were last set from or rounded to (no sync_masters needed)."""
        return all(
            layout is None or (self.synced[g] and not self._written_since(g)) for g, layout in enumerate(self._layouts)
        )

    def sync_masters(self, store: Store) -> bool:
        """Masters from the weights: all of them before the first step, then those written by others.

        Returns whether any master changed."""
        changed = False
        for g, layout in enumerate(self._layouts):
            if layout is None:
                continue
            written = None if not self.synced[g] else self._written_since(g)
            if written == set():
                continue
            for b in range(len(layout.buckets)):
                for i, part, host in layout.piece_segments(b):
                    if written is None:
                        store.write_master(g, host, self.weights(g, i)[part])
                        changed = True
                    elif i in written:
                        weights = self.weights(g, i)[part].to("cpu")
                        # The weights written back as they were (model.load_state_dict(model.state_dict())):
                        # the master keeps the bits below bf16's.
                        if not torch.equal(weights, store.master(g, host).to(torch.bfloat16)):
                            store.write_master(g, host, weights)
                            changed = True
            self.synced[g] = True
            self.note_versions(g)
        return changed

    def check_storage(self) -> None:
        """Params changed after construction (dtype, device, shape) would be trained wrongly: refuse."""
        for ps, layout in zip(self.params, self._layouts):
            for p, shape in zip(ps, layout.shapes if layout else []):
                if p.dtype != WEIGHTS_DTYPE or p.device != self.device or p.shape != shape:
                    raise RuntimeError(
                        f"cpu_adam.OffloadOptimizer: a parameter built as {tuple(shape)} bfloat16 on "
                        f"{self.device} is now {tuple(p.shape)} {p.dtype} on {p.device} (the model was converted "
                        "or moved after the optimizer was built, e.g. model.float() or model.cuda()). Move and convert "
                        "the model first (model.to(device, torch.bfloat16)), then build the optimizer"
                    )
                if not p.is_contiguous():
                    raise RuntimeError(
                        f"cpu_adam.OffloadOptimizer: the parameter of shape {tuple(shape)} is no longer contiguous; "
                        "keep the params' storage contiguous (the optimizer writes the updated weights into it)"
                    )

    def check_written(self) -> None:
        if any(p.numel() > 0 and bool(p.isnan().all()) for p in self.unwritten):
            raise RuntimeError(
                "cpu_adam.OffloadOptimizer: the model was built on the meta device and a param is still all NaN, "
                "as the optimizer filled it: load the weights (model.load_state_dict(state_dict)) or initialise "
                "them before the first step"
            )
        self.unwritten = []
