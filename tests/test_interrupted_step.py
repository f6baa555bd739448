"""Ctrl-C during a step: the tensors and the step counts change together, or neither does."""

from __future__ import annotations

import os
import random
import signal
import threading
import time

import pytest
import torch
from offload_helpers import batches, lm_loss, make_model

import cpu_adam._compiled_step
import cpu_adam.offload.stepper
from cpu_adam import CPUAdam, OffloadOptimizer
from cpu_adam._signals import interrupts_deferred

pytestmark = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals reach the main thread only"
)


def _signalling(monkeypatch: pytest.MonkeyPatch, module: object) -> None:
    """The first kernel call of ``module`` is followed by a SIGINT, before its caller counts the step."""
    real, sent = module.adam_step, []

    def kernel_then_ctrl_c(*args, **kwargs):
        out = real(*args, **kwargs)
        if not kwargs.get("check_only") and not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(module, "adam_step", kernel_then_ctrl_c)


def _cpu_adam_pair() -> tuple[list[CPUAdam], list[list[torch.nn.Parameter]]]:
    torch.manual_seed(0)
    values = [torch.randn(1000), torch.randn(37), torch.randn(64, 3)]
    pairs = []
    for _ in range(2):
        params = [torch.nn.Parameter(v.clone()) for v in values]
        for p in params:
            p.grad = torch.ones_like(p) * 0.25
        groups = [{"params": params[:2]}, {"params": params[2:], "lr": 1e-2}]
        pairs.append((CPUAdam(groups, lr=1e-3), params))
    return [o for o, _ in pairs], [p for _, p in pairs]


def test_cpu_adam_interrupted_after_a_kernel_call_completes_the_step_then_raises(monkeypatch):
    (opt, twin), (params, twin_params) = _cpu_adam_pair()
    twin.step()
    twin.step()
    opt.step()
    _signalling(monkeypatch, cpu_adam._compiled_step)
    with pytest.raises(KeyboardInterrupt):
        opt.step()  # two groups: two kernel calls, the signal after the first
    for p, q in zip(params, twin_params):
        assert opt.state[p]["step"].item() == 2
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg"], twin.state[q]["exp_avg"])


def test_a_second_ctrl_c_interrupts_at_once():
    reached = []
    with pytest.raises(KeyboardInterrupt), interrupts_deferred():
        signal.raise_signal(signal.SIGINT)
        reached.append("held")
        signal.raise_signal(signal.SIGINT)
        reached.append("after the second")
    assert reached == ["held"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_held_ctrl_c_is_delivered_when_the_block_raises():
    with pytest.raises(KeyboardInterrupt) as raised, interrupts_deferred():
        signal.raise_signal(signal.SIGINT)
        raise ValueError("the block failed")
    assert isinstance(raised.value.__context__, ValueError)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_user_handler_is_deferred_and_restored():
    calls = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    try:
        with interrupts_deferred():
            signal.raise_signal(signal.SIGINT)
            assert calls == []
        assert calls == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, previous)


def _offload_twins(overlap: str, device_fraction: float = 0.0) -> tuple[list, list[OffloadOptimizer]]:
    models = [make_model(0), make_model(0)]
    opts = [
        OffloadOptimizer(m.parameters(), lr=1e-3, bucket_size=1024, overlap=overlap, device_fraction=device_fraction)
        for m in models
    ]
    return models, opts


def _signalling_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The device's first bucket is followed by a SIGINT, before the next is stepped."""
    from cpu_adam.device_kernel import Launches

    real, sent = Launches.__call__, []

    def launches_then_ctrl_c(self) -> None:
        real(self)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(Launches, "__call__", launches_then_ctrl_c)


def _signalling_upload(monkeypatch: pytest.MonkeyPatch, opt: OffloadOptimizer) -> None:
    """The first bucket uploaded by ``opt`` is followed by a SIGINT, before the next is stepped or uploaded."""
    link = opt._rooms.link
    real, sent = link.up, []

    def upload_then_ctrl_c(*args, **kwargs):
        real(*args, **kwargs)
        if not sent:
            sent.append(True)
            signal.raise_signal(signal.SIGINT)

    monkeypatch.setattr(link, "up", upload_then_ctrl_c)


@pytest.mark.parametrize(
    "overlap,where", [("none", "kernel"), ("none", "upload"), ("backward", "upload"), ("none", "device")]
)
def test_offload_interrupted_mid_step_completes_the_step_then_raises(monkeypatch, overlap, where):
    if where == "device":
        pytest.importorskip("triton", reason="the device kernel is written in Triton")
    (model, twin_model), (opt, twin) = _offload_twins(overlap, device_fraction=0.5 if where == "device" else 0.0)
    data = batches(3)
    for batch in data:
        for m, o in ((twin_model, twin), (model, opt)):
            lm_loss(m, batch).backward()
            if o is opt and batch is data[1]:
                if where == "kernel":
                    _signalling(monkeypatch, cpu_adam.offload.stepper)
                elif where == "device":
                    _signalling_device(monkeypatch)
                else:
                    _signalling_upload(monkeypatch, o)
                with pytest.raises(KeyboardInterrupt):
                    o.step()
                monkeypatch.undo()
            else:
                o.step()
            o.zero_grad()
        for a, b in zip(model.parameters(), twin_model.parameters()):
            assert torch.equal(a, b)
    saved, expected = opt.state_dict()["state"][0], twin.state_dict()["state"][0]
    assert saved["param_steps"] == expected["param_steps"] == [3] * len(expected["param_steps"])
    for name in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(saved[name], expected[name])
    for a, b in zip(model.parameters(), twin_model.parameters()):
        assert torch.equal(a, b)
    opt.close()
    twin.close()


def _until_interrupted(timer: threading.Timer, seconds: float = 10.0) -> None:
    """Returns only by raising the KeyboardInterrupt of the SIGINT ``timer`` sends, in the caller's try: Python runs
    the handler at its next check, which a plain sleep could leave until after the try."""
    timer.join()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.001)
    pytest.fail(f"the SIGINT sent {seconds} s ago never raised KeyboardInterrupt")


def test_real_ctrl_c_at_random_moments_never_splits_a_step():
    # 2^21 elements: a step of a few ms, so signals sent at random land inside the kernel too.
    n, rng = 1 << 21, random.Random(0)
    grad = torch.randn(n, generator=torch.Generator().manual_seed(1))
    start = torch.randn(n, generator=torch.Generator().manual_seed(2))
    reference = [start.clone()]
    ref_param = torch.nn.Parameter(start.clone())
    ref_param.grad = grad
    ref_opt = CPUAdam([ref_param], lr=1e-3)
    interrupted = 0
    for trial in range(12):
        param = torch.nn.Parameter(start.clone())
        param.grad = grad
        opt = CPUAdam([param], lr=1e-3)
        timer = threading.Timer(rng.uniform(0.0, 0.02), os.kill, (os.getpid(), signal.SIGINT))
        try:
            # Started inside the try: a short delay on a loaded machine sent the signal while start() still waited
            # for the timer's thread, and the KeyboardInterrupt was raised there, outside the try (1 run in 4).
            timer.start()
            for _ in range(20):
                opt.step()
            _until_interrupted(timer)
        except KeyboardInterrupt:
            interrupted += 1
        timer.join()
        count = int(opt.state[param]["step"].item()) if opt.state[param] else 0
        while len(reference) <= count:
            ref_opt.step()
            reference.append(ref_param.detach().clone())
        assert torch.equal(param.detach(), reference[count]), f"trial {trial}: weights of another step than {count}"
    assert interrupted == 12
