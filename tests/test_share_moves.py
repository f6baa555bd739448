"""A share that shrinks, grows or moves between steps changes nothing under overlap="backward", whatever is read
between the backward and ``step()``: every step's weights are the all-host run's, bit for bit.

Under overlap="backward" the state of the host's buckets is one step behind, and the backward previews each bucket
from the host store as its grads land: a bucket joining the device must take its state up only once its deferred
step is committed, and a bucket leaving it must have its state back in the host store before its first preview.
A share set before backward begins its window at once; one set after backward (as "auto" sets it) begins the next
window, after the step. The worker commits the deferred steps ahead during the forward when it has the time; the
tests that hold it back show a window that would otherwise rely on that time.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import raw
from offload_helpers import batches, lm_loss, make_model
from test_offload_digest import _device

from cpu_adam import OffloadOptimizer
from cpu_adam.offload.overlap import BackwardOverlap

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
    shares: list[float], device: str, read: str, overlap: str, *, share_after_backward: bool = False, **options: Any
) -> list[list[torch.Tensor]]:
    """Each step's weights, each share set before its step's backward (or after it: from the next window on)."""
    on = "cuda" if device == "cuda" else "cpu"
    model = make_model(0, on)
    with _device("cpu" if device == "cuda" else device):
        opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_size=1024, overlap=overlap, **options)
    seen = []
    for share, tokens in zip(shares, batches(len(shares), device=on)):
        if not share_after_backward:
            opt.device_fraction = share
        lm_loss(model, tokens).backward()
        if share_after_backward:
            opt.device_fraction = share
        READS[read](opt)
        opt.step()
        opt.zero_grad()
        seen.append([raw(p) for p in model.parameters()])
    opt.close()
    return seen


def _check_moving_share(
    precision: str, device: str, read: str, budget: int | None, *, share_after_backward: bool = False
) -> None:
    options = dict(PRECISIONS[precision], device_budget=budget, share_after_backward=share_after_backward)
    host = _weights_each_step([0.0] * len(SHARES), device, "nothing", "none", **PRECISIONS[precision])
    moving = _weights_each_step(SHARES, device, read, "backward", **options)
    wrong = [step for step, (a, b) in enumerate(zip(moving, host)) if not all(map(torch.equal, a, b))]
    when = "after" if share_after_backward else "before"
    assert not wrong, f"the weights of steps {wrong} differ from the all-host run's (shares {SHARES}, {when} backward)"


@pytest.fixture
def commits_ahead_held_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker commits no deferred step ahead of the landings, as when it is still busy at the next step (a
    short forward, a loaded host): only the landings and the settles in the caller's thread commit them. Left to
    run, it commits them all during the forward, and a window that misses its settle goes unseen."""
    monkeypatch.setattr(BackwardOverlap, "_commit_ahead", lambda overlap: False)


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


@pytest.mark.usefixtures("commits_ahead_held_back")
@pytest.mark.parametrize(("precision", "device"), [("fp32", "cpu"), ("bf16-sr master, 8-bit", "copying")])
def test_a_share_moving_before_backward_commits_the_deferred_steps_however_late_the_worker(precision: str, device: str):
    """A window whose share changed commits the deferred steps before a bucket joining the device takes its state
    up from the host store; left to the worker's commits ahead, the share took the state a step old from step 2
    on whenever the worker was late."""
    _check_moving_share(precision, device, "nothing", None)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Each precision once on each device path here, the rest among the slow tests.
AFTER_BACKWARD = [("fp32", "cpu"), ("8bit", "copying"), ("bf16 master", "cpu"), ("bf16-sr master, 8-bit", "copying")]
AFTER_BACKWARD_SLOW = [(p, d) for p in PRECISIONS for d in ("cpu", "copying") if (p, d) not in AFTER_BACKWARD]


@pytest.mark.usefixtures("commits_ahead_held_back")
@pytest.mark.parametrize(("precision", "device"), AFTER_BACKWARD)
def test_a_share_set_after_backward_gives_the_all_host_weights(precision: str, device: str):
    """A share set between backward and step() (as device_fraction="auto" sets it, after each step) begins the next
    window with the host store whole: the deferred steps committed, the state of buckets leaving the device copied
    back before the backward's previews read it. Begun without either, the weights were wrong from step 2 on in
    every precision; a share set before backward begins its window at once, by another path."""
    _check_moving_share(precision, device, "nothing", None, share_after_backward=True)


@pytest.mark.slow
@pytest.mark.usefixtures("commits_ahead_held_back")
@pytest.mark.parametrize(("precision", "device"), AFTER_BACKWARD_SLOW)
def test_every_precision_with_a_share_set_after_backward_gives_the_all_host_weights(precision: str, device: str):
    _check_moving_share(precision, device, "nothing", None, share_after_backward=True)


@CUDA
@pytest.mark.usefixtures("commits_ahead_held_back")
@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_on_cuda_a_share_set_after_backward_gives_the_all_host_weights(precision: str):
    _check_moving_share(precision, "cuda", "nothing", None, share_after_backward=True)


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
