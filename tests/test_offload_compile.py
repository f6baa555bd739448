"""torch.compile of code that calls OffloadOptimizer: what equals the eager run, bit for bit.

``step()``, ``zero_grad()`` and the state dict's calls run eagerly inside a compiled function (a
graph break), and so does any use of a placeholder grad (``clip_grad_norm_``'s norms and scaling).
Each test trains an eager twin on the same inputs and compares what the user can see: the weights
and ``last_grad_norm`` after each step, the norm ``clip_grad_norm_`` returned, the state dict.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from conftest import raw
from offload_helpers import batches, lm_loss, make_model
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend

from cpu_adam import OffloadOptimizer
from cpu_adam.offload.placeholder import OffloadedGrad

HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, bucket_size=1024, max_grad_norm=1.0)
STEPS = 4
CLIP = 2.0  # clip_grad_norm_'s threshold: the norms here are 6-7, so it clips, then max_grad_norm clips again

# One training step over its micro-batches; returns the norm clip_grad_norm_ returned, or None.
TrainStep = Callable[[list[Tensor]], "Tensor | None"]
Builder = Callable[[nn.Module, OffloadOptimizer], TrainStep]


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _train(build: Builder, overlap: str, micro: int, model_wrapper: Callable[[nn.Module], nn.Module] = lambda m: m):
    """What the user can see of a short run: weights, norms and the state dict, in order."""
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, overlap=overlap)
    train_step = build(model_wrapper(model), opt)
    seen: list = []
    data = batches(STEPS * micro)
    for step in range(STEPS):
        norm = train_step(data[step * micro : (step + 1) * micro])
        seen += [raw(p) for p in model.parameters()] + [opt.last_grad_norm, None if norm is None else raw(norm)]
    state = opt.state_dict()
    seen += [raw(t) if isinstance(t, Tensor) else t for g in state["state"].values() for t in g.values()]
    seen += [g["lr"] for g in state["param_groups"]]
    opt.close()
    return seen


def _assert_same(compiled: list, eager: list) -> None:
    assert len(compiled) == len(eager)
    for i, (x, y) in enumerate(zip(compiled, eager)):
        assert torch.equal(x, y) if isinstance(x, Tensor) else x == y, f"item {i} differs: {x!r} vs {y!r}"


def _backward(model: nn.Module, micro_batches: list[Tensor]) -> None:
    for tokens in micro_batches:
        (lm_loss(model, tokens) / len(micro_batches)).backward()


def _eager_step(model: nn.Module, opt: OffloadOptimizer) -> TrainStep:
    def train_step(micro_batches: list[Tensor]) -> None:
        _backward(model, micro_batches)
        opt.step()
        opt.zero_grad()

    return train_step


def _compiled_step(model: nn.Module, opt: OffloadOptimizer) -> TrainStep:
    @torch.compile(backend="eager")
    def step() -> None:
        opt.step()

    @torch.compile(backend="eager")
    def zero_grad() -> None:
        opt.zero_grad()

    def train_step(micro_batches: list[Tensor]) -> None:
        _backward(model, micro_batches)
        step()
        zero_grad()

    return train_step


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_a_compiled_step_equals_the_eager_step(overlap: str, micro: int):
    _assert_same(_train(_compiled_step, overlap, micro), _train(_eager_step, overlap, micro))


def _eager_whole_step(model: nn.Module, opt: OffloadOptimizer) -> TrainStep:
    def train_step(micro_batches: list[Tensor]) -> Tensor:
        _backward(model, micro_batches)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return norm

    return train_step


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("overlap", ["none", "backward"])
def test_a_compiled_train_step_with_clip_grad_norm_equals_the_eager_one(overlap: str, micro: int):
    # Forward in a graph, backward by autograd (our hooks run from its engine), then clip_grad_norm_
    # on the placeholders, step() and zero_grad() eagerly.
    def compiled_whole_step(model: nn.Module, opt: OffloadOptimizer) -> TrainStep:
        return torch.compile(_eager_whole_step(model, opt), backend="eager")

    _assert_same(_train(compiled_whole_step, overlap, micro), _train(_eager_whole_step, overlap, micro))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_model_with_an_eager_step_equals_the_eager_model(backend: str):
    # Its backward calls the hooks from the autograd engine; the second micro-batch's forward meets
    # params whose grads are placeholders.
    compiled = _train(_eager_whole_step, "none", 2, lambda model: torch.compile(model, backend=backend))
    _assert_same(compiled, _train(_eager_whole_step, "none", 2))


def test_a_graph_compiled_while_params_hold_placeholders():
    # torch.compile makes fake copies of the params a function reads, their grads included.
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    assert all(isinstance(p.grad, OffloadedGrad) for p in model.parameters())

    @torch.compile(backend="aot_eager")
    def weight_sum() -> Tensor:
        return sum(p.float().sum() for p in model.parameters())

    assert torch.equal(weight_sum(), sum(p.float().sum() for p in model.parameters()))
    opt.close()


def test_the_other_calls_that_reach_the_host_state_run_eagerly_in_a_compiled_function():
    # overlap="backward" leaves a step deferred: each of these settles it with the worker first.
    def reports(opt: OffloadOptimizer) -> list:
        state = opt.state_dict()
        tensors = [t for g in state["state"].values() for t in g.values() if isinstance(t, Tensor)]
        return [raw(t) for t in opt.master_weights() + tensors] + [opt.memory_stats()["host_bytes"]]

    runs = []
    for compile_the_calls in (True, False):
        model = make_model(0)
        opt = OffloadOptimizer(model.parameters(), **HYPER, overlap="backward")
        _eager_step(model, opt)(batches(1))
        runs.append(torch.compile(reports, backend="eager")(opt) if compile_the_calls else reports(opt))
        (torch.compile(opt.close, backend="eager") if compile_the_calls else opt.close)()
        with pytest.raises(RuntimeError, match="was closed"):
            opt.step()
        OffloadOptimizer(model.parameters(), **HYPER).close()  # the first one let go of the params
    _assert_same(*runs)


def test_fullgraph_refuses_the_step_as_a_graph_break():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    lm_loss(model, batches(1)[0]).backward()
    before = [raw(p) for p in model.parameters()]
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"torch\.compiler\.disable"):
        torch.compile(opt.step, backend="eager", fullgraph=True)()
    assert all(torch.equal(raw(p), b) for p, b in zip(model.parameters(), before))
    opt.step()  # the grads are still there for an eager step
    assert opt.last_grad_norm is not None
    opt.close()


def test_a_backward_called_from_a_compiled_function_runs_the_hooks_eagerly():
    # Dynamo graph-breaks on backward() and would trace the hooks the engine then calls in this
    # thread: a graph per param and more, guarded on the optimizer's bookkeeping.
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    counter = CompileCounterWithBackend("eager")
    train_step = torch.compile(_eager_whole_step(model, opt), backend=counter)
    for tokens in batches(2):
        train_step([tokens])
    assert 0 < counter.frame_count < len(list(model.parameters()))
    opt.close()


def test_clip_grad_norm_in_a_compiled_function_asks_the_placeholders_eagerly():
    # Their norms and scaling read and change the host's sums: traced, a graph per handler and more.
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    counter = CompileCounterWithBackend("eager")
    clip = torch.compile(lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP), backend=counter)
    for tokens in batches(2):
        lm_loss(model, tokens).backward()
        norm = clip()
        opt.step()
        assert norm.item() == pytest.approx(opt.last_grad_norm, rel=1e-6)
        opt.zero_grad()
    assert counter.frame_count == 0
    opt.close()


def test_compiled_autograd_is_refused_by_name():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    tokens = batches(1)[0]
    with torch._dynamo.config.patch(compiled_autograd=True):
        backward = torch.compile(lambda: lm_loss(model, tokens).backward(), backend="eager")
        with pytest.raises(RuntimeError, match=r"compiled autograd .* Turn compiled autograd off"):
            backward()
    opt.zero_grad()  # drops the partial grads, as after any backward that raised
    _eager_step(model, opt)([tokens])
    assert opt.last_grad_norm is not None
    opt.close()


@pytest.mark.slow
def test_an_inductor_compiled_train_step_equals_the_eager_step_around_the_same_compiled_model():
    # Inductor's forward and backward round otherwise than eager's, so both runs train the same
    # inductor-compiled model; clipping, step() and zero_grad() compiled by inductor change no bit.
    def clip_step_and_clear(model: nn.Module, opt: OffloadOptimizer) -> Tensor:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        return norm

    def build(compile_the_rest: bool) -> Builder:
        def train_step_builder(compiled_model: nn.Module, opt: OffloadOptimizer) -> TrainStep:
            rest = torch.compile(clip_step_and_clear) if compile_the_rest else clip_step_and_clear

            def train_step(micro_batches: list[Tensor]) -> Tensor:
                _backward(compiled_model, micro_batches)
                return rest(compiled_model, opt)

            return train_step

        return train_step_builder

    compiled = _train(build(compile_the_rest=True), "none", 2, torch.compile)
    eager = _train(build(compile_the_rest=False), "none", 2, torch.compile)
    _assert_same(compiled, eager)
