"""Pins the offload optimizer's results bit for bit: fixed scenarios whose every output is hashed.

The expected digests were recorded from the code before the offload core was rebuilt as a
package of rooms (0.3.0, e13737c); a restructure must leave every bit as it was. Each scenario
trains a small LM with a side layer that is used in some micro-batches only, over steps with
1 to 3 micro-batches, one step whose grads are infinite (skipped), clipping that bites, and an
lr changed between steps. The digest covers the device weights after every step, the norms,
the skipped-step count and every tensor of the final state dict: masters, moments, 8-bit codes
and scales, step counts.

A digest that changes on purpose (new numerics) is re-recorded with
``python tests/test_offload_digest.py`` and the reason goes in the commit message.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import raw
from offload_helpers import CopyingCPU, batches, lm_loss, make_model
from rank_spawn import run_ranks
from torch import nn

from cpu_adam import OffloadOptimizer

BUCKET = 1024
HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, bucket_size=BUCKET)
# Micro-batches per step, and in which of them the side layer is used.
SCHEDULE = [(1, {0}), (2, {1}), (3, set()), (1, {0}), (2, {0}), (1, set())]
SKIPPED = 3  # the step whose loss is multiplied by inf

CONFIGS: dict[str, dict[str, Any]] = {
    "fp32-clip": dict(max_grad_norm=0.05),
    "bf16-states-clip_grad_norm_": dict(state_precision="bf16", clip=0.05),
    "8bit": dict(state_precision="8bit", max_grad_norm=0.5),
    "bf16-sr-8bit-clip_grad_norm_": dict(
        state_precision="8bit", master_weights_dtype=torch.bfloat16, stochastic_rounding=True, seed=7, clip=0.05
    ),
}
DEVICES = ("cpu", "copying")
OVERLAPS = ("none", "backward")  # stepping during backward must be invisible
ZERO_CONFIGS = ("fp32-clip", "bf16-sr-8bit-clip_grad_norm_")

EXPECTED: dict[str, str] = {
    "fp32-clip/cpu": "94370b57b234209d68b080d12971a4d42a025245aed2b4124e7aab0869620b22",
    "fp32-clip/copying": "94370b57b234209d68b080d12971a4d42a025245aed2b4124e7aab0869620b22",
    "bf16-states-clip_grad_norm_/cpu": "aea8b260924af3adb8d1d06c5a66e66b78c455c90d924af344ea9aeb8f5c2d73",
    "bf16-states-clip_grad_norm_/copying": "aea8b260924af3adb8d1d06c5a66e66b78c455c90d924af344ea9aeb8f5c2d73",
    "8bit/cpu": "09ef81122784df052ce7afe09ad89bd21f03171bd12fd63e531c4f9a1f7a4fd7",
    "8bit/copying": "09ef81122784df052ce7afe09ad89bd21f03171bd12fd63e531c4f9a1f7a4fd7",
    "bf16-sr-8bit-clip_grad_norm_/cpu": "7519be403e5d7f31cfcc14f149b3a573dbab1c534a271080438ddf593f4298c3",
    "bf16-sr-8bit-clip_grad_norm_/copying": "7519be403e5d7f31cfcc14f149b3a573dbab1c534a271080438ddf593f4298c3",
}
EXPECTED_ZERO: dict[str, str] = {
    "fp32-clip/cpu/rank0": "8e406978ce4e2a553aa631ebb9734a6b8dad56e58abebede2628d9edeadde361",
    "fp32-clip/copying/rank0": "8e406978ce4e2a553aa631ebb9734a6b8dad56e58abebede2628d9edeadde361",
    "bf16-sr-8bit-clip_grad_norm_/cpu/rank0": "b90c026c99ad7b3d0e6d9d7e968bd8cd426342dd1be9039ba98219492795313e",
    "bf16-sr-8bit-clip_grad_norm_/copying/rank0": "b90c026c99ad7b3d0e6d9d7e968bd8cd426342dd1be9039ba98219492795313e",
    "fp32-clip/cpu/rank1": "f6c607aa40bfb40efdcaada93da4ff935a43e435ee76abf4986adfe1c78aa629",
    "fp32-clip/copying/rank1": "f6c607aa40bfb40efdcaada93da4ff935a43e435ee76abf4986adfe1c78aa629",
    "bf16-sr-8bit-clip_grad_norm_/cpu/rank1": "85d2513dab5df5b45d0625e6b32debe846a04354ccecbd5b87ce97182910f70d",
    "bf16-sr-8bit-clip_grad_norm_/copying/rank1": "85d2513dab5df5b45d0625e6b32debe846a04354ccecbd5b87ce97182910f70d",
}


class WithSide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lm = make_model(0)
        torch.manual_seed(5)
        self.side = nn.Linear(32, 32).to(torch.bfloat16)


def _loss(model: WithSide, tokens: torch.Tensor, use_side: bool) -> torch.Tensor:
    loss = lm_loss(model.lm, tokens)
    if use_side:
        loss = loss + model.side(model.lm.emb(tokens)).float().square().mean()
    return loss


@contextlib.contextmanager
def _device(kind: str) -> Iterator[None]:
    """ "copying": the GPU code path (staging areas, copies down, uploads) with the CPU as the device."""
    from cpu_adam import offload

    if kind == "cpu":
        yield
        return
    original = offload.rooms.DeviceOps
    offload.rooms.DeviceOps = CopyingCPU
    try:
        yield
    finally:
        offload.rooms.DeviceOps = original


def _digest_of(items: list[tuple[str, Any]]) -> str:
    h = hashlib.sha256()
    for name, value in items:
        h.update(name.encode())
        if isinstance(value, torch.Tensor):
            h.update(raw(value.cpu()).numpy().tobytes())
        else:
            h.update(repr(value).encode())
    return h.hexdigest()


def _state_items(state_dict: dict[str, Any]) -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = [("skipped", state_dict["skipped_steps"]), ("seed", state_dict["seed"])]
    for g, saved in sorted(state_dict["state"].items()):
        for key in sorted(saved):
            items.append((f"{g}.{key}", saved[key]))
    items += [
        (f"group{g}", sorted((k, repr(v)) for k, v in o.items())) for g, o in enumerate(state_dict["param_groups"])
    ]
    return items


def run_scenario(
    name: str,
    device: str,
    *,
    overlap: str = "none",
    process_group: Any = None,
    rank: int = 0,
    world_size: int = 1,
    share: Callable[[int], float] | None = None,
    **extra: Any,
) -> str:
    """The digest of a scenario; ``share(step)``: the device's share of the elements from that step on; ``extra``:
    more of the optimizer's options."""
    options = dict(CONFIGS[name], overlap=overlap, **extra)
    clip = options.pop("clip", None)
    model = WithSide()
    with _device(device):
        opt = OffloadOptimizer(model.parameters(), **HYPER, process_group=process_group, **options)
    data = batches(sum(m for m, _ in SCHEDULE), batch=4 * world_size)
    items: list[tuple[str, Any]] = []
    n = 0
    for step, (micro, side_in) in enumerate(SCHEDULE):
        if share is not None:
            opt.device_fraction = share(step)
        for m in range(micro):
            tokens = data[n].chunk(world_size)[rank]
            n += 1
            loss = _loss(model, tokens, m in side_in)
            if step == SKIPPED:
                loss = loss * float("inf")
            loss.backward()
        if clip is not None:
            items.append((f"clip{step}", float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))))
        opt.step()
        opt.zero_grad()
        opt.param_groups[0]["lr"] *= 0.9  # a scheduler between steps
        items.append((f"norm{step}", opt.last_grad_norm))
        items += [(f"w{step}.{i}", p) for i, p in enumerate(model.parameters())]
    if process_group is None:
        items += [(f"master{i}", m) for i, m in enumerate(opt.master_weights())]
    items += _state_items(opt.state_dict())
    opt.close()
    return _digest_of(items)


@pytest.mark.parametrize("overlap", OVERLAPS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_results_are_bitwise_those_recorded(name: str, device: str, overlap: str):
    assert run_scenario(name, device, overlap=overlap) == EXPECTED[f"{name}/{device}"]


def _zero_rank(rank: int, world_size: int, out: Path) -> None:
    digests = {
        f"{name}/{device}/{overlap}": run_scenario(
            name, device, overlap=overlap, process_group=dist.group.WORLD, rank=rank, world_size=world_size
        )
        for name in ZERO_CONFIGS
        for device in DEVICES
        for overlap in OVERLAPS
    }
    torch.save(digests, out / f"digests{rank}.pt")


def zero_digests(tmp_path: Path) -> dict[str, str]:
    run_ranks(_zero_rank, tmp_path, timeout_s=120.0)
    ranks = [torch.load(tmp_path / f"digests{r}.pt") for r in range(2)]
    return {f"{key}/rank{r}": digests[key] for r, digests in enumerate(ranks) for key in digests}


@pytest.mark.dist
def test_zero_results_are_bitwise_those_recorded(tmp_path: Path):
    for key, digest in zero_digests(tmp_path).items():
        name, device, _, rank = key.split("/")
        assert digest == EXPECTED_ZERO[f"{name}/{device}/{rank}"], key


if __name__ == "__main__":  # prints the digests of the code as it is, to record them above
    import tempfile

    torch.set_num_threads(2)
    print({f"{n}/{d}": run_scenario(n, d) for n in CONFIGS for d in DEVICES})
    with tempfile.TemporaryDirectory() as tmp:
        print({k: v for k, v in zero_digests(Path(tmp)).items() if "/none/" in k})
    sys.exit(0)
