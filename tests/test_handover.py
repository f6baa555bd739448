"""OffloadOptimizer(params, device=...): a model built on the CPU or the meta device, handed over."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import AdamWOracle, GradTap, TinyLM, assert_matches_oracle, batches, lm_loss, make_model

from cpu_adam.offload import OffloadOptimizer

HYPER = dict(lr=1e-3, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
BUCKET = 1024


def test_an_fp32_cpu_model_keeps_its_fp32_values_as_masters_and_trains_as_adamw():
    model = make_model(0, dtype=torch.float32)
    params = list(model.parameters())
    fp32 = [p.detach().clone() for p in params]
    oracle = AdamWOracle([{"params": params}], **HYPER)  # masters from the fp32 values
    tap = GradTap(params)
    opt = OffloadOptimizer(params, **HYPER, bucket_size=BUCKET, device="cpu")
    assert list(model.parameters()) == params, "the model keeps its Parameter objects"
    assert all(p.dtype == torch.bfloat16 for p in params)
    assert all(torch.equal(m, v) for m, v in zip(opt.master_weights(), fp32)), "masters are the fp32 values, exactly"
    opt.load_state_dict(opt.state_dict())  # accelerate's prepare: no tensors, and the fp32 masters stay
    assert all(torch.equal(m, v) for m, v in zip(opt.master_weights(), fp32))
    for tokens in batches(6):
        lm_loss(model, tokens).backward()
        oracle.step(tap.take())
        opt.step()
        assert_matches_oracle(opt, params, oracle)


def _meta_model() -> TinyLM:
    with torch.device("meta"):
        return TinyLM()


def test_a_meta_model_steps_only_once_its_weights_are_loaded():
    model = _meta_model()
    opt = OffloadOptimizer(model.parameters(), **HYPER, bucket_size=BUCKET, device="cpu")
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.head.weight is model.emb.weight, "tied weights stay tied"
    with pytest.raises(RuntimeError, match=r"meta device.*still all NaN.*load_state_dict"):
        opt.step()
    model.fc1.weight.data.normal_()  # an init through .data (as HF's _init_weights) is seen too
    with pytest.raises(RuntimeError, match="still all NaN"):
        opt.step()

    reference = make_model(0)
    model.load_state_dict(reference.state_dict())
    ref_opt = OffloadOptimizer(reference.parameters(), **HYPER, bucket_size=BUCKET)
    for tokens in batches(3):
        for m, o in ((model, opt), (reference, ref_opt)):
            lm_loss(m, tokens).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(opt.master_weights(), ref_opt.master_weights()))


def test_handing_over_refuses_what_it_cannot_move():
    model = make_model(0, dtype=torch.float32)
    model.fc1.weight = torch.nn.Parameter(torch.empty(64, 32, device="meta"))
    with pytest.raises(RuntimeError, match="some params are on the meta device and some are not"):
        OffloadOptimizer(model.parameters(), device="cpu")
    buffer = torch.zeros(20)
    views = [torch.nn.Parameter(buffer[:10]), torch.nn.Parameter(buffer[10:15]), torch.nn.Parameter(buffer[5:8])]
    with pytest.raises(RuntimeError, match="share memory"):
        OffloadOptimizer(views, device="cpu")
