"""overlap="backward": the step previewed while backward runs is invisible, whatever happens before step().

Every test trains a twin with overlap="none" on the same inputs and compares every bit the user
can see: weights after each step, the state dict, the norms. A cause of mis-speculation must drop
the previews (the step then runs serially), and a plain step must take them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import raw
from offload_helpers import CopyingCPU, FailingBackward, batches, lm_loss, loss_failing_midway, make_model
from rank_spawn import run_ranks

from cpu_adam import OffloadOptimizer, offload

HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, bucket_size=1024)
STEPS = 5
REMADE: dict[str, int] = {}
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"))

Event = Callable[[torch.nn.Module, OffloadOptimizer, int], None]  # what happens between backward and step()


def _patch_run(monkeypatch: pytest.MonkeyPatch, run: Callable) -> None:
    """``run`` runs every kernel call of the overlap: the landings', the commits ahead and those at settle."""
    monkeypatch.setattr(offload.overlap, "run", run)
    monkeypatch.setattr(offload.deferred, "run", run)


def _train(overlap: str, before_step: Event | None = None, micro: int = 1, **options: Any) -> tuple[list, list[bool]]:
    """What the user can see of a short training run, and per step whether it was deferred (``last_step_overlapped``).

    ``REMADE`` gets how many steps' previews were made again at ``step()``.
    """
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap=overlap, **options)
    seen, held = [], []
    data = batches(STEPS * micro)
    for step in range(STEPS):
        for tokens in data[step * micro : (step + 1) * micro]:
            lm_loss(model, tokens).backward()
        if before_step is not None:
            before_step(model, opt, step)
        opt.step()
        opt.zero_grad()
        held.append(opt.last_step_overlapped)
        seen += [raw(p) for p in model.parameters()] + [opt.last_grad_norm]
    REMADE[overlap] = getattr(opt._rooms.overlap, "remade", 0)
    state = opt.state_dict()
    seen += [raw(t) if isinstance(t, torch.Tensor) else t for g in state["state"].values() for t in g.values()]
    opt.close()
    return seen, held


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("device", ["cpu", "copying"])
@pytest.mark.parametrize(
    "options", [{}, {"state_precision": "8bit"}, {"master_weights_dtype": torch.bfloat16, "stochastic_rounding": True}]
)
def test_plain_steps_take_the_previews_and_equal_the_serial_step(
    monkeypatch: pytest.MonkeyPatch, device: str, options: dict
):
    if device == "copying":
        monkeypatch.setattr(offload.rooms, "DeviceOps", CopyingCPU)
    serial, _ = _train("none", **options)
    overlapped, held = _train("backward", **options)
    assert _same(overlapped, serial)
    assert all(held), "every step is deferred"
    assert REMADE["backward"] == 1, "the first step's previews read masters not yet taken from the weights"


def _lr_changed(model, opt, step) -> None:
    opt.param_groups[0]["lr"] *= 0.5


def _weights_written(model, opt, step) -> None:
    with torch.no_grad():
        model.fc1.weight.mul_(0.5)


def _clipped_by_hand(model, opt, step) -> None:
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)


def _reloaded(model, opt, step) -> None:
    opt.load_state_dict(opt.state_dict())


def _non_finite(model, opt, step) -> None:
    if step == 2:
        for p in model.parameters():
            p.grad.mul_(float("inf"))


def test_weights_written_before_step_make_the_previews_again_and_equal_the_serial_step():
    serial, _ = _train("none", _weights_written)
    overlapped, held = _train("backward", _weights_written)
    assert _same(overlapped, serial)
    assert all(held), "the grads were those the previews read: every step is deferred all the same"
    assert REMADE["backward"] == STEPS, "every step made its previews again"


@pytest.mark.parametrize("event", [_lr_changed, _clipped_by_hand], ids=["lr changed", "clip_grad_norm_"])
def test_numbers_that_change_after_backward_stop_the_previews_and_the_steps_run_as_serial_ones(event):
    # The first step's previews are made again with the step's numbers; the backward after a step whose numbers
    # were not the previews' previews nothing, and its step runs as "none" runs it, in one pass.
    serial, _ = _train("none", event)
    overlapped, held = _train("backward", event)
    assert _same(overlapped, serial)
    assert held == [True] + [False] * (STEPS - 1) and REMADE["backward"] == 1


def test_a_backward_whose_grads_already_clip_previews_nothing_and_its_step_runs_as_a_serial_one(
    monkeypatch: pytest.MonkeyPatch,
):
    previews = []
    real = offload.overlap.run

    def counting(calls, *, preview: bool = False) -> None:
        previews.extend(call for call in calls if preview or call.get("then") is not None)
        real(calls, preview=preview)

    _patch_run(monkeypatch, counting)
    serial, _ = _train("none", max_grad_norm=1e-4)  # every bucket's grads alone are past it
    overlapped, held = _train("backward", max_grad_norm=1e-4)
    assert _same(overlapped, serial)
    assert not any(held) and REMADE["backward"] == 0
    assert not previews, "a preview was made in a window whose grads already clipped"


@pytest.mark.parametrize(
    ("event", "micro"),
    [(None, 2), (_reloaded, 1), (_non_finite, 1)],  # accumulation: the second micro-batch lands on every bucket again
    ids=["accumulation", "load_state_dict", "non-finite"],
)
def test_other_grads_than_the_previews_read_drop_them_and_equal_the_serial_step(event, micro: int):
    serial, _ = _train("none", event, micro)
    overlapped, held = _train("backward", event, micro)
    assert _same(overlapped, serial)
    if event is _non_finite:
        assert not held[2] and held[3:] == [True] * (STEPS - 3)
    else:
        assert not any(held[1:])


def test_clip_grad_norm_that_does_not_clip_keeps_the_previews():
    def unclipped(model, opt, step) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)

    serial, _ = _train("none", unclipped)
    overlapped, held = _train("backward", unclipped)
    assert _same(overlapped, serial) and all(held[1:])


def test_grads_whose_norm_stays_below_max_grad_norm_keep_the_previews():
    # Their norm (6.4-6.7 in these steps) lies between the limit's root and the limit: their squares' sum passes the
    # limit as the buckets land, their norm never does, so no bucket may stop previewing.
    limit = 10.0
    serial, _ = _train("none", max_grad_norm=limit)
    norms = [x for x in serial if isinstance(x, float)]
    assert all(limit**0.5 < norm < limit for norm in norms), norms
    overlapped, held = _train("backward", max_grad_norm=limit)
    assert _same(overlapped, serial) and all(held)


def test_a_state_dict_between_steps_waits_for_the_commits(monkeypatch: pytest.MonkeyPatch):
    # No commits ahead: the last step's commits are left for state_dict() and master_weights() to run.
    monkeypatch.setattr(offload.overlap.BackwardOverlap, "_commit_ahead", lambda self: False)
    dicts = {}
    for overlap in ("none", "backward"):
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, overlap=overlap)
        for tokens in batches(3):
            lm_loss(model, tokens).backward()
            opt.step()
        dicts[overlap] = [raw(t) for t in opt.state_dict()["state"][0].values() if isinstance(t, torch.Tensor)]
        dicts[overlap] += [raw(m) for m in opt.master_weights()]
        opt.close()
    assert _same(dicts["backward"], dicts["none"])


@pytest.mark.parametrize("worker", ["prompt", "slow"])
def test_a_failed_backward_then_zero_grad_equals_the_serial_step(monkeypatch: pytest.MonkeyPatch, worker: str):
    # "slow": the worker's jobs run late, after the next backward has landed the same buckets again,
    # which must not commit a deferred step twice.
    if worker == "slow":
        real = offload.overlap.run

        def late(calls, *, preview: bool = False) -> None:
            if threading.current_thread() is not threading.main_thread():
                time.sleep(0.05)
            real(calls, preview=preview)

        _patch_run(monkeypatch, late)

    def run(overlap: str) -> list:
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, overlap=overlap)
        data = batches(4)
        for step, tokens in enumerate(data):
            if step == 1:
                FailingBackward.fail = lambda grad: (_ for _ in ()).throw(RuntimeError("simulated"))
                with pytest.raises(RuntimeError, match="simulated"):
                    loss_failing_midway(model, tokens).backward()
                FailingBackward.fail = None
                opt.zero_grad()
            lm_loss(model, tokens).backward()
            opt.step()
        out = [raw(p) for p in model.parameters()]
        opt.close()
        return out

    assert _same(run("backward"), run("none"))


def test_a_preview_that_raises_in_the_worker_is_made_again_at_step(monkeypatch: pytest.MonkeyPatch):
    real = offload.overlap.run

    def failing_in_the_worker(calls, *, preview: bool = False) -> None:
        if preview and threading.current_thread() is not threading.main_thread():
            raise RuntimeError("simulated kernel failure")
        real(calls, preview=preview)

    monkeypatch.setattr(offload.overlap, "_fused", lambda commit, preview: None)  # the preview runs alone
    serial, _ = _train("none")
    _patch_run(monkeypatch, failing_in_the_worker)
    overlapped, held = _train("backward")
    assert _same(overlapped, serial) and all(held[1:])


def test_a_kernel_error_surfaces_at_step_with_nothing_changed(monkeypatch: pytest.MonkeyPatch):
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap="backward")
    for tokens in batches(2):
        lm_loss(model, tokens).backward()
        opt.step()
    real = offload.overlap.run

    def failing(calls, *, preview: bool = False) -> None:
        raise RuntimeError("simulated kernel failure")

    _patch_run(monkeypatch, failing)
    lm_loss(model, batches(3)[2]).backward()
    weights = [raw(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        opt.step()
    assert all(torch.equal(raw(p), w) for p, w in zip(model.parameters(), weights))
    _patch_run(monkeypatch, real)
    opt.zero_grad()
    state = opt.state_dict()  # the deferred step that failed is committed now
    assert state["state"][0]["step"] == 2
    opt.close()


def _fail_worker_calls(
    monkeypatch: pytest.MonkeyPatch, which: Callable[[dict], bool], after: int = 0, late: float = 0.0
) -> list[int]:
    """Worker-thread kernel calls matching ``which`` raise, from the ``after``-th on, ``late`` seconds after they
    start; returns the count of those seen."""
    real, seen = offload.overlap.run, [0]

    def failing(calls, *, preview: bool = False) -> None:
        if threading.current_thread() is not threading.main_thread() and calls and which(calls[0]):
            seen[0] += 1
            if seen[0] > after:
                time.sleep(late)
                raise RuntimeError("simulated kernel failure")
        real(calls, preview=preview)

    _patch_run(monkeypatch, failing)
    return seen


def _serial_skipping(step: int, steps: int, device: str = "cpu") -> list:
    """The weights and state of a serial run that never saw batch ``step``."""
    model = make_model(0, device)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap="none")
    for i, tokens in enumerate(batches(steps, device=device)):
        if i != step:
            lm_loss(model, tokens).backward()
            opt.step()
    state = opt.state_dict()["state"][0]
    out = [raw(p) for p in model.parameters()] + [raw(state[k]) for k in ("master", "exp_avg", "exp_avg_sq")]
    opt.close()
    return out


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_commit_that_raises_after_other_buckets_went_up_puts_their_weights_back(
    monkeypatch: pytest.MonkeyPatch, device: str
):
    # The commits run with the landings (none ahead), and the last bucket to land fails its: by then
    # every other bucket's weights went up, and must come back.
    monkeypatch.setattr(offload.overlap.BackwardOverlap, "_commit_ahead", lambda self: False)
    model = make_model(0, device)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap="backward")
    data = batches(5, device=device)
    for tokens in data[:2]:
        lm_loss(model, tokens).backward()
        opt.step()
    landing = len(opt._rooms.overlap._order)
    assert landing > 2
    # Late: step() has uploaded the other buckets when it fails.
    fused = _fail_worker_calls(monkeypatch, lambda call: call.get("then") is not None, after=landing - 1, late=0.3)
    uploads = []
    real_up = opt._rooms.link.up
    monkeypatch.setattr(opt._rooms.link, "up", lambda *a: (uploads.append(a[:2]), real_up(*a))[1])
    lm_loss(model, data[2]).backward()
    weights = [raw(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        opt.step()
    assert fused[0] == landing and len(uploads) >= 2 * (landing - 1), "the other buckets went up, then back"
    assert all(torch.equal(raw(p), w) for p, w in zip(model.parameters(), weights))
    _patch_run(monkeypatch, offload.stepper.run)
    opt.zero_grad()
    for tokens in data[3:]:
        lm_loss(model, tokens).backward()
        opt.step()
    state = opt.state_dict()["state"][0]
    seen = [raw(p) for p in model.parameters()] + [raw(state[k]) for k in ("master", "exp_avg", "exp_avg_sq")]
    opt.close()
    assert _same(seen, _serial_skipping(2, 5, device))


def test_the_worker_commits_ahead_between_steps_and_a_failure_there_surfaces_at_the_next_step(
    monkeypatch: pytest.MonkeyPatch,
):
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap="backward")
    overlap = opt._rooms.overlap
    data = batches(5)
    for tokens in data[:2]:
        lm_loss(model, tokens).backward()
        opt.step()
    deadline = time.monotonic() + 10
    while overlap._deferred and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not overlap._deferred, "the worker committed the deferred step with nothing else to do"
    commit_alone = _fail_worker_calls(monkeypatch, lambda call: call["bf16_outs"] is None)
    lm_loss(model, data[2]).backward()
    opt.step()  # its previews held: its state is deferred, and the worker fails to commit it ahead
    while commit_alone[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert commit_alone[0] == 1
    lm_loss(model, data[3]).backward()
    weights = [raw(p) for p in model.parameters()]
    with pytest.raises(RuntimeError, match="simulated kernel failure"):
        opt.step()
    assert all(torch.equal(raw(p), w) for p, w in zip(model.parameters(), weights))
    _patch_run(monkeypatch, offload.stepper.run)
    opt.zero_grad()
    lm_loss(model, data[4]).backward()
    opt.step()
    state = opt.state_dict()["state"][0]
    seen = [raw(p) for p in model.parameters()] + [raw(state[k]) for k in ("master", "exp_avg", "exp_avg_sq")]
    opt.close()
    assert _same(seen, _serial_skipping(3, 5))


def test_the_worker_leaves_the_model_thread_a_core():
    threads = torch.get_num_threads()
    opt = OffloadOptimizer(make_model(0).parameters(), **HYPER, overlap="backward")
    worker = opt._rooms.overlap._worker
    seen = []
    worker.wait(worker.submit(lambda: seen.append(torch.get_num_threads())))
    opt.close()
    assert torch.get_num_threads() == threads
    assert seen == [max(1, threads - 1)]


def test_close_with_commits_in_flight_and_the_bytes_it_costs():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap="backward")
    stats = opt.memory_stats()
    assert stats["overlap_bytes"] == 2 * stats["shard_elements"]
    assert stats["host_bytes"] == sum(
        stats[k] for k in ("master_bytes", "state_bytes", "pinned_bytes", "overlap_bytes")
    )
    for tokens in batches(2):
        lm_loss(model, tokens).backward()
        opt.step()
    opt.close()  # the last step's commits were still queued
    assert opt.last_step_overlapped


def test_an_unknown_overlap_is_refused_by_name():
    with pytest.raises(ValueError, match="overlap must be one of"):
        OffloadOptimizer(make_model(0).parameters(), overlap="forward")


def test_a_bucket_missing_from_a_backward_commits_its_deferred_step_at_the_next_step():
    # The MLP gets no grad on odd steps: its deferred step is committed by step() instead of by a
    # landing, and its own steps are previewed again when it comes back.
    def run(overlap: str) -> tuple[list, list[bool]]:
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, overlap=overlap)
        seen, held = [], []
        for step, tokens in enumerate(batches(6)):
            x = model.emb(tokens[:, :-1])
            if step % 2 == 0:
                x = x + model.fc2(torch.nn.functional.gelu(model.fc1(model.ln1(x))))
            logits = model.head(model.ln_f(x))
            torch.nn.functional.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)
            ).backward()
            opt.step()
            held.append(opt.last_step_overlapped)
            seen += [raw(p) for p in model.parameters()]
        seen += [raw(t) for t in opt.state_dict()["state"][0].values() if isinstance(t, torch.Tensor)]
        seen.append(opt.state_dict()["state"][0]["param_steps"])
        opt.close()
        return seen, held

    serial, _ = run("none")
    overlapped, held = run("backward")
    assert _same(overlapped, serial)
    assert all(held[1:])


def _zero_rank(rank: int, world_size: int, out: Path) -> None:
    data = batches(STEPS, batch=8)
    for overlap in ("none", "backward"):
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, process_group=dist.group.WORLD, overlap=overlap)
        held = []
        for step, tokens in enumerate(data):
            lm_loss(model, tokens.chunk(world_size)[rank]).backward()
            if step == 2:
                opt.param_groups[0]["lr"] *= 0.5  # a mis-speculation on one step
            opt.step()
            held.append(opt.last_step_overlapped)
        state = opt.state_dict()["state"][0]
        seen = [raw(p) for p in model.parameters()] + [raw(state[k]) for k in ("master", "exp_avg", "exp_avg_sq")]
        torch.save({"seen": seen, "held": held}, out / f"{overlap}{rank}.pt")
        opt.close()


@pytest.mark.dist
def test_zero_ranks_stepping_during_backward_equal_the_serial_step(tmp_path: Path):
    run_ranks(_zero_rank, tmp_path, timeout_s=90.0)
    for rank in range(2):
        serial, overlapped = (torch.load(tmp_path / f"{mode}{rank}.pt") for mode in ("none", "backward"))
        assert _same(overlapped["seen"], serial["seen"])
        # The lr changed after step 2's backward: its previews are made again; the next backward previews nothing
        # (the numbers had changed under the last) and its step runs serially; then the previews hold again.
        assert overlapped["held"] == [True, True, True, False, True]
