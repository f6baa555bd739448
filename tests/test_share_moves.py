"""A share that shrinks, grows or moves between steps changes nothing under overlap="backward", whatever is read
between the backward and ``step()``: every step's weights are the all-host run's, bit for bit.

Under overlap="backward" the state of the host's buckets is one step behind, and the backward previews each bucket
from the host store as its grads land: a bucket joining the device must take its state up only once its deferred
step is committed, and a bucket leaving it must have its state back in the host store before its first preview.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import raw
from offload_helpers import batches, lm_loss, make_model
from test_offload_digest import _device

from cpu_adam import OffloadOptimizer

pytest.importorskip("triton", reason="the device kernel is written in Triton")

# Each step's share: it shrinks to nothing, grows back, moves to a part, to another, and back to everything.
SHARES = [1.0, 0.0, 1.0, 0.5, 0.0, 0.3, 1.0]
PRECISIONS = {
    "fp32": {},
    "8bit": {"state_precision": "8bit"},
    "bf16 master": {"master_weights_dtype": torch.bfloat16},
    "bf16-sr master, 8-bit": {
        "state_precision": "8bit",
        "master_weights_dtype": torch.bfloat16,
        "stochastic_rounding": True,
        "seed": 3,
    },
}
READS = {
    "nothing": lambda opt: None,
    "master_weights": lambda opt: opt.master_weights(),
    "state_dict": lambda opt: opt.state_dict(),
}


def _weights_each_step(
    shares: list[float], device: str, read: str, overlap: str, **options: Any
) -> list[list[torch.Tensor]]:
    on = "cuda" if device == "cuda" else "cpu"
    model = make_model(0, on)
    with _device("cpu" if device == "cuda" else device):
        opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_size=1024, overlap=overlap, **options)
    seen = []
    for share, tokens in zip(shares, batches(len(shares), device=on)):
        opt.device_fraction = share
        lm_loss(model, tokens).backward()
        READS[read](opt)
        opt.step()
        opt.zero_grad()
        seen.append([raw(p) for p in model.parameters()])
    opt.close()
    return seen


def _check_moving_share(precision: str, device: str, read: str, budget: int | None) -> None:
    options = dict(PRECISIONS[precision], device_budget=budget)
    host = _weights_each_step([0.0] * len(SHARES), device, "nothing", "none", **PRECISIONS[precision])
    moving = _weights_each_step(SHARES, device, read, "backward", **options)
    wrong = [step for step, (a, b) in enumerate(zip(moving, host)) if not all(map(torch.equal, a, b))]
    assert not wrong, f"the weights of steps {wrong} differ from the all-host run's (shares {SHARES})"


@pytest.mark.parametrize(
    ("precision", "device", "read", "budget"),
    [
        ("fp32", "cpu", "nothing", None),
        ("8bit", "copying", "nothing", 0),
        ("bf16 master", "copying", "master_weights", None),
        ("bf16-sr master, 8-bit", "cpu", "state_dict", 20000),
    ],
)
def test_a_share_moving_between_steps_under_overlap_gives_the_all_host_weights_every_step(
    precision: str, device: str, read: str, budget: int | None
):
    _check_moving_share(precision, device, read, budget)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 0], ids=["resident", "streamed"])
@pytest.mark.parametrize("read", list(READS))
@pytest.mark.parametrize("device", ["cpu", "copying"])
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_every_precision_device_and_read_with_a_moving_share_gives_the_all_host_weights(
    precision: str, device: str, read: str, budget: int | None
):
    _check_moving_share(precision, device, read, budget)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [None, 0], ids=["resident", "streamed"])
@pytest.mark.parametrize(("precision", "read"), zip(PRECISIONS, ["nothing", "master_weights", "state_dict", "nothing"]))
def test_on_cuda_a_moving_share_under_overlap_gives_the_all_host_weights(precision: str, read: str, budget: int | None):
    _check_moving_share(precision, "cuda", read, budget)
