"""The offload optimizer under uses that are not training as usual: each works, or raises at once naming the fix."""

from __future__ import annotations

import copy
import io
import pickle
import threading

import pytest
import torch
from offload_helpers import batches, lm_loss, make_model

from cpu_adam import OffloadOptimizer
from cpu_adam.offload import refusals

HYPER = dict(lr=1e-3, bucket_size=1024)


def _trained() -> tuple[torch.nn.Module, OffloadOptimizer]:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    opt.step()
    return model, opt


def test_the_model_pickles_and_saves_while_the_optimizer_trains_it():
    model, _alive = _trained()  # the optimizer still trains the model
    lm_loss(model, batches(2)[1]).backward()  # placeholder grads on the params too
    restored = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for a, b, c in zip(model.parameters(), restored.parameters(), loaded.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(RuntimeError, match="already trained by another"):
        OffloadOptimizer(model.parameters(), **HYPER)  # ownership is still known


@pytest.mark.parametrize("verb", ["step", "state_dict", "load_state_dict"])
def test_a_closed_optimizer_refuses_naming_close(verb: str):
    model, opt = _trained()
    saved = opt.state_dict()
    opt.close()
    other = OffloadOptimizer(model.parameters(), **HYPER)  # the params now belong to another optimizer
    before = [p.detach().clone() for p in model.parameters()]
    call = {
        "step": lambda: opt.step(),
        "state_dict": opt.state_dict,
        "load_state_dict": lambda: opt.load_state_dict(saved),
    }
    with pytest.raises(RuntimeError, match=r"was closed \(close\(\)\)"):
        call[verb]()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))
    other.close()


@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy, pickle.dumps])
def test_copying_or_pickling_the_optimizer_is_refused_at_once(copier):
    _, opt = _trained()
    with pytest.raises(TypeError, match=r"cannot be copied or pickled.*state_dict"):
        copier(opt)


def test_two_threads_stepping_at_once_get_a_clear_error(monkeypatch: pytest.MonkeyPatch):
    model, opt = _trained()
    lm_loss(model, batches(2)[1]).backward()
    inside, release = threading.Event(), threading.Event()
    real = refusals.check_open

    def slow_check(closed: bool, verb: str) -> None:  # the step's first call, inside the guard
        if verb == "step":
            inside.set()
            release.wait(10)
        real(closed, verb)

    monkeypatch.setattr(refusals, "check_open", slow_check)
    first = threading.Thread(target=opt.step)
    first.start()
    assert inside.wait(10)
    try:
        with pytest.raises(RuntimeError, match="already running in another thread"):
            opt.step()
    finally:
        release.set()
        first.join(10)
    assert opt.state_dict()["state"][0]["step"] == 2, "the first thread's step ran, once"


def test_a_meta_model_without_device_names_device():
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"meta device.*device='cuda'"):
        OffloadOptimizer(model.parameters())


def test_a_param_unfrozen_after_construction_is_refused_at_step_naming_the_fix():
    model = make_model(0)
    model.fc1.weight.requires_grad_(False)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    model.fc1.weight.requires_grad_(True)  # the second phase of a fine-tuning
    lm_loss(model, batches(1)[0]).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"frozen .* when the optimizer was built.*Build the optimizer after"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_a_param_missing_from_a_later_micro_batch_keeps_only_its_own_contributions():
    # On the CPU device a bucket's staging area is its slot: a param that misses the second
    # micro-batch must not bring back the first one's grad (already summed). Bitwise against a
    # twin whose second micro-batch runs the branch times 0, which packs zeros for it.
    def run(skip: bool) -> list[torch.Tensor]:
        model = make_model(0)
        torch.manual_seed(5)
        side = torch.nn.Linear(32, 32).to(torch.bfloat16)
        params = [p for pair in zip(model.parameters(), side.parameters()) for p in pair]  # side params between
        params += list(model.parameters())[len(list(side.parameters())) :]
        opt = OffloadOptimizer(params, lr=1e-2, bucket_size=2048)
        for step, tokens in enumerate(batches(4, batch=8)):
            for micro, chunk in enumerate(tokens.chunk(2)):
                loss = lm_loss(model, chunk)
                uses_side = micro == 0 or step % 2 == 0  # misses the second micro-batch on odd steps only
                if uses_side or not skip:
                    out = side(model.emb(chunk)).float().square().mean()
                    loss = loss + (out if uses_side else out * 0.0)
                loss.backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in (*model.parameters(), *side.parameters())]

    skipped, zeroed = run(skip=True), run(skip=False)
    assert all(torch.equal(a, b) for a, b in zip(skipped, zeroed))
