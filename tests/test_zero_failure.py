"""ZeRO over 2 gloo ranks when one rank's backward raises half-way: every rank gets a clear error
within seconds, none aborts, and after ``zero_grad()`` training goes on as if the batch never came."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from offload_helpers import VOCAB, batches, make_model
from rank_spawn import run_ranks
from torch import Tensor, nn

from cpu_adam import OffloadOptimizer

pytestmark = pytest.mark.dist

HYPER = dict(lr=1e-3, weight_decay=0.01, bucket_size=1024, max_grad_norm=1.0)
FAILING_RANK = 1


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, fail: bool) -> Tensor:
        ctx.fail = fail
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if ctx.fail:
            raise RuntimeError("injected: this rank's backward failed")
        return grad, None


def _loss(model: nn.Module, tokens: Tensor, fail: bool) -> Tensor:
    # The failure sits below the block: the head's, the final norm's and the MLP's grads are
    # packed (and some buckets reduced) before it raises; the first norm's and the embedding's never are.
    x = model.emb(tokens[:, :-1])
    h = _RaiseInBackward.apply(model.ln1(x), fail)
    x = x + model.fc2(F.gelu(model.fc1(h)))
    logits = model.head(model.ln_f(x))
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _run(rank: int, data: list[Tensor], fail_at: int | None, skip: int | None, overlap: str) -> dict[str, Any]:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap=overlap, process_group=dist.group.WORLD)
    events, seconds = [], 0.0
    for n, tokens in enumerate(data):
        if n == skip:
            continue
        start = time.monotonic()
        try:
            _loss(model, tokens, fail=rank == FAILING_RANK and n == fail_at).backward()
            opt.step()
            events.append("stepped")
        except RuntimeError as error:
            events.append(str(error))
            opt.zero_grad()
            seconds = time.monotonic() - start
    snapshot = {
        "events": events,
        "seconds": seconds,
        "state": opt.state_dict(),
        "weights": [p.detach().clone() for p in model.parameters()],
    }
    opt.close()
    return snapshot


def _closed_after_failing(rank: int, data: list[Tensor]) -> str:
    """The failed rank closes its optimizer instead of calling zero_grad() (it gives up, or exits)."""
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, process_group=dist.group.WORLD)
    try:
        _loss(model, data[0], fail=rank == FAILING_RANK).backward()
        opt.step()
        return "stepped"
    except RuntimeError as error:
        if rank == FAILING_RANK:
            opt.close()  # the collectives it owed, so that the others are not left waiting
        else:
            opt.zero_grad()
        return str(error)


def _failure_rank(rank: int, world_size: int, out: Path) -> None:
    data = [tokens.chunk(world_size)[rank] for tokens in batches(5, seed=3)]
    results = {"closed": _closed_after_failing(rank, data)}
    for overlap in ("none", "backward"):
        for fail_at in (0, 2):  # the first backward (bucket order still being learned) and a later one
            results[overlap, fail_at] = {
                "failed": _run(rank, data, fail_at=fail_at, skip=None, overlap=overlap),
                "skipped": _run(rank, data, fail_at=None, skip=fail_at, overlap=overlap),
            }
    torch.save(results, out / f"rank{rank}.pt")


@pytest.fixture(scope="module")
def failure_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("failure")
    run_ranks(_failure_rank, out, world_size=2, timeout_s=120.0)  # a rank that aborts fails the run
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("fail_at", [0, 2])
def test_every_rank_raises_a_clear_error_and_training_goes_on_exactly(failure_run, overlap: str, fail_at: int):
    for rank, results in enumerate(failure_run):
        failed, skipped = results[overlap, fail_at]["failed"], results[overlap, fail_at]["skipped"]
        events = failed["events"]
        assert events[:fail_at] + events[fail_at + 1 :] == ["stepped"] * 4
        if rank == FAILING_RANK:
            assert events[fail_at] == "injected: this rank's backward failed"
        else:
            assert f"the backward of rank {FAILING_RANK} of 2 raised" in events[fail_at]
            assert "Call optimizer.zero_grad() on every rank" in events[fail_at]
        assert failed["seconds"] < 10.0
        for a, b in zip(failed["weights"], skipped["weights"]):
            assert torch.equal(a, b), "the failed batch left a trace"
        state, twin = failed["state"]["state"][0], skipped["state"]["state"][0]
        assert state["param_steps"] == twin["param_steps"]
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[name], twin[name])


def test_a_failed_rank_that_closes_its_optimizer_frees_the_others(failure_run):
    assert failure_run[FAILING_RANK]["closed"] == "injected: this rank's backward failed"
    other = failure_run[1 - FAILING_RANK]["closed"]
    assert f"the backward of rank {FAILING_RANK} of 2 raised" in other
