"""The offload optimizer's checkpoint format: what ``state_dict()`` holds, and loading it back, checked first.

Per param group: ``step`` and ``param_steps`` (each param's count: params that skipped steps keep
their own bias corrections), the params' ``shapes``, and once the group has stepped its
``master``, ``exp_avg``, ``exp_avg_sq`` (and the 8-bit moments' ``state_scales``) as flat tensors
in the layout of ``layout.py``. A single process saves the one-process layout (a full state dict);
with a process group each rank saves its shard, with a ``"zero"`` entry saying how it was cut.
A full state dict loads on any number of ranks, each taking its slice.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from .._precision import MOMENTS, SCALES, check_saved_moments, converted_moments
from .._validation import check_param_group, check_step_count, checked_seed
from ..quant8 import BLOCK
from .layout import FlatLayout, check_shard, from_legacy_layout, full_numel, full_to_shard
from .options import checked_max_grad_norm
from .rooms import Rooms

__all__ = ["LEGACY_FORMAT", "STATE_DICT_FORMAT", "Scalars", "load", "save"]

# Format 2 lays params out on 256-element boundaries (an 8-bit scale block); format 1 used 64.
STATE_DICT_FORMAT = "cpu_adam.OffloadOptimizer/2"
LEGACY_FORMAT = "cpu_adam.OffloadOptimizer/1"
_WHERE = "cpu_adam.OffloadOptimizer.load_state_dict"


class Scalars(NamedTuple):
    """The optimizer's own saved values."""

    seed: int
    skipped_steps: int
    max_grad_norm: float | None


def save(rooms: Rooms, param_groups: list[dict[str, Any]], scalars: Scalars) -> dict[str, Any]:
    state = {}
    if any(any(steps) for steps in rooms.store.steps):  # the masters of weights written since the last step
        rooms.model.sync_masters(rooms.store)
    for g, layout in enumerate(rooms.layouts):
        if layout is None:
            continue
        steps = rooms.store.steps[g]
        state[g] = {"step": max(steps), "param_steps": list(steps), "shapes": [tuple(s) for s in layout.shapes]}
        if any(steps):
            state[g].update(rooms.store.export(g))
    saved_groups, index = [], 0
    for options in param_groups:
        saved = {k: v for k, v in options.items() if k != "params"}
        saved["params"] = list(range(index, index + len(options["params"])))
        index += len(options["params"])
        saved_groups.append(saved)
    state_dict = {
        "format": STATE_DICT_FORMAT,
        "state": state,
        "param_groups": saved_groups,
        "seed": scalars.seed,
        "skipped_steps": scalars.skipped_steps,
        "max_grad_norm": scalars.max_grad_norm,
    }
    world = rooms.world
    if world.size > 1:
        state_dict["zero"] = {"rank": world.rank, "world_size": world.size, "bucket_size": rooms.options.bucket_size}
    return state_dict


def load(rooms: Rooms, param_groups: list[dict[str, Any]], state_dict: dict[str, Any]) -> Scalars:
    """Checks everything, then replaces the state, the groups' options and the device weights (from the
    loaded masters); returns the optimizer's loaded scalars."""
    legacy = state_dict.get("format") == LEGACY_FORMAT
    if state_dict.get("format") != STATE_DICT_FORMAT and not legacy:
        raise ValueError(f"{_WHERE}: not a {STATE_DICT_FORMAT} state dict (format {state_dict.get('format')!r})")
    if legacy and "zero" in state_dict:
        raise ValueError(
            f"{_WHERE}: this ZeRO shard was saved in format 1, whose pieces were cut on other boundaries; consolidate "
            "the shards with the cpu_adam version that saved them (cpu_adam.distributed.consolidate_state_dict) and "
            "load the full state dict"
        )
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(param_groups):
        raise ValueError(f"the state dict has {len(saved_groups)} param groups, this optimizer {len(param_groups)}")
    _check_groups(rooms.layouts, state_dict["state"])
    max_grad_norm = checked_max_grad_norm(state_dict["max_grad_norm"])
    _check_loadable(state_dict)
    zero = state_dict.get("zero")
    problem: ValueError | None = None
    try:
        if zero is not None:
            check_shard(zero, rooms.world.rank, rooms.world.size, rooms.options.bucket_size)
        loaded = [
            None
            if layout is None
            else _loaded_tensors(rooms.options.state_dtype, g, layout, state_dict["state"][g], zero is None, legacy)
            for g, layout in enumerate(rooms.layouts)
        ]
    except ValueError as error:
        problem = error
    # A rank that cannot load must not leave the others waiting in a collective.
    rooms.world.check_same(
        "whether the state dict loads",
        problem is None,
        "the ranks where it does not load raised the reason: fix the state dict they were given",
    )
    if problem is not None:
        raise problem
    rooms.world.check_same(
        "the kind of state dict loaded",
        zero is None,
        "every rank must load its own shard, or every rank the same full state dict",
    )
    rooms.link.wait_all()
    rooms.dev.synchronize()
    with torch.no_grad():
        for g, layout in enumerate(rooms.layouts):
            if layout is None:
                continue
            saved = state_dict["state"][g]
            steps = [int(x) for x in saved.get("param_steps", [saved["step"]] * len(layout.shapes))]
            rooms.store.load(g, loaded[g], steps)  # a group that had not stepped saves no moments, nor masters:
            if not loaded[g]:  # they stay (the weights, or a handed-over model's values)
                continue
            rooms.model.synced[g] = True
            rooms.link.weights_from(g, rooms.store.master(g, slice(None)))
            rooms.model.note_versions(g)
            rooms.dev.synchronize()  # before the slots receive grads again
    for options, saved in zip(param_groups, saved_groups):
        options.update({k: v for k, v in saved.items() if k != "params"})
    seed = rooms.world.rank0_int(int(state_dict["seed"]), "rank 0's seed")  # shards of 0.2 may hold one per rank
    return Scalars(seed, int(state_dict["skipped_steps"]), max_grad_norm)


def _check_groups(layouts: list[FlatLayout | None], state: dict[int, Any]) -> None:
    for g, layout in enumerate(layouts):
        saved = state.get(g)
        if (layout is None) != (saved is None) or (
            layout is not None and [tuple(s) for s in saved["shapes"]] != [tuple(s) for s in layout.shapes]
        ):
            raise ValueError(f"param group {g} of the state dict holds other parameters than this optimizer's")
        if saved is not None and saved["step"] != 0 and not all(k in saved for k in ("master", *MOMENTS)):
            raise ValueError(f"param group {g} of the state dict has taken steps but lacks its masters or moments")
        if saved is not None and len(saved.get("param_steps", layout.shapes)) != len(layout.shapes):
            raise ValueError(
                f"{_WHERE}: param group {g} holds {len(saved['param_steps'])} param_steps for "
                f"{len(layout.shapes)} params: the state dict was damaged or edited"
            )


def _check_loadable(state_dict: dict[str, Any]) -> None:
    for g, options in enumerate(state_dict["param_groups"]):
        check_param_group(f"{_WHERE}: param group {g}", options)
    for g, saved in state_dict["state"].items():
        for count in [saved["step"], *saved.get("param_steps", [])]:
            check_step_count(f"{_WHERE}: param group {g}", count)
    checked_seed(_WHERE, state_dict["seed"])
    check_step_count(f"{_WHERE}: skipped_steps", state_dict["skipped_steps"])


def _loaded_tensors(
    state_dtype: torch.dtype, g: int, layout: FlatLayout, saved: dict[str, Any], full: bool, legacy: bool
) -> dict[str, Tensor]:
    """This rank's masters and moments from a saved group, in the optimizer's precision.

    Checked before anything is loaded: the caller copies them in only once every group passed.
    """
    if "master" not in saved:
        return {}
    tensors = {name: saved[name] for name in ("master", *MOMENTS, SCALES) if name in saved}
    where = f"{_WHERE}: param group {g}"
    if (SCALES in tensors) != (tensors["exp_avg"].dtype == torch.uint8):
        raise ValueError(f"{where}: 8-bit (uint8) moments come with their state_scales, float moments without")
    numel = full_numel(layout.shapes, legacy=legacy) if full else layout.shard_numel
    for name, t in tensors.items():
        expected = (2, numel // BLOCK) if name == SCALES else (numel,)
        if tuple(t.shape) != expected:
            raise ValueError(
                f"{where}: {name} has shape {tuple(t.shape)} where this optimizer's params need {expected} "
                f"({'a full state dict' if full else 'a shard of this layout'})"
            )
    if legacy:
        tensors = {name: from_legacy_layout(t, layout.shapes) for name, t in tensors.items()}
    # The padding between params is not read: checked in the layout it is now in, whose padding is zeros.
    check_saved_moments(where, {k: v for k, v in tensors.items() if k != "master"}, (tensors["master"].numel(),))
    if not bool(torch.isfinite(tensors["master"]).all()):
        raise ValueError(f"{where}: master holds a non-finite value; the run it was saved from had diverged")
    moments = {name: t for name, t in tensors.items() if name != "master"}
    tensors = {"master": tensors["master"], **converted_moments(moments, state_dtype, torch.device("cpu"))}
    if full:
        tensors = {name: full_to_shard(t, layout, per=BLOCK if name == SCALES else 1) for name, t in tensors.items()}
    return tensors
