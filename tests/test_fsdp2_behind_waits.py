"""What reads or writes the step's tensors while a step behind the forward is in flight waits for it, and what the
next forward gathers waits for its own unit alone.

Every unit's step is slowed (``slow_units``), so a read that did not wait would see the old values: each check
runs right after ``step()`` returns, on a model stepped behind the forward and on its serial twin, and compares.
The process is a world of one (gloo); the multi-rank runs are in test_fsdp2_behind.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from behind_setup import Case, assert_same, batch, build, copies, forward_backward, slow_units, tensors_of
from rank_spawn import free_loopback_port
from torch import nn

from cpu_adam.fsdp2 import step_behind_forward
from cpu_adam.fsdp2.in_flight import Status

pytestmark = pytest.mark.dist
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not hasattr(fsdp, "fully_shard"):
    pytest.skip("this torch has no FSDP2 (torch.distributed.fsdp.fully_shard)", allow_module_level=True)

CASE = Case(dtype=torch.float32, precision="bf16")


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def stepped_pair(case: Case = CASE, steps: int = 1):
    """The serial twin stepped ``steps`` times, and ours with the same steps, the last one in flight (slowed)."""
    serial, serial_opt = build(case)
    ours, our_opt = build(case)
    handle = step_behind_forward(ours, our_opt)
    for step in range(steps):
        for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
            forward_backward(model, case, step)
            optimizer.step()
            if step < steps - 1:
                optimizer.zero_grad()
        if step < steps - 1:
            handle.wait()
    return serial, serial_opt, ours, our_opt


def plain(tensors: dict) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in tensors.items()}


READS: dict[str, Callable[[nn.Module, torch.optim.Optimizer], object]] = {
    "model.state_dict()": lambda m, o: plain(m.state_dict()),
    "get_state_dict": lambda m, o: plain(_get_state_dict(m, o)[0]),
    "optimizer.state_dict()": lambda m, o: {
        f"{i}.{k}": v.clone() for i, s in o.state_dict()["state"].items() for k, v in s.items()
    },
    "full_tensor()": lambda m, o: {n: p.full_tensor().clone() for n, p in m.named_parameters()},
    "an EMA (torch._foreach_lerp_)": lambda m, o: _ema(m),
    "the next forward": lambda m, o: {"out": m(batch(CASE, 7)[0]).detach()},
    "data_ptr()": lambda m, o: {n: _read_through_pointer(p) for n, p in m.named_parameters()},
}


def _get_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(model, optimizer)


def _ema(model: nn.Module) -> dict:
    params = [p.detach() for p in model.parameters()]
    ema = [torch.zeros_like(p) for p in params]
    torch._foreach_lerp_(ema, params, 0.25)
    return {str(i): e.full_tensor() for i, e in enumerate(ema)}


def _read_through_pointer(p: torch.Tensor) -> torch.Tensor:
    """The shard's bytes read at its address, as a C library would (ctypes, no torch op on the tensor itself)."""
    import ctypes

    local = p._local_tensor
    nbytes = local.numel() * local.element_size()
    address = local.data_ptr()
    return torch.frombuffer(bytearray(ctypes.string_at(address, nbytes)), dtype=torch.uint8)


@pytest.mark.parametrize("read", READS, ids=list(READS))
def test_a_read_after_step_sees_the_stepped_values(world_of_one: None, read: str) -> None:
    serial, serial_opt, ours, our_opt = None, None, None, None
    with slow_units():
        serial, serial_opt, ours, our_opt = stepped_pair()
        got = READS[read](ours, our_opt)
    assert_same(got, READS[read](serial, serial_opt), read)


@pytest.mark.parametrize("read", READS, ids=list(READS))
def test_a_read_after_the_next_step_sees_it_stepped(world_of_one: None, read: str) -> None:
    """The first step ends inside the next forward (its units long stepped, no wait() on the handle); a read right
    after the second step() waits for that one, as after the first."""
    serial, serial_opt, ours, our_opt = stepped_pair()
    with slow_units():
        for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
            optimizer.zero_grad()
            forward_backward(model, CASE, 1)
            optimizer.step()
        got = READS[read](ours, our_opt)
    assert_same(got, READS[read](serial, serial_opt), f"{read} after the second step")


def test_a_step_after_one_a_backward_ended_guards_its_own_tensors(world_of_one: None) -> None:
    """The first step ends in a backward of a graph made before it (so no forward retires its guard); the second
    step's guard is its own: a read right after it waits for it."""
    serial, serial_opt, ours, our_opt = backward_after_step(zero_grad=True)
    with slow_units():
        for optimizer in (serial_opt, our_opt):
            optimizer.step()
        got = READS["full_tensor()"](ours, our_opt)
    assert_same(got, READS["full_tensor()"](serial, serial_opt), "full_tensor() after the second step")


def test_the_guard_leaves_with_the_forward_that_ends_the_step(world_of_one: None) -> None:
    """The forward after a step is the guard's last need: the backward runs without it, and the grads the step read
    go with zero_grad(), not with the next step."""
    modes = torch._C._len_torch_function_stack()
    _serial, _serial_opt, ours, our_opt = stepped_pair()
    grad = weakref.ref(next(ours.parameters()).grad)
    our_opt.zero_grad()
    ours(batch(CASE, 1)[0])
    assert torch._C._len_torch_function_stack() == modes, "the guard is still on the stack"
    assert grad() is None, "the grads the step read are still held"


def test_the_forward_waits_for_each_unit_alone(world_of_one: None) -> None:
    """At each block's forward its own unit is stepped and the last block's is not yet: the step runs behind."""
    seen: list[list[Status]] = []
    with slow_units(0.1):
        serial, _serial_opt, ours, our_opt = stepped_pair()
        handle = our_opt._behind
        hooks = [
            block.register_forward_pre_hook(lambda m, a: seen.append(list((handle._in_flight or handle._last).status)))
            for block in ours.blocks
        ]
        out = ours(batch(CASE, 7)[0])
        for hook in hooks:
            hook.remove()
    assert_same({"out": out.detach()}, {"out": serial(batch(CASE, 7)[0]).detach()}, "the forward")
    order = handle.order
    assert order[0] == "the root", order
    first = seen[0]
    assert first[1] is Status.STEPPED and first[-1] is Status.QUEUED, f"at the first block's forward: {first}"
    for i, statuses in enumerate(seen):
        assert statuses[1 + i] is Status.STEPPED, f"block {i}'s forward ran before its unit was stepped"


WRITES: dict[str, Callable[[nn.Module, torch.optim.Optimizer, nn.Module, torch.optim.Optimizer], None]] = {
    "model.load_state_dict": lambda m, o, s, so: m.load_state_dict(s.state_dict()),
    "set_state_dict": lambda m, o, s, so: _set_state_dict(m, o, s, so),
    "optimizer.load_state_dict": lambda m, o, s, so: o.load_state_dict(so.state_dict()),
}


def _set_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, source: nn.Module, source_opt) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model_sd, optim_sd = _get_state_dict(source, source_opt)
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


@pytest.mark.parametrize("write", WRITES, ids=list(WRITES))
def test_a_load_after_step_is_not_overwritten_by_it(world_of_one: None, write: str) -> None:
    """Loading another model's state right after step(): the load wins (a step that went on would write over it)."""
    with slow_units():
        _serial, _serial_opt, ours, our_opt = stepped_pair()
        source, source_opt = build(CASE, seed=5)
        forward_backward(source, CASE, 0)
        source_opt.step()
        WRITES[write](ours, our_opt, source, source_opt)
        our_opt._behind.wait()
    if write == "optimizer.load_state_dict":
        mine = {k: v for k, v in tensors_of(ours, our_opt).items() if "." in k and k.rsplit(".", 1)[1] != "weight"}
        theirs = tensors_of(source, source_opt)
        assert_same({k: mine[k] for k in mine if "exp_avg" in k}, {k: theirs[k] for k in mine if "exp_avg" in k}, write)
    else:
        assert_same(plain(ours.state_dict()), plain(source.state_dict()), write)


def test_zero_grad_keeping_the_grads_zeroes_each_unit_once_stepped(world_of_one: None) -> None:
    """zero_grad(set_to_none=False) (torchtitan's default) right after step(): it returns with the step still in flight,
    each unit's grads are zeroed once its step has read them, and the next forward and backward go on from there."""
    with slow_units():
        serial, serial_opt, ours, our_opt = stepped_pair()
        for optimizer in (serial_opt, our_opt):
            optimizer.zero_grad(set_to_none=False)
        assert our_opt._behind._in_flight is not None, "zero_grad waited for the whole step"
        for model in (serial, ours):
            forward_backward(model, CASE, 1)  # accumulates into the zeroed grads
        our_opt._behind.wait()
        assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "after zero_grad(set_to_none=False)")
        grads = {n: p.grad for n, p in ours.named_parameters()}
        assert_same(plain(grads), plain({n: p.grad for n, p in serial.named_parameters()}), "the next grads")
        for optimizer in (serial_opt, our_opt):
            optimizer.step()
        our_opt._behind.wait()
    assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "the step after")


def test_clip_grad_norm_after_step_leaves_the_step_its_grads(world_of_one: None) -> None:
    with slow_units():
        serial, serial_opt, ours, our_opt = stepped_pair()
        torch.nn.utils.clip_grad_norm_(ours.parameters(), 1e-3)
        our_opt._behind.wait()
    assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "clip_grad_norm_ after step()")


@pytest.mark.parametrize("verb", ["step", "add_param_group"])
def test_the_next_step_and_add_param_group_wait(world_of_one: None, verb: str) -> None:
    """Another step on the same grads right after step(), or a group added: the first step is whole before."""
    with slow_units():
        serial, serial_opt, ours, our_opt = stepped_pair()
        extra = nn.Parameter(torch.ones(3))
        extra.grad = torch.ones(3)
        for optimizer in (serial_opt, our_opt):
            if verb == "step":
                optimizer.step()
            else:
                optimizer.add_param_group({"params": [extra]})
        our_opt._behind.wait()
    assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), f"{verb}() right after step()")


def test_a_step_post_hook_sees_the_step_done(world_of_one: None) -> None:
    seen: dict = {}
    with slow_units():
        serial, serial_opt, ours, our_opt = build(CASE) + build(CASE)
        step_behind_forward(ours, our_opt)
        our_opt.register_step_post_hook(lambda o, a, k: seen.update(plain(ours.state_dict())))
        for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
            forward_backward(model, CASE, 0)
            optimizer.step()
    assert_same(seen, plain(serial.state_dict()), "a step post-hook")


def backward_after_step(zero_grad: bool):
    """Twins one step in, each step followed by the backward of a graph made before it (without zero_grad between,
    its grads accumulate into those the step reads)."""
    serial, serial_opt = build(CASE)
    ours, our_opt = build(CASE)
    step_behind_forward(ours, our_opt)
    for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
        forward_backward(model, CASE, 0)
        x, y = batch(CASE, 1)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.step()
        if zero_grad:
            optimizer.zero_grad()
        loss.backward()
    return serial, serial_opt, ours, our_opt


def test_a_backward_of_a_graph_made_before_step_waits(world_of_one: None) -> None:
    with slow_units():
        serial, serial_opt, ours, our_opt = backward_after_step(zero_grad=False)
        our_opt._behind.wait()
    assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "a backward after step()")
    assert_same(
        plain({n: p.grad for n, p in ours.named_parameters()}),
        plain({n: p.grad for n, p in serial.named_parameters()}),
        "grads",
    )


def test_an_explicit_unshard_gathers_the_stepped_unit(world_of_one: None) -> None:
    with slow_units():
        serial, _serial_opt, ours, _our_opt = stepped_pair()
        for model in (serial, ours):
            model.blocks[-1].unshard()
        gathered = {n: p.detach().clone() for n, p in ours.blocks[-1].named_parameters()}
        expected = {n: p.detach().clone() for n, p in serial.blocks[-1].named_parameters()}
        for model in (serial, ours):
            model.blocks[-1].reshard()
    assert_same(gathered, expected, "unshard()")


def test_an_lr_scheduler_between_step_and_forward_changes_the_next_step(world_of_one: None) -> None:
    with slow_units():
        serial, serial_opt, ours, our_opt = stepped_pair()
        serial_opt._behind = None
        for optimizer in (serial_opt, our_opt):
            torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5).step()
            optimizer.zero_grad()
        for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
            forward_backward(model, CASE, 1)
            optimizer.step()
        our_opt._behind.wait()
    assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "a scheduler stepped in between")


def second_step_ready():
    """Twins one step in with the second step's grads; the serial twin's second step taken, ours not yet, and its
    tensors as they are before it."""
    serial, serial_opt = build(CASE)
    ours, our_opt = build(CASE)
    handle = step_behind_forward(ours, our_opt)
    for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
        forward_backward(model, CASE, 0)
        optimizer.step()
        optimizer.zero_grad()
        forward_backward(model, CASE, 1)
    before = copies(tensors_of(ours, our_opt))
    serial_opt.step()
    return serial, serial_opt, ours, our_opt, handle, before


def test_a_failure_is_raised_at_the_first_wait_and_leaves_the_rest_unstepped(world_of_one: None) -> None:
    serial, serial_opt, ours, our_opt, handle, before = second_step_ready()
    with slow_units(0.01, failing=2):
        our_opt.step()
        failing_unit = handle.order[2]
        with pytest.raises(RuntimeError, match=f"failed in unit {failing_unit}.*a planted failure"):
            ours(batch(CASE, 1)[0])
    stepped, now = tensors_of(serial, serial_opt), tensors_of(ours, our_opt)
    for name, tensor in now.items():
        unit = next(u for u in handle.units if any(name.startswith(f"{m}.") or name == m for m in _prefixes(u)))
        position = handle.order.index(unit.describe())
        expected = stepped[name] if position < 2 else before[name]
        assert_same({name: tensor}, {name: expected}, f"unit {unit.describe()} after a failure in {failing_unit}")
    our_opt.zero_grad()
    forward_backward(ours, CASE, 2)
    our_opt.step()  # the next step goes on
    handle.wait()


def _prefixes(unit) -> list[str]:
    return ["inp", "head"] if unit.name == "" else [unit.name]


def test_ctrl_c_during_a_step_in_flight_leaves_no_unit_torn(world_of_one: None) -> None:
    serial, serial_opt, ours, our_opt, handle, before = second_step_ready()
    stepped = tensors_of(serial, serial_opt)
    with slow_units(0.2):
        our_opt.step()
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        with pytest.raises(KeyboardInterrupt):
            ours(batch(CASE, 1)[0])
        handle.wait()
    for name, tensor in tensors_of(ours, our_opt).items():
        assert torch.equal(tensor, stepped[name]) or torch.equal(tensor, before[name]), f"{name} is torn"


def test_remove_goes_back_to_the_serial_step(world_of_one: None) -> None:
    with slow_units():
        serial, serial_opt, ours, our_opt = stepped_pair()
        handle = our_opt._behind
        handle.remove()
        assert our_opt.__dict__.get("_behind") is None
        for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
            optimizer.zero_grad()
            forward_backward(model, CASE, 1)
            optimizer.step()
        assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "after remove()")


EXIT_SCRIPT = """
import atexit, ctypes, os, sys, torch
import torch.distributed as dist
sys.path.insert(0, {tests!r})
from behind_setup import Case, build, forward_backward, slow_units, tensors_of
from cpu_adam.fsdp2 import step_behind_forward
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
case = Case(dtype=torch.float32, precision="bf16")
serial, serial_opt = build(case)
ours, our_opt = build(case)
step_behind_forward(ours, our_opt)
for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
    forward_backward(model, case, 0)
expected = {{k: v.clone() for k, v in tensors_of(serial, serial_opt).items()}}
serial_opt.step()
expected = {{k: v.clone() for k, v in tensors_of(serial, serial_opt).items()}}
tensors = tensors_of(ours, our_opt)
pointers = {{k: (v.data_ptr(), v.numel() * v.element_size()) for k, v in tensors.items()}}
def check():
    # at exit, through raw pointers as a C library would: every unit stepped
    for k, (address, nbytes) in pointers.items():
        got = bytes(ctypes.string_at(address, nbytes))
        want = expected[k].contiguous().view(torch.uint8).numpy().tobytes()
        print(k, "stepped" if got == want else "NOT STEPPED")
atexit.register(check)
with slow_units(0.3):
    our_opt.step()
    os.environ["DONE"] = "1"
"""


def test_the_interpreter_exits_after_the_step_in_flight(tmp_path: Path) -> None:
    """A script that ends right after step() leaves every unit stepped: the thread keeps the interpreter up."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT.format(tests=str(Path(__file__).parent), port=free_loopback_port()))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.endswith("STEPPED") or line.endswith("stepped")]
    assert lines and all(line.endswith(" stepped") for line in lines), out.stdout


THREAD_READS = {
    "model.state_dict()": lambda m, o: plain(m.state_dict()),
    "optimizer.state_dict()": lambda m, o: {
        f"{i}.{k}": v.clone() for i, s in o.state_dict()["state"].items() for k, v in s.items()
    },
}


@pytest.mark.parametrize("read", THREAD_READS, ids=list(THREAD_READS))
def test_state_dicts_taken_on_another_thread_wait(world_of_one: None, read: str) -> None:
    """A checkpointing thread of the trainer's own: the guard is not on its stack, the state dicts' own waits are."""
    got: dict = {}
    with slow_units():
        serial, serial_opt, ours, our_opt = stepped_pair()
        saver = threading.Thread(target=lambda: got.update(THREAD_READS[read](ours, our_opt)))
        saver.start()
        saver.join()
    assert_same(got, THREAD_READS[read](serial, serial_opt), f"{read} on another thread")


def test_a_mode_of_the_trainers_own_pushed_after_the_guard_keeps_its_place(world_of_one: None) -> None:
    """A step behind the forward while the trainer's own torch function mode is on: its mode stays where it was,
    and the guard leaves the stack when its step is done (no guard piles up, step after step)."""
    from torch.overrides import TorchFunctionMode

    class Counting(TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Counting.calls += 1
            return func(*args, **(kwargs or {}))

    serial, serial_opt = build(CASE)
    ours, our_opt = build(CASE)
    step_behind_forward(ours, our_opt)
    depth = torch._C._len_torch_function_stack()
    with slow_units(0.01):
        for step in range(3):
            for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
                forward_backward(model, CASE, step)
                optimizer.step()
                with Counting():
                    optimizer.zero_grad()
    our_opt._behind.wait()
    assert torch._C._len_torch_function_stack() == depth, "guards piled up on the stack"
    assert Counting.calls > 0
    assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "with a mode of the trainer's own")


def test_a_param_outside_every_unit_steps_first_and_its_readers_wait(world_of_one: None) -> None:
    """A param of the optimizer's in no FSDP2 unit (a plain tensor beside the model): stepped first in the queue;
    reading it right after step() waits for it; bitwise the serial step."""
    extras = [nn.Parameter(torch.ones(5)) for _ in range(2)]
    for extra in extras:
        extra.grad = torch.full((5,), 0.5)
    with slow_units():
        serial, serial_opt = build(CASE)
        ours, our_opt = build(CASE)
        serial_opt.add_param_group({"params": [extras[0]]})
        our_opt.add_param_group({"params": [extras[1]]})
        handle = step_behind_forward(ours, our_opt)
        for model, optimizer in ((serial, serial_opt), (ours, our_opt)):
            forward_backward(model, CASE, 0)
            optimizer.step()
        assert handle._in_flight.names[0] == "outside FSDP2's units"
        read = extras[1].detach().clone()
        handle.wait()
    assert torch.equal(read, extras[0].detach()) and not torch.equal(read, torch.ones(5))
    assert_same(tensors_of(ours, our_opt), tensors_of(serial, serial_opt), "with a param outside the units")
