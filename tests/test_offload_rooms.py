"""The seams of the offload core that stepping during backward and storage tiers build on.

The stepper steps any subset of chunks, in any order, each with the scale it is given, and counts
steps per chunk; the store is an interface whose export and load round-trip; each bucket's pinned
slot goes through explicit states. Checked bitwise against the optimizer's own serial step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import raw
from offload_helpers import CopyingCPU, batches, lm_loss, make_model

from cpu_adam import OffloadOptimizer, offload
from cpu_adam.offload.link import Slot
from cpu_adam.offload.store import HostStore, Store
from cpu_adam.offload.world import World

HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01, bucket_size=1024)


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(offload.stepper, "KERNEL_CHUNK", 2048)  # the tiny model spans several chunks


def _built(last_loss_scale: float = 1.0, **options) -> tuple[torch.nn.Module, OffloadOptimizer]:
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER, **options)
    for tokens in batches(2):  # a first step, so that the moments and step counts are not all zero
        lm_loss(model, tokens).backward()
        opt.step()
    (lm_loss(model, batches(3)[2]) * last_loss_scale).backward()
    return model, opt


def _state(model: torch.nn.Module, opt: OffloadOptimizer) -> list[torch.Tensor]:
    return [raw(p) for p in model.parameters()] + [raw(t) for t in opt._rooms.store.export(0).values()]


def _step_by_hand(opt: OffloadOptimizer, chunks: list, scales: list[float]) -> None:
    """What ``step()`` does, for the given chunks only, each with its own scale."""
    opt._rooms.link.wait_all()
    opt._rooms.model.sync_masters(opt._rooms.store)
    finished = opt._rooms.window.finish(None)
    for chunk, scale in zip(chunks, scales):
        hyper = opt._hyper(chunk.group, scale)
        opt._rooms.stepper.step(chunk, hyper, finished.grads, finished.got[chunk.group])
        for b in range(chunk.first, chunk.last):
            opt._rooms.link.up(chunk.group, b, finished.got[chunk.group])
    opt._new_window()


def test_chunks_stepped_in_reverse_order_give_the_serial_step(small_chunks: None):
    model, opt = _built()
    opt.step()
    expected = _state(model, opt)
    model, opt = _built()
    chunks = opt._rooms.stepper.chunks[0]
    assert len(chunks) >= 3
    _step_by_hand(opt, chunks[::-1], [1.0] * len(chunks))
    assert all(torch.equal(a, b) for a, b in zip(_state(model, opt), expected))


def test_a_subset_of_chunks_steps_those_params_alone_and_counts_their_steps(small_chunks: None):
    model, opt = _built()
    opt.step()
    stepped_weights = [raw(p) for p in model.parameters()]
    model, opt = _built()
    before = [raw(p) for p in model.parameters()]
    steps_before = list(opt._rooms.store.steps[0])
    chunk = opt._rooms.stepper.chunks[0][1]
    _step_by_hand(opt, [chunk], [1.0])
    layout = opt._rooms.layouts[0]
    members = {i for i, b in enumerate(layout.bucket_of) if chunk.first <= b < chunk.last}
    params = list(model.parameters())
    index = {id(p): i for i, p in enumerate(opt._rooms.model.params[0])}
    for n, p in enumerate(params):
        i = index[id(p)]
        expected = stepped_weights[n] if i in members else before[n]
        assert torch.equal(raw(p), expected), f"param {i} ({'in' if i in members else 'outside'} the chunk)"
    assert opt._rooms.store.steps[0] == [n + (i in members) for i, n in enumerate(steps_before)]


def test_each_chunk_takes_the_scale_it_is_given(small_chunks: None):
    # Half the loss gives exactly half the grads (a power of two): scale 1 on those equals scale 0.5 on the full ones.
    model, opt = _built(last_loss_scale=0.5)
    opt.step()
    halved = [raw(p) for p in model.parameters()]
    model, opt = _built()
    opt.step()
    full = [raw(p) for p in model.parameters()]
    model, opt = _built()
    chunks = opt._rooms.stepper.chunks[0]
    _step_by_hand(opt, chunks, [0.5] + [1.0] * (len(chunks) - 1))
    first = {i for i, b in enumerate(opt._rooms.layouts[0].bucket_of) if chunks[0].first <= b < chunks[0].last}
    index = {id(p): i for i, p in enumerate(opt._rooms.model.params[0])}
    for n, p in enumerate(model.parameters()):
        expected = halved[n] if index[id(p)] in first else full[n]
        assert torch.equal(raw(p), expected)
    assert any(not torch.equal(a, b) for a, b in zip(halved, full)), "the scale must matter"


def test_the_host_store_is_a_store_whose_export_and_load_round_trip():
    _, opt = _built(state_precision="8bit")
    opt.step()
    store = opt._rooms.store
    assert isinstance(store, HostStore)
    assert all(
        callable(getattr(store, name)) for name in Store.__dict__ if not name.startswith("_") and name != "steps"
    )
    saved = {k: v.clone() for k, v in store.export(0).items()}
    steps = list(store.steps[0])
    master, states = store.nbytes()
    stats = opt.memory_stats()
    assert (master, states) == (stats["master_bytes"], stats["state_bytes"])
    fresh = HostStore(opt._rooms.layouts, torch.float32, torch.uint8)
    fresh.load(0, saved, steps)
    assert all(torch.equal(fresh.export(0)[k], v) for k, v in saved.items()) and fresh.steps[0] == steps
    view = fresh.views(0, slice(256, 768))
    assert view.master.data_ptr() == fresh.export(0)["master"][256:].data_ptr()
    assert view.scales.shape == (2, 2)


def test_each_slot_goes_through_explicit_states(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(offload.rooms, "DeviceOps", CopyingCPU)
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), **HYPER)
    link = opt._rooms.link
    assert set(link.slots.values()) == {Slot.EMPTY}
    lm_loss(model, batches(1)[0]).backward()
    assert set(link.slots.values()) <= {Slot.RECEIVING, Slot.GRADS} and Slot.RECEIVING in set(link.slots.values())
    link.wait_all()
    assert set(link.slots.values()) == {Slot.GRADS}
    opt.step()
    assert set(link.slots.values()) == {Slot.UPLOADING}
    link.writable(0, 0)
    assert link.slots[(0, 0)] == Slot.WEIGHTS
    lm_loss(model, batches(1)[0]).backward()
    assert Slot.RECEIVING in set(link.slots.values())
    receiving = next(key for key, state in link.slots.items() if state == Slot.RECEIVING)
    with pytest.raises(RuntimeError, match="uploaded while its grads land"):
        link._upload(*receiving, [True] * len(opt._rooms.model.params[0]), link.buffers[receiving[0]].tensor)


class _PeerFailsOnce(World):
    """A world of one whose end-of-backward all-reduce reports, once, that rank 1 of 2 failed."""

    size = 2

    def __init__(self) -> None:
        self.calls = 0

    def max_over_ranks(self, values: list[int]) -> list[int]:
        self.calls += 1
        return [*values[:-1], 2] if self.calls == 1 else values


def test_a_window_a_peer_failed_in_stays_failed_until_zero_grad():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), lr=1e-3, bucket_size=1024)
    opt._rooms.window._world = _PeerFailsOnce()
    data = batches(3)
    with pytest.raises(RuntimeError, match="the backward of rank 1 of 2 raised"):
        lm_loss(model, data[0]).backward()
    with pytest.raises(RuntimeError, match="the backward of rank 1 of 2 raised"):
        lm_loss(model, data[1]).backward()  # another micro-batch, without zero_grad: still refused
    with pytest.raises(RuntimeError, match="the backward of rank 1 of 2 raised"):
        opt.step()
    opt.zero_grad()
    lm_loss(model, data[2]).backward()
    opt.step()
    assert opt._rooms.store.steps[0] == [1] * len(opt._rooms.store.steps[0])
    opt.close()
