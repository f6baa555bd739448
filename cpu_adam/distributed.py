"""ZeRO data parallelism for the offload optimizer: shard checkpoints, resharding, threads.

``OffloadOptimizer(..., process_group=pg)`` gives each rank 1/N of every flat group (see
``_flat.py``); its ``state_dict()`` holds that shard plus a ``"zero"`` entry saying how it was
cut. ``consolidate_state_dict`` puts the N shards back into one full state dict, which is the
single-process format: it loads on one process, and on any number of ranks, each taking its
slice. Full state dicts store every param at its offset in the one-process layout, so they do
not depend on the world size or bucket size they were saved with.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from ._flat import FlatLayout
from ._threads import cores_per_local_rank, warn_if_single_threaded

__all__ = ["check_threads", "consolidate_state_dict", "cores_per_local_rank"]

logger = logging.getLogger(__name__)

_STATE_TENSORS = ("master", "exp_avg", "exp_avg_sq")
_RESHARD_FIX = (
    "load each rank's own shard on the same number of ranks with the same bucket_size, or consolidate the "
    "shards with cpu_adam.distributed.consolidate_state_dict(...) and load the full state dict, which any "
    "number of ranks can load"
)


def _canonical(shapes: list[torch.Size]) -> FlatLayout:
    # Offsets of the one-process layout do not depend on the bucket size: one bucket will do.
    return FlatLayout(shapes, 1 << 62)


def full_to_shard(full: Tensor, layout: FlatLayout) -> Tensor:
    """This rank's shard (its pieces back to back) of a tensor in the one-process layout."""
    canonical = _canonical(layout.shapes)
    if full.numel() != canonical.numel:
        raise ValueError(f"a full state tensor has {full.numel()} elements, the layout needs {canonical.numel}")
    if layout.world_size == 1 and layout.offsets == canonical.offsets and layout.numel == canonical.numel:
        return full
    flat = full.new_zeros(layout.numel)
    for i in range(len(layout.shapes)):
        lo, hi = layout.param_range(i)
        c_lo, c_hi = canonical.param_range(i)
        flat[lo:hi] = full[c_lo:c_hi]
    return torch.cat([flat[p.flat : p.flat + p.numel] for p in layout.pieces])


def shards_to_full(shards: list[Tensor], layouts: list[FlatLayout]) -> Tensor:
    """Inverse of ``full_to_shard``: the ranks' shards, in rank order, as one tensor in the one-process layout."""
    zero_layout = layouts[0]
    flat = shards[0].new_zeros(zero_layout.numel)
    for shard, layout in zip(shards, layouts):
        for p in layout.pieces:
            flat[p.flat : p.flat + p.numel] = shard[p.host : p.host + p.numel]
    canonical = _canonical(zero_layout.shapes)
    full = shards[0].new_zeros(canonical.numel)
    for i in range(len(zero_layout.shapes)):
        lo, hi = zero_layout.param_range(i)
        c_lo, c_hi = canonical.param_range(i)
        full[c_lo:c_hi] = flat[lo:hi]
    return full


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
            sd["state"][g]["step"] != first["state"][g]["step"] for g in first["state"]
        ):
            raise ValueError("consolidate_state_dict: the shards disagree on their groups or step counts")
    full = {k: v for k, v in first.items() if k not in ("zero", "state")}
    full["state"] = {}
    bucket_size = first["zero"]["bucket_size"]
    for g, saved in first["state"].items():
        shapes = [torch.Size(s) for s in saved["shapes"]]
        layouts = [FlatLayout(shapes, bucket_size, world_size=world_size, rank=r) for r in range(world_size)]
        group = {"step": saved["step"], "shapes": saved["shapes"]}
        for name in _STATE_TENSORS:
            group[name] = shards_to_full([sd["state"][g][name] for sd in by_rank], layouts)
        full["state"][g] = group
    return full


def check_shard(zero: dict[str, Any], rank: int, world_size: int, bucket_size: int) -> None:
    """Raises a ValueError naming the mismatch when a shard was not saved by this rank's place in this layout."""
    saved = (zero["rank"], zero["world_size"], zero["bucket_size"])
    if saved != (rank, world_size, bucket_size):
        raise ValueError(
            f"cpu_adam.OffloadOptimizer.load_state_dict: the state dict is the shard of rank {zero['rank']} of "
            f"{zero['world_size']} (bucket_size {zero['bucket_size']}), but this optimizer is rank {rank} of "
            f"{world_size} (bucket_size {bucket_size}); {_RESHARD_FIX}"
        )


def check_threads(rank: int, world_size: int) -> int:
    """Logs how many threads this rank's CPU step uses; warns when torchrun's one thread wastes cores.

    The ranks on a node share its cores (``LOCAL_WORLD_SIZE``, set by torchrun; without it every
    rank is assumed to be on this node). Returns this rank's share of the cores.
    """
    share = cores_per_local_rank(default_local_ranks=world_size)
    logger.info(
        "cpu_adam.OffloadOptimizer: rank %d of %d steps on %d CPU threads (its share of the cores: %d)",
        rank,
        world_size,
        torch.get_num_threads(),
        share,
    )
    warn_if_single_threaded(share)
    return share
