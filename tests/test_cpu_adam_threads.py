"""CPUAdam under threads: a second step (or a load, or a new param group) while one runs is refused at once,
before it touches anything; the step running completes as if alone, and training goes on bit for bit."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from conftest import raw

from cpu_adam import CPUAdam, _compiled_step

HYPER = {"lr": 1e-3, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.01}
BUSY = "another thread is stepping this optimizer"


def make(seed: int = 0, numel: int = 1 << 16) -> tuple[list[torch.nn.Parameter], CPUAdam]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(numel, generator=g)), torch.nn.Parameter(torch.randn(257, generator=g))]
    return params, CPUAdam(params, **HYPER)


def give_grads(params: list[torch.nn.Parameter], round_: int) -> None:
    g = torch.Generator().manual_seed(100 + round_)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 0.1


def snapshot(params: list[torch.nn.Parameter], opt: CPUAdam) -> list:
    state = opt.state_dict()["state"]
    return [raw(p) for p in params] + [raw(t) if torch.is_tensor(t) else t for s in state.values() for t in s.values()]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) if torch.is_tensor(x) else x == y for x, y in zip(a, b))


class _Held:
    """The kernel's first call blocks until released: a step is inside the kernel, half done, for as long as needed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.inside, self.release = threading.Event(), threading.Event()
        real, self.calls = _compiled_step.adam_step, 0

        def held(*args: Any, **kwargs: Any) -> None:
            if not kwargs.get("check_only"):
                self.calls += 1
                if self.calls == 1:
                    self.inside.set()
                    assert self.release.wait(10)
            real(*args, **kwargs)

        monkeypatch.setattr(_compiled_step, "adam_step", held)


def _step_in_thread(opt: CPUAdam) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            opt.step()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, errors


@pytest.mark.parametrize("trained", [False, True], ids=["first step", "trained"])
def test_a_second_step_while_one_runs_is_refused_and_the_first_completes_as_if_alone(
    monkeypatch: pytest.MonkeyPatch, trained: bool
):
    params, opt = make()
    twin_params, twin = make()
    for round_ in range(3 if trained else 0):
        for ps, o in ((params, opt), (twin_params, twin)):
            give_grads(ps, round_)
            o.step()
    give_grads(params, 3)
    give_grads(twin_params, 3)
    held = _Held(monkeypatch)
    thread, errors = _step_in_thread(opt)
    assert held.inside.wait(10)
    with pytest.raises(RuntimeError, match=BUSY):
        opt.step()
    held.release.set()
    thread.join(10)
    assert not errors
    twin.step()
    assert same(snapshot(params, opt), snapshot(twin_params, twin)), "the refused step changed something"
    for round_ in range(4, 6):  # and training goes on bit for bit
        for ps, o in ((params, opt), (twin_params, twin)):
            give_grads(ps, round_)
            o.step()
    assert same(snapshot(params, opt), snapshot(twin_params, twin))


def test_a_load_or_a_new_param_group_during_a_step_is_refused_and_a_state_dict_is_not(
    monkeypatch: pytest.MonkeyPatch,
):
    params, opt = make()
    give_grads(params, 0)
    opt.step()
    saved = opt.state_dict()
    give_grads(params, 1)
    held = _Held(monkeypatch)
    thread, errors = _step_in_thread(opt)
    assert held.inside.wait(10)
    with pytest.raises(RuntimeError, match=BUSY):
        opt.load_state_dict(saved)
    with pytest.raises(RuntimeError, match=BUSY):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))]})
    live = opt.state_dict()  # allowed, as torch's: live tensors
    held.release.set()
    thread.join(10)
    assert not errors and len(opt.param_groups) == 1
    assert live["state"][0]["step"] == 2  # the live step count, taken after the step finished


def test_steps_from_two_threads_at_once_many_times_equal_the_steps_taken_one_after_another():
    params, opt = make(numel=1 << 20)  # a step of about a millisecond: the threads meet in it
    twin_params, twin = make(numel=1 << 20)
    refused = 0
    for round_ in range(40):
        give_grads(params, round_)
        barrier, outcomes = threading.Barrier(2), []

        def run(barrier: threading.Barrier = barrier, outcomes: list[str] = outcomes) -> None:
            barrier.wait()
            try:
                opt.step()
                outcomes.append("stepped")
            except RuntimeError as error:
                assert BUSY in str(error)
                outcomes.append("refused")

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert len(outcomes) == 2
        refused += outcomes.count("refused")
        give_grads(twin_params, round_)
        for _ in range(outcomes.count("stepped")):
            twin.step()
        assert same(snapshot(params, opt), snapshot(twin_params, twin)), f"round {round_}: {outcomes}"
    assert refused > 0, "the threads never met: the test says nothing"


def test_a_copied_or_unpickled_optimizer_has_a_guard_of_its_own():
    import copy
    import pickle

    params, opt = make(numel=64)
    give_grads(params, 0)
    opt.step()
    for other in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert other._turn is not opt._turn and not other._turn.taken
        for p in other.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        other.step()
