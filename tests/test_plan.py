"""cpu_adam.plan: the planner's bytes are the bytes real optimizers hold, configs are read as transformers
builds them, and bad input gets a message that names the fix, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from offload_helpers import CopyingCPU, batches, lm_loss, make_model
from torch import nn

from cpu_adam import CPUAdam, OffloadOptimizer, offload
from cpu_adam.offload.schedule import OPEN_BUCKETS
from cpu_adam.plan import PlanError, from_config, parse_bytes, parse_count, plan, plan_fsdp2
from cpu_adam.plan.__main__ import main
from cpu_adam.plan.probe import measure_bandwidth

ROOT = Path(__file__).resolve().parent.parent
BUDGET = dict(gpu_memory="1GiB", host_memory="1GiB", probe_seconds=0)  # no detection, no probe
MASTERS = {"fp32": torch.float32, "bf16": torch.bfloat16}
STAT_KEYS = (
    "params",
    "host_bytes",
    "master_bytes",
    "state_bytes",
    "pinned_bytes",
    "accumulator_bytes",
    "overlap_bytes",
    "weights_bytes",
)


class Odd(nn.Module):
    """Sizes that are no multiple of 256, a bias-free layer, a 1-element param; nothing tied."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(37, 53)
        self.b = nn.Linear(53, 3, bias=False)
        self.scale = nn.Parameter(torch.ones(1))


def odd() -> nn.Module:
    torch.manual_seed(0)
    return Odd().to(torch.bfloat16)


def embedding_past_a_bucket() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(100, 33), nn.Linear(33, 7)).to(torch.bfloat16)  # 3300 > bucket_size


def two_groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}]


MODELS = {
    "tied TinyLM": lambda: make_model(0),
    "odd sizes": odd,
    "embedding past a bucket": embedding_past_a_bucket,
    "two param groups": lambda: two_groups(make_model(0)),
}


def assert_plan_is_held(opt: OffloadOptimizer, row) -> None:
    stats = opt.memory_stats()
    assert {k: getattr(row, k) for k in STAT_KEYS} == {k: stats[k] for k in STAT_KEYS}


@pytest.mark.parametrize("overlap", ["none", "backward"])
@pytest.mark.parametrize("name", MODELS)
def test_the_planned_host_bytes_are_what_each_optimizer_holds(name: str, overlap: str):
    model = MODELS[name]()
    rows = plan(model, **BUDGET, bucket_size=1024, overlap=overlap)
    assert [(r.state_precision, r.master_dtype) for r in rows] == [
        (p, m) for p in ("fp32", "bf16", "8bit") for m in ("fp32", "bf16")
    ]
    for row in rows:
        params = model.parameters() if isinstance(model, nn.Module) else model
        opt = OffloadOptimizer(
            params,
            state_precision=row.state_precision,
            master_weights_dtype=MASTERS[row.master_dtype],
            bucket_size=1024,
            overlap=overlap,
        )
        try:
            assert_plan_is_held(opt, row)
        finally:
            opt.close()


@pytest.mark.parametrize("count", [1000, "3000"])  # the second spans buckets of 1024
def test_a_count_plans_params_of_at_most_a_bucket(count):
    n = int(count)
    params = [torch.zeros(k, dtype=torch.bfloat16, requires_grad=True) for k in (1024,) * (n // 1024) + (n % 1024,)]
    opt = OffloadOptimizer(params, state_precision="8bit", bucket_size=1024)
    row = plan(count, **BUDGET, bucket_size=1024)[4]
    assert_plan_is_held(opt, row)
    assert row.grad_buffer_bytes == (OPEN_BUCKETS + 2) * 1024 * 2  # open and in-flight bf16 buckets
    opt.close()


def test_a_large_count_is_planned_at_once():
    row = plan("10T", **BUDGET)[0]
    assert row.params == 10**13 and row.host_bytes == pytest.approx(14 * 10**13, rel=1e-9)
    assert row.grad_buffer_bytes == (OPEN_BUCKETS + 2) * 2**23 * 2


def test_the_accumulator_is_planned_as_gradient_accumulation_allocates_it():
    model = make_model(0)
    opt = OffloadOptimizer(model.parameters(), state_precision="8bit", bucket_size=1024)
    for tokens in batches(2):  # two micro-batches, one step
        lm_loss(model, tokens).backward()
    opt.step()
    row = plan(model, **BUDGET, bucket_size=1024, accumulation=True)[4]
    assert (row.state_precision, row.master_dtype) == ("8bit", "fp32")
    assert row.accumulator_bytes > 0
    assert_plan_is_held(opt, row)
    opt.close()


def test_frozen_params_are_on_the_device_but_not_in_host_memory():
    model = odd()
    model.a.bias.requires_grad_(False)
    opt = OffloadOptimizer(model.parameters(), bucket_size=1024)
    row = plan(model, **BUDGET, bucket_size=1024)[0]
    stats = opt.memory_stats()
    assert row.host_bytes == stats["host_bytes"] and row.params == stats["params"]
    assert row.weights_bytes == stats["weights_bytes"] + 2 * model.a.bias.numel()
    opt.close()


class SlowCopies(CopyingCPU):
    """The CPU as a GPU whose copies down never finish before the host waits for them: buckets pile up."""

    def record(self) -> object:
        return object()

    def done(self, event: object) -> bool:
        return event is None

    def wait_host(self, event: object) -> None:
        pass

    def compute_waits(self, event: object) -> None:
        pass


@pytest.mark.parametrize("inflight", [1, 3])
def test_the_planned_grad_buffers_are_the_device_peak_when_buckets_pile_up(monkeypatch, inflight: int):
    # Every bucket holds one used and one unused layer, so none fills: each is flushed early, the worst case.
    monkeypatch.setattr(offload.rooms, "DeviceOps", SlowCopies)
    width, layers = 32, 16  # 8 buckets: more than any pile-up below
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)]).to(torch.bfloat16)
    params = [p for pair in zip(model[: layers // 2].parameters(), model[layers // 2 :].parameters()) for p in pair]
    bucket = 2 * width * width
    opt = OffloadOptimizer(params, bucket_size=bucket, max_inflight_buckets=inflight)
    model[: layers // 2](torch.randn(4, width, dtype=torch.bfloat16)).float().sum().backward()
    row = plan(params, **BUDGET, bucket_size=bucket, max_inflight_buckets=inflight)[0]
    assert opt.memory_stats()["device_peak_bytes"] == row.grad_buffer_bytes
    assert row.device_bytes == row.weights_bytes + row.grad_buffer_bytes
    opt.step()
    opt.close()


def test_with_copies_that_keep_up_the_device_peak_stays_under_the_plan(monkeypatch):
    monkeypatch.setattr(offload.rooms, "DeviceOps", CopyingCPU)
    model = embedding_past_a_bucket()
    opt = OffloadOptimizer(model.parameters(), bucket_size=1024)
    model(torch.randint(100, (4, 5))).float().sum().backward()
    opt.step()
    peak = opt.memory_stats()["device_peak_bytes"]
    assert 0 < peak <= plan(model, **BUDGET, bucket_size=1024)[0].grad_buffer_bytes
    opt.close()


def test_fits_judges_each_side_and_says_when_one_is_unknown():
    host_14 = 14 * 2**20  # fp32/fp32 host bytes of 2^20 params
    rows = plan(2**20, gpu_memory=2**30, host_memory=host_14, probe_seconds=0)
    assert rows[0].host_bytes == host_14 and rows[0].fits is True
    assert all(r.fits for r in rows)
    assert plan(2**20, gpu_memory=2**20, host_memory="1GiB", probe_seconds=0)[0].fits is False
    assert plan(2**20, gpu_memory=2**30, host_memory=host_14 - 1, probe_seconds=0)[0].host_fits is False
    row = plan(2**20, gpu_memory=None, host_memory="1GiB", probe_seconds=0)[0]
    if not torch.cuda.is_available():
        assert row.gpu_fits is None and row.fits is None and row.gpu_left is None


def test_the_step_estimate_scales_with_the_bytes_each_configuration_moves():
    rows = plan("1B", **{**BUDGET, "probe_seconds": 0}, bandwidth=10e9)
    moved = {(r.state_precision, r.master_dtype): r.step_bytes_per_param for r in rows}
    assert moved[("fp32", "fp32")] == 2 * 4 + 4 * 4 + 2 + 2
    assert moved[("bf16", "bf16")] == 2 * 2 + 4 * 2 + 2  # a bf16 master is the weight: no bf16 copy written
    assert moved[("8bit", "fp32")] == 2 * 4 + 4 * 1 + 2 * 2 * 4 / 256 + 2 + 2
    for r in rows:
        factor = {"fp32": 2.0, "bf16": 3.8}[r.master_dtype] if r.state_precision == "8bit" else 1.0
        assert r.step_seconds == pytest.approx(r.step_bytes_per_param * 1e9 / 10e9 * factor, rel=1e-3)


def test_the_bandwidth_probe_is_short_and_plausible():
    bandwidth = measure_bandwidth(0.05, elements=1 << 20)
    assert 1e8 < bandwidth < 1e13


# -- config.json -----------------------------------------------------------------------------

GPT2 = dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=32)
LLAMA = dict(
    model_type="llama",
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=101,
)
CONFIGS = {
    "gpt2 tied": GPT2,
    "gpt2 untied": {**GPT2, "tie_word_embeddings": False, "n_inner": 80},
    "llama untied": LLAMA,
    "llama tied, biases": {**LLAMA, "tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    "qwen2": {**LLAMA, "model_type": "qwen2"},
}


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def transformers_model(path: Path) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(str(path)))


@pytest.mark.parametrize("name", CONFIGS)
def test_a_config_is_read_as_transformers_builds_it(tmp_path: Path, name: str):
    path = write_config(tmp_path, CONFIGS[name])
    spec = from_config(path)
    model = transformers_model(path)
    assert spec.groups == [[tuple(p.shape) for p in model.parameters()]]
    tied = CONFIGS[name].get("tie_word_embeddings", name.startswith("gpt2"))
    vocab_rows = sum(1 for g in spec.groups for s in g if s[0] == 101)
    assert vocab_rows == (1 if tied else 2)


def test_a_config_plans_the_bytes_of_the_optimizer_on_its_model(tmp_path: Path):
    path = write_config(tmp_path, CONFIGS["gpt2 tied"])
    model = transformers_model(path)  # on the meta device: the optimizer gives it storage on the CPU
    opt = OffloadOptimizer(model.parameters(), device="cpu", bucket_size=4096, state_precision="bf16")
    row = plan(tmp_path, **BUDGET, bucket_size=4096)[2]  # the folder holding config.json
    assert row.state_precision == "bf16"
    assert_plan_is_held(opt, row)
    opt.close()


def test_another_model_type_is_built_by_transformers(tmp_path: Path):
    pytest.importorskip("transformers")
    config = dict(model_type="gpt_neox", hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    path = write_config(tmp_path, {**config, "num_attention_heads": 4, "vocab_size": 101})
    spec = from_config(path)
    assert "transformers" in spec.source
    assert spec.params == sum(p.numel() for p in transformers_model(path).parameters())


def test_without_transformers_another_model_type_names_the_ways_out(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers raises ImportError
    path = write_config(tmp_path, {"model_type": "gpt_neox", "hidden_size": 64})
    with pytest.raises(PlanError, match=r"'gpt_neox'.*pip install transformers.*--params.*plan\(model\)"):
        from_config(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ({"model_type": "llama", "hidden_size": 64}, r"lacks intermediate_size, num_hidden_layers.*--params"),
        ({**GPT2, "n_layer": -2}, r"lacks n_layer \(has n_layer=-2\)"),
        ({**LLAMA, "num_attention_heads": 5}, r"no whole head size"),
        ("{not json", r"is not JSON"),
        ([1, 2], r"not a config object"),
    ],
)
def test_a_bad_config_is_refused_naming_the_problem(tmp_path: Path, content, message: str):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(PlanError, match=message):
        from_config(path)


# -- sizes and the command line --------------------------------------------------------------


def test_sizes_are_read_as_written():
    assert parse_count("1.3B") == 1_300_000_000
    assert [parse_count(x) for x in ("350M", "125k", "7e9", "2^24", "1_000", 12)] == [
        350_000_000,
        125_000,
        7_000_000_000,
        1 << 24,
        1000,
        12,
    ]
    assert [parse_bytes(x, "x") for x in ("80GiB", "80GB", "80G", "512 MiB", 4096)] == [
        80 << 30,
        80 * 10**9,
        80 << 30,
        512 << 20,
        4096,
    ]


@pytest.mark.parametrize(
    ("value", "message"),
    [(-5, "a positive count"), ("0", "from 1 to"), ("1.5", "whole"), ("lots", "such as 1.3B"), (True, "a number")],
)
def test_a_bad_count_is_refused(value, message: str):
    with pytest.raises(PlanError, match=message):
        parse_count(value)


def test_a_bad_size_is_refused_by_name():
    with pytest.raises(PlanError, match=r"host_memory must be a size such as 80GiB.*got '80 gigs'"):
        plan(100, host_memory="80 gigs", gpu_memory="1GiB", probe_seconds=0)
    with pytest.raises(PlanError, match="gpu_memory must be a positive size"):
        plan(100, host_memory="1GiB", gpu_memory="-1GiB", probe_seconds=0)
    with pytest.raises(PlanError, match="overlap must be one of"):
        plan(100, **BUDGET, overlap="forward")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--params=-5"], "a positive count"),
        (["--params", "1.3B", "--gpu-memory", "80Gx"], "--gpu-memory must be a size"),
        (["--config", "no/such/config.json"], "cannot read"),
        (["--params", "1B", "--config", "c.json"], "not allowed with"),
    ],
)
def test_the_command_line_refuses_bad_input_with_exit_code_2(capsys, args: list[str], message: str):
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--probe-seconds", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_command_line_prints_the_table():
    command = [sys.executable, "-m", "cpu_adam.plan", "--params", "1.3B", "--gpu-memory", "80GiB"]
    done = subprocess.run([*command, "--host-memory", "125GiB"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert table[0].split("|")[1].strip() == "states" and len(table) == 7
    fp32 = table[1].split("|")
    assert [c.strip() for c in fp32[1:5]] == ["fp32", "fp32", "16.95", "14.00"]
    assert "yes" in fp32[7] and "(estimate)" in fp32[8]
    assert any("Activations" in line for line in lines)


def test_the_command_line_config_and_json(tmp_path: Path, capsys):
    path = write_config(tmp_path, CONFIGS["llama untied"])
    main(["--config", str(path), "--gpu-memory", "1GiB", "--host-memory", "1GiB", "--probe-seconds", "0", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 6 and rows[0]["params"] == from_config(path).params and rows[0]["fits"] is True


def test_the_model_is_the_positional_argument_as_a_user_types_it_first(tmp_path: Path, capsys):
    main(["7e9", "--gpu-memory", "80GiB", "--host-memory", "125GiB", "--probe-seconds", "0", "--json"])
    assert json.loads(capsys.readouterr().out)[0]["params"] == 7_000_000_000
    path = write_config(tmp_path, CONFIGS["llama untied"])
    main([str(path.parent), "--gpu-memory", "1GiB", "--host-memory", "1GiB", "--probe-seconds", "0", "--json"])
    assert json.loads(capsys.readouterr().out)[0]["params"] == from_config(path).params
    for args, message in ((["conifg.json"], "neither a parameter count"), ([], "give the model once")):
        with pytest.raises(SystemExit) as exit_:
            main([*args, "--probe-seconds", "0"])
        assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("fraction", [0.4, 1.0])
@pytest.mark.parametrize("grouped", [False, True], ids=["one group", "two param groups"])
def test_the_planned_device_share_is_what_the_optimizer_holds_on_the_device(grouped: bool, fraction: float):
    pytest.importorskip("triton", reason="the device kernel is written in Triton")
    model = make_model(0)
    params = two_groups(model) if grouped else list(model.parameters())
    for row in plan(params, **BUDGET, bucket_size=1024, device_fraction=fraction):
        master = MASTERS[row.master_dtype]
        opt = OffloadOptimizer(
            params,
            state_precision=row.state_precision,
            master_weights_dtype=master,
            stochastic_rounding=master == torch.bfloat16,
            bucket_size=1024,
            device_fraction=fraction,
        )
        lm_loss(model, batches(1)[0]).backward()
        opt.step()
        stats = opt.memory_stats()
        opt.close()
        assert stats["device_share"] == pytest.approx(row.device_share)
        assert stats["device_state_bytes"] == row.device_state_bytes
        assert (
            row.device_bytes
            == row.weights_bytes + row.grad_buffer_bytes + row.device_state_bytes + row.device_grads_bytes
        )


# -- FSDP2 with CPU offload and CPUAdam ----------------------------------------------------------


def _fsdp2_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)  # 33 and 9 rows do not split evenly over 2 ranks: padded shards
    return nn.Sequential(nn.Linear(12, 33), nn.Tanh(), nn.Linear(33, 9), nn.Linear(9, 1, bias=False)).to(dtype)


def _held_by_each_rank(rank: int, world_size: int, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    held = {}
    for shard_name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        for precision in ("fp32", "bf16", "8bit"):
            model = _fsdp2_model(dtype)
            mesh = init_device_mesh("cpu", (world_size,))
            for layer in model:
                if any(True for _ in layer.parameters()):
                    fully_shard(layer, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
            try:
                opt = CPUAdam(
                    model.parameters(), state_precision=precision, stochastic_rounding=dtype == torch.bfloat16
                )
            except ValueError:  # a precision CPUAdam does not take on DTensor params: nothing to compare
                continue
            model(torch.randn(4, 12, dtype=dtype)).float().sum().backward()
            opt.step()
            params = list(model.parameters())
            state = [t for p in params for k, t in opt.state[p].items() if k != "step"]
            parts = [[p.to_local() for p in params], [p.grad.to_local() for p in params], [_local(t) for t in state]]
            sizes = torch.tensor([sum(t.nbytes for t in part) for part in parts], dtype=torch.int64)
            every = [torch.zeros_like(sizes) for _ in range(world_size)]
            torch.distributed.all_gather(every, sizes)
            assert all(t.device.type == "cpu" and t.dtype == dtype for t in parts[0] + parts[1])
            held[shard_name, precision] = max(every, key=lambda s: int(s.sum())).tolist()  # the rank holding most
    if rank == 0:
        torch.save(held, out)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.mark.dist
def test_the_fsdp2_plan_is_what_each_rank_holds(tmp_path: Path):
    from rank_spawn import run_ranks

    run_ranks(_held_by_each_rank, str(tmp_path / "held.pt"))
    held = torch.load(tmp_path / "held.pt")
    assert len(held) == 6
    rows = {(r.shard_dtype, r.state_precision): r for r in plan_fsdp2(_fsdp2_model(torch.float32), 2, **BUDGET)}
    for key, (weights, grads, states) in held.items():
        row = rows[key]
        assert (row.weight_bytes, row.grad_bytes, row.state_bytes) == (weights, grads, states), key
    assert rows["fp32", "fp32"].rank_params == 17 * 12 + 17 + 5 * 33 + 5 + 9  # ceil(rows / 2) of each param


def _blocks_touched(start: int, stop: int) -> int:
    """The 256-element blocks of a whole param that its elements [start, stop) touch: a scale for each."""
    return (stop - 1) // 256 - start // 256 + 1 if stop > start else 0


def _held_by_the_fullest_rank(model: nn.Module, world_size: int, precision: str) -> tuple[int, int]:
    """(elements, 8-bit state bytes) of the rank holding the most bytes, from its shards as torch.chunk cuts
    each param's rows (FSDP2's Shard(0)), fp32 shards."""
    held = []
    for rank in range(world_size):
        elements = blocks = 0
        for p in model.parameters():
            rows, row = p.shape[0], p[0].numel()
            chunks = torch.arange(rows).chunk(world_size)
            mine = chunks[rank] if rank < len(chunks) else torch.arange(0)
            start, stop = (int(mine[0]) * row, (int(mine[-1]) + 1) * row) if len(mine) else (0, 0)
            elements += stop - start
            blocks += _blocks_touched(start, stop)
        state = 2 * elements + 8 * blocks if precision == "8bit" else 2 * 4 * elements
        held.append((2 * 4 * elements + state, elements, state))
    _, elements, state = max(held)
    return elements, state


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_fsdp2_plan_counts_the_blocks_that_shards_starting_inside_one_touch(world_size: int):
    """A shard starting inside an 8-bit block has a scale for its part of that block: 8 bytes more than an aligned
    shard of its size. 34 rows of 12 split evenly over 2 ranks (and 9 rows over 4): the rank holding the most
    starts inside a block, and the plan counted its blocks as if it started on one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 34, bias=False), nn.Linear(34, 300, bias=False))
    for row in plan_fsdp2(model, world_size, **BUDGET):
        if row.shard_dtype == "fp32" and row.state_precision in ("fp32", "8bit"):
            expected = _held_by_the_fullest_rank(model, world_size, row.state_precision)
            assert (row.rank_params, row.state_bytes) == expected, row.state_precision


def test_more_ranks_per_host_than_the_world_size_plans_the_world_size(capsys):
    """A host holds at most the world's ranks: --ranks-per-host 8 at world size 2 plans the 2 ranks' RAM (104 GiB
    for 7B in fp32, which fits 150 GiB), not 8 ranks' 417 GiB that do not."""
    budget = ["--gpu-memory", "80GiB", "--host-memory", "150GiB", "--unit-params", "1B", "--probe-seconds", "0"]
    rows = {}
    for per_host in ("8", "2"):
        main(["7B", "--fsdp2", "--world-size", "2", "--ranks-per-host", per_host, *budget, "--json"])
        rows[per_host] = json.loads(capsys.readouterr().out)
    fp32 = rows["8"][0]
    assert (fp32["shard_dtype"], fp32["state_precision"], fp32["ranks_per_host"]) == ("fp32", "fp32", 2)
    assert fp32["host_bytes"] == 2 * fp32["rank_bytes"] == 16 * 7 * 10**9 and fp32["fits"] is True
    assert rows["8"] == rows["2"]


def test_the_fsdp2_units_are_a_config_models_layers(tmp_path: Path):
    for name, config in CONFIGS.items():
        spec = from_config(write_config(tmp_path, config))
        layers = config.get("n_layer") or config["num_hidden_layers"]
        assert sum(spec.units) == spec.params, name
        assert len(set(spec.units[-layers - 2 :])) > 1 and spec.units.count(spec.units[-3]) >= layers - 1, name


def test_the_fsdp2_units_are_transformers_layers(tmp_path: Path):
    path = write_config(tmp_path, CONFIGS["llama untied"])
    model = transformers_model(path)  # skips without transformers
    d, vocab = LLAMA["hidden_size"], LLAMA["vocab_size"]
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in model.model.layers]
    assert from_config(path).units == (vocab * d, *per_layer, d + vocab * d)


def test_the_fsdp2_plan_per_rank_per_host_and_per_unit():
    rows = plan_fsdp2("70B", 8, **BUDGET, bandwidth=28e9)
    fp32 = rows[0]
    assert (fp32.shard_dtype, fp32.state_precision, fp32.ranks_per_host) == ("fp32", "fp32", 8)
    assert fp32.rank_bytes == 16 * 70e9 / 8 and fp32.host_bytes == 8 * fp32.rank_bytes
    assert fp32.unit_params is None and fp32.gpu_bytes is None and fp32.fits is False  # the host cannot hold it
    bf16 = next(r for r in rows if (r.shard_dtype, r.state_precision) == ("bf16", "bf16"))
    assert bf16.host_bytes_per_param == 8 and bf16.step_seconds == pytest.approx(fp32.step_seconds / 2)
    assert fp32.step_seconds == pytest.approx(28 * 70e9 / 8 * 8 / 28e9)  # a host's 8 ranks share its bandwidth
    one = plan_fsdp2("70B", 8, **BUDGET, ranks_per_host=1, unit_params="1B", bandwidth=28e9)[0]
    assert one.step_seconds == pytest.approx(fp32.step_seconds / 8) and one.host_bytes == one.rank_bytes
    assert one.gpu_bytes == 2 * 2 * 10**9 + 4 * 10**9 + 4 * 10**9 // 8  # gathered bf16 x2, fp32 grads, their shard
    with pytest.raises(PlanError, match="world size"):
        plan_fsdp2("7B", 0, **BUDGET)


def test_the_command_line_plans_fsdp2(tmp_path: Path, capsys):
    main(
        [
            "70B",
            "--fsdp2",
            "--world-size",
            "8",
            "--gpu-memory",
            "80GiB",
            "--host-memory",
            "2TiB",
            "--probe-seconds",
            "0",
        ]
    )
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert (
        len(table) == 7 and table[0].split("|")[1].strip() == "shards" and table[1].split("|")[-2].strip() == ""
    )  # no probe, no estimate
    assert [c.strip() for c in table[1].split("|")[1:6]] == ["fp32", "fp32", "130.39", "16.00", "1,043.08"]
    path = write_config(tmp_path, CONFIGS["llama untied"])
    budget = ["--gpu-memory", "1GiB", "--host-memory", "1GiB", "--probe-seconds", "0", "--json"]
    main([str(path), "--fsdp2", "--world-size", "2", *budget])
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 6 and rows[0]["unit_params"] == max(from_config(path).units) and rows[0]["fits"] is True
    with pytest.raises(SystemExit) as exit_:
        main(["7B", "--fsdp2", "--world-size", "0", "--probe-seconds", "0"])
    assert exit_.value.code == 2 and "world size" in capsys.readouterr().err


def _forward_waits(step: float, forward: float, shares: list[float]) -> float:
    """An independent count of what a forward waits for a step behind it, unit by unit: unit k's forward runs once
    units 0..k are stepped (the host steps them in order), each taking its share of each."""
    stepped_until = [sum(shares[: k + 1]) * step for k in range(len(shares))]
    now, waited = 0.0, 0.0
    for k, share in enumerate(shares):
        if now < stepped_until[k]:
            waited += stepped_until[k] - now
            now = stepped_until[k]
        now += share * forward
    return waited


@pytest.mark.parametrize(
    ("step", "forward", "shares"),
    [(0.2, 0.127, [0.08] + [0.92 / 24] * 24), (0.05, 0.127, [0.08] + [0.92 / 24] * 24), (1.0, 1.0, [0.5, 0.25, 0.25])],
    ids=["step longer than the forward", "step shorter", "units of other sizes"],
)
def test_the_exposed_time_behind_the_forward_is_what_the_forward_waits(
    step: float, forward: float, shares: list[float]
) -> None:
    from cpu_adam.plan.fsdp2 import exposed_behind

    expected = _forward_waits(step, forward, shares)
    assert abs(exposed_behind(step, forward, shares) - expected) < 1e-12
    assert exposed_behind(step, forward, shares) >= step * shares[0] - 1e-12  # the first unit's step, at least
