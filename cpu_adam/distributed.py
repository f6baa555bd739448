"""ZeRO data parallelism for the offload optimizer: shard checkpoints, resharding, threads.

``OffloadOptimizer(..., process_group=pg)`` gives each rank 1/N of every flat group (see
``offload/layout.py``); its ``state_dict()`` holds that shard plus a ``"zero"`` entry saying how it was
cut. ``consolidate_state_dict`` puts the N shards back into one full state dict, which is the
single-process format: it loads on one process, and on any number of ranks, each taking its
slice. Full state dicts store every param at its offset in the one-process layout, so they do
not depend on the world size or bucket size they were saved with.
"""

from __future__ import annotations

from typing import Any

import torch

from ._precision import MOMENTS, SCALES
from ._threads import cores_per_local_rank
from .offload.layout import FlatLayout, shards_to_full
from .offload.state_dict import STATE_DICT_FORMAT
from .quant8 import BLOCK

__all__ = ["consolidate_state_dict", "cores_per_local_rank"]

_STATE_TENSORS = ("master", *MOMENTS, SCALES)


def consolidate_state_dict(shard_state_dicts: list[dict[str, Any]]) -> dict[str, Any]:
    """One full (single-process) state dict from the ``state_dict()`` of every rank of a ZeRO run.

    Pass all N shards, in any order. The result loads on one process or on any number of ranks.
    """
    if not shard_state_dicts:
        raise ValueError("consolidate_state_dict: no shard state dicts given")
    zeros = [sd.get("zero") for sd in shard_state_dicts]
    if any(z is None for z in zeros):
        raise ValueError(
            "consolidate_state_dict: a state dict is not a ZeRO shard (no 'zero' entry): it is already a full state "
            "dict, load it directly"
        )
    formats = sorted({str(sd.get("format")) for sd in shard_state_dicts})
    if formats != [STATE_DICT_FORMAT]:
        raise ValueError(
            f"consolidate_state_dict: the shards are in format {', '.join(formats)}; this version consolidates "
            f"{STATE_DICT_FORMAT} (format 1 cut its pieces on other boundaries: consolidate those with the cpu_adam "
            "version that saved them)"
        )
    world_size = zeros[0]["world_size"]
    ranks = sorted(z["rank"] for z in zeros)
    if ranks != list(range(world_size)):
        raise ValueError(
            f"consolidate_state_dict: the shards were saved by a world of {world_size} ranks, but the ranks given are "
            f"{ranks}; pass exactly one state dict from every rank 0..{world_size - 1} of the same checkpoint"
        )
    by_rank = sorted(shard_state_dicts, key=lambda sd: sd["zero"]["rank"])
    first = by_rank[0]
    for sd in by_rank[1:]:
        for key in ("world_size", "bucket_size"):
            if sd["zero"][key] != first["zero"][key]:
                raise ValueError(f"consolidate_state_dict: the shards disagree on {key}: not from one checkpoint")
        if sd["state"].keys() != first["state"].keys() or any(
            (sd["state"][g]["step"], sd["state"][g].get("param_steps"))
            != (first["state"][g]["step"], first["state"][g].get("param_steps"))
            for g in first["state"]
        ):
            raise ValueError("consolidate_state_dict: the shards disagree on their groups or step counts")
    full = {k: v for k, v in first.items() if k not in ("zero", "state")}
    full["state"] = {}
    bucket_size = first["zero"]["bucket_size"]
    for g, saved in first["state"].items():
        shapes = [torch.Size(s) for s in saved["shapes"]]
        layouts = [FlatLayout(shapes, bucket_size, world_size=world_size, rank=r) for r in range(world_size)]
        group = {"step": saved["step"], "shapes": saved["shapes"]}
        if "param_steps" in saved:  # params that skipped steps keep their own bias corrections
            group["param_steps"] = list(saved["param_steps"])
        for name in (n for n in _STATE_TENSORS if n in saved):  # a group that had not stepped has no moments
            shards = [sd["state"][g][name] for sd in by_rank]
            group[name] = shards_to_full(shards, layouts, per=BLOCK if name == SCALES else 1)
        full["state"][g] = group
    return full
