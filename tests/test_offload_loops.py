"""OffloadOptimizer in the training loops people run: failed backwards, checkpointing, wrappers, mistakes.

On the CPU device, which runs the same hook and bucket code as a GPU; test_offload_cuda.py runs
the GPU versions (a real out-of-memory error, CUDA graphs).
"""

from __future__ import annotations

import gc

import pytest
import torch
from offload_helpers import (
    AdamWOracle,
    CopyingCPU,
    FailingBackward,
    GradTap,
    assert_matches_oracle,
    batches,
    lm_loss,
    loss_failing_midway,
    make_model,
    reentrant_checkpointed_loss,
)
from torch import nn

from cpu_adam import offload
from cpu_adam.offload import OffloadOptimizer

BUCKET = 1024
ADAMW = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
HYPER = dict(ADAMW, bucket_size=BUCKET)


def _simulated_oom(grad: torch.Tensor) -> None:
    raise RuntimeError("simulated: out of memory")


def _state(model: nn.Module, opt: OffloadOptimizer) -> list[torch.Tensor]:
    weights = [p.detach().clone() for p in model.parameters()]
    masters = [m.clone() for m in opt.master_weights()]
    moments = opt._rooms.store.export(0)  # as the host holds them (a state dict before a step has none)
    return [*weights, *masters, moments["exp_avg"].clone(), moments["exp_avg_sq"].clone()]


def _train_skipping_a_failed_batch(fail_at: int | None, micro_batches: int = 1) -> list[torch.Tensor]:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    for i, tokens in enumerate(batches(4)):
        try:
            for m, chunk in enumerate(tokens.chunk(micro_batches)):
                FailingBackward.fail = _simulated_oom if (i, m) == (fail_at, micro_batches - 1) else None
                (loss_failing_midway(model, chunk) / micro_batches).backward()
        except RuntimeError:
            opt.zero_grad()  # what a loop that skips the batch does
            continue
        finally:
            FailingBackward.fail = None
        opt.step()
    return _state(model, opt)


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_failed_backward_then_zero_grad_trains_as_if_the_batch_never_came(micro_batches: int):
    skipped = _train_skipping_a_failed_batch(fail_at=1, micro_batches=micro_batches)
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    for i, tokens in enumerate(batches(4)):
        if i != 1:
            for chunk in tokens.chunk(micro_batches):
                (loss_failing_midway(model, chunk) / micro_batches).backward()
            opt.step()
    for a, b in zip(skipped, _state(model, opt)):
        assert torch.equal(a, b), "the failed batch changed the training that followed"


def test_step_after_a_failed_backward_without_zero_grad_raises():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    first, second = batches(2)
    FailingBackward.fail = _simulated_oom
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            loss_failing_midway(model, first).backward()
    finally:
        FailingBackward.fail = None
    loss_failing_midway(model, second).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"did not finish.*zero_grad\(\)"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    opt.zero_grad()
    loss_failing_midway(model, second).backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_reentrant_checkpointing_with_shared_params_matches_adamw(micro_batches: int):
    model = make_model(0)
    params = list(model.parameters())
    tap = GradTap(params)
    opt = OffloadOptimizer(params, **HYPER)
    oracle = AdamWOracle([{"params": params}], **ADAMW)
    for tokens in batches(6):
        for chunk in tokens.chunk(micro_batches):
            (reentrant_checkpointed_loss(model, chunk) / micro_batches).backward()
        assert opt._rooms.window.micro == micro_batches, "one micro-batch per user backward"
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, params, oracle)


def test_a_second_optimizer_over_the_same_params_is_refused_until_close():
    model = make_model(0)
    first = OffloadOptimizer(model.parameters(), **HYPER)
    with pytest.raises(RuntimeError, match=r"already trained by another OffloadOptimizer.*close\(\)"):
        OffloadOptimizer(model.parameters(), **HYPER)
    first.close()
    assert first.memory_stats()["pinned"] is False
    with pytest.raises(RuntimeError, match="closed"):
        first.step()
    second = OffloadOptimizer(model.parameters(), **HYPER)
    before = [p.detach().clone() for p in model.parameters()]
    lm_loss(model, batches(1)[0]).backward()
    second.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_dropped_wrapper_that_copies_the_optimizer_does_not_close_it():
    # Lightning's LightningOptimizer: a dynamic subclass instance holding a copy of the optimizer's __dict__.
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    wrapper = object.__new__(type("LightningOffloadOptimizer", (OffloadOptimizer,), {}))
    wrapper.__dict__ = dict(opt.__dict__)
    del wrapper
    gc.collect()
    before = [p.detach().clone() for p in model.parameters()]
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters())), "the wrapper closed the optimizer"


def test_dropping_the_optimizer_releases_its_params():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    del opt
    gc.collect()
    OffloadOptimizer(model.parameters(), **HYPER)  # no live owner left


def test_grad_scaler_is_refused_with_the_fix():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(lm_loss(model, batches(1)[0])).backward()
    with pytest.raises(RuntimeError, match=r"OffloadOptimizer.*no GradScaler"):
        scaler.step(opt)


def test_params_converted_after_construction_raise_at_step():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    model.float()
    lm_loss(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"converted or moved after the optimizer was built"):
        opt.step()


def test_device_memory_stays_bounded_when_buckets_never_fill(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(offload.rooms, "DeviceOps", CopyingCPU)
    width, layers = 32, 16
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    used = list(model)[: layers // 2]
    params = [p for pair in zip(model[: layers // 2].parameters(), model[layers // 2 :].parameters()) for p in pair]
    bucket = 2 * width * width  # every bucket: one used and one unused layer
    opt = OffloadOptimizer(params, bucket_size=bucket, max_inflight_buckets=2)
    x = torch.randn(4, width, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    torch.nn.Sequential(*used)(x).float().sum().backward()
    stats = opt.memory_stats()
    assert stats["device_peak_bytes"] <= (offload_open_buckets() + 2) * bucket * 2
    opt.step()
    for layer, weights in zip(model, before):
        changed = not torch.equal(layer.weight.detach(), weights)
        assert changed == (layer in used), "an unused layer was stepped (or a used one was not)"


def offload_open_buckets() -> int:
    from cpu_adam.offload.schedule import OPEN_BUCKETS

    return OPEN_BUCKETS


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_clip_grad_norm_on_the_model_clips_for_real(micro_batches: int):
    # What HF Trainer, accelerate and Lightning call: the norm is the real one, the clipping happens.
    max_norm = 0.05  # well below the tiny model's grad norms: every step is clipped
    model = make_model(0)
    tap = GradTap(list(model.parameters()))
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    oracle = AdamWOracle([{"params": list(model.parameters())}], **ADAMW)
    data = batches(3 * micro_batches)
    for step in range(3):
        for tokens in data[step * micro_batches : (step + 1) * micro_batches]:
            lm_loss(model, tokens).backward()
        grads = tap.take()
        for p in model.parameters():  # a grad's own norm too (what per-layer norm logging reads)
            assert float(p.grad.data.norm()) == pytest.approx(float(grads[id(p)].norm()), rel=1e-5)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        expected = oracle.step(grads, max_norm=max_norm)
        assert expected > 2 * max_norm
        assert float(norm) == pytest.approx(expected, rel=1e-5)
        opt.step()
        assert opt.last_grad_norm == pytest.approx(expected, rel=1e-5)
        assert_matches_oracle(opt, list(model.parameters()), oracle)
        model.zero_grad()  # as HF Trainer does after the step


def test_clipping_by_the_framework_and_by_the_optimizer_compose():
    # Clipped to 0.1 by clip_grad_norm_, then to 0.05 by the optimizer: one clip to 0.05.
    model = make_model(0)
    tap = GradTap(list(model.parameters()))
    opt = OffloadOptimizer(model.parameters(), **HYPER, max_grad_norm=0.05)
    oracle = AdamWOracle([{"params": list(model.parameters())}], **ADAMW)
    for tokens in batches(2):
        lm_loss(model, tokens).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        oracle.step(tap.take(), max_norm=0.05)
        opt.step()
        assert_matches_oracle(opt, list(model.parameters()), oracle)


def test_other_uses_of_an_offloaded_grad_raise_and_change_nothing():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    grad = model.fc1.weight.grad
    assert grad.shape == model.fc1.weight.shape and grad.dtype == torch.bfloat16  # metadata stays readable
    with pytest.raises(RuntimeError, match=r"only its 2-norm.*max_grad_norm"):
        grad + 1
    with pytest.raises(RuntimeError, match="2-norm of the whole grad"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, norm_type=float("inf"))
    with pytest.raises(RuntimeError, match="only its 2-norm"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    torch.nn.utils.clip_grad_norm_([model.fc1.weight], 1e-4)  # part of the optimizer's params
    before = _state(model, opt)
    with pytest.raises(RuntimeError, match=r"different factors.*clip over all its params"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
    model.zero_grad()  # the module's own zero_grad drops the placeholders too
    assert all(p.grad is None for p in model.parameters())
    opt.zero_grad()
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, _state(model, opt)))
    opt.close()
    lm_loss(model, batches(1)[0]).backward()  # a closed optimizer leaves real grads where they belong
    assert type(model.fc1.weight.grad) is torch.Tensor


def test_a_backward_after_the_norm_was_taken_raises():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="after the grad norm of this window was taken"):
        lm_loss(model, batches(1)[0]).backward()
    opt.zero_grad()
    lm_loss(model, batches(1)[0]).backward()
    opt.step()


def test_step_warns_when_the_model_params_were_replaced():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    model.load_state_dict(make_model(1).state_dict(), assign=True)  # new Parameter objects
    lm_loss(model, batches(1)[0]).backward()
    with pytest.warns(RuntimeWarning, match=r"no grad reached.*assign=True.*build the optimizer again"):
        opt.step()


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "1.0", True])
def test_max_grad_norm_is_checked_on_every_assignment(bad):
    model = make_model(0)
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
        OffloadOptimizer(model.parameters(), max_grad_norm=bad, **HYPER)
    opt = OffloadOptimizer(model.parameters(), max_grad_norm=1.0, **HYPER)
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.max_grad_norm = bad
    state = opt.state_dict()
    state["max_grad_norm"] = bad
    with pytest.raises(ValueError, match="max_grad_norm"):
        opt.load_state_dict(state)
    assert opt.max_grad_norm == 1.0


def test_a_step_that_raises_leaves_the_step_counts_alone(monkeypatch: pytest.MonkeyPatch):
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()

    def failing_kernel(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(offload.stepper, "adam_step", failing_kernel)
    with pytest.raises(RuntimeError, match="simulated"):
        opt.step()
    assert opt._rooms.store.steps[0] == [0] * len(opt._rooms.layouts[0].shapes)


def test_params_that_are_views_of_one_buffer_stay_views_or_are_refused():
    buffer = torch.randn(2, 64, dtype=torch.bfloat16)
    disjoint = [nn.Parameter(buffer[0]), nn.Parameter(buffer[1])]
    opt = OffloadOptimizer(disjoint, lr=0.1, bucket_size=BUCKET)
    for p in disjoint:
        p.sum().backward()
    opt.step()
    assert torch.equal(buffer[0], disjoint[0].detach()) and torch.equal(buffer[1], disjoint[1].detach())
    assert disjoint[0].data_ptr() == buffer[0].data_ptr(), "the params' storage moved"
    overlapping = [nn.Parameter(buffer[0]), nn.Parameter(buffer.view(-1)[32:96])]
    with pytest.raises(RuntimeError, match=r"share memory.*one Parameter object"):
        OffloadOptimizer(overlapping, lr=0.1, bucket_size=BUCKET)


def test_an_optimizer_freed_by_the_cycle_collector_is_closed(monkeypatch: pytest.MonkeyPatch):
    closed = []
    monkeypatch.setattr(OffloadOptimizer, "close", lambda self: closed.append(self.rank))
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    opt.cycle = opt  # only the cycle collector frees it
    del opt
    gc.collect()
    assert closed == [0]


def test_moving_the_model_moves_the_placeholder_grads():
    # Lightning's teardown calls model.cpu(); scripts move models for evaluation or export.
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    norm = float(model.fc1.weight.grad.norm())
    model.cpu()
    moved = model.fc1.weight.grad.to(torch.float32)
    assert moved.dtype == torch.float32 and moved.stride() == (0, 0), "a placeholder must stay one element"
    assert float(moved.norm()) == norm
    opt.step()


def test_a_later_group_whose_scalars_overflow_the_step_leaves_every_group_alone():
    # 1e300 passes the range checks but overflows float32 in the kernel: refused before group 0 steps.
    model = make_model(0)
    weights = [p for p in model.parameters() if p.dim() >= 2]
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = OffloadOptimizer([{"params": weights}, {"params": others}], **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    opt.param_groups[1]["weight_decay"] = 1e300
    before = [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.master_weights()]
    with pytest.raises(ValueError, match="beyond float32's range"):
        opt.step()
    after = [p.detach().clone() for p in model.parameters()] + [m.clone() for m in opt.master_weights()]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert all(n == 0 for steps in opt._rooms.store.steps for n in steps)


def test_weights_loaded_into_the_model_between_steps_are_trained_from():
    # model.load_state_dict after training began: the step continues from the loaded weights
    # (their masters taken again, the moments kept), never from masters the model no longer holds.
    model = make_model(0)
    tap = GradTap(list(model.parameters()))
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    oracle = AdamWOracle([{"params": list(model.parameters())}], **ADAMW)
    data = batches(5)
    for tokens in data[:2]:
        lm_loss(model, tokens).backward()
        oracle.step(tap.take())
        opt.step()
    model.load_state_dict(make_model(5).state_dict())
    with torch.no_grad():
        for p in model.parameters():
            oracle.master(p).copy_(p.float())
    for tokens in data[2:]:
        lm_loss(model, tokens).backward()
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, list(model.parameters()), oracle)


def test_stale_placeholders_refuse_norms_and_zeroing_them_is_a_no_op():
    # A loop that clips after step() would read the next window's norms: refused. A module's
    # zero_grad(set_to_none=False) after the step zeroes nothing that matters: allowed.
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    with pytest.raises(RuntimeError, match=r"optimizer\.zero_grad\(\)"):
        model.zero_grad(set_to_none=False)  # the window's grads are still to be stepped
    opt.step()
    with pytest.raises(RuntimeError, match="already used by step"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    model.zero_grad(set_to_none=False)
    lm_loss(model, batches(1)[0]).backward()
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)) > 0
    opt.step()
