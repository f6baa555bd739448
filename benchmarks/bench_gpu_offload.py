"""End-to-end offload training on one GPU: cpu_adam against torchao, DeepSpeed and GPU-resident AdamW.

All contenders train the same GPT-style decoder (bf16 weights, the same seed, data and batch)
one after another, each in its own process (a contender's leftovers cannot favour or starve the
next). Before them, two probes set the ceilings: a pinned host<->device copy (PCIe GB/s each
way) and cpu_adam's bandwidth probe on every core (the bytes of each host step config with
trivial math). Per contender:

- tokens/s: steps run back to back, no host sync but the last;
- the step split, from steps with a device sync between phases: forward, backward, the
  optimizer's step() call (for cpu_adam: waiting for grads, norm, CPU Adam with its chunked
  uploads) and the upload tail left after step() returned;
- peak device memory (during construction and training), host bytes per param (RSS growth);
- bytes and achieved GB/s of the host<->device copies of one profiled step.

    python benchmarks/bench_gpu_offload.py                       # 1.3B params, seq 2048, batch 8
    python benchmarks/bench_gpu_offload.py --layers 2 --dim 256 --vocab 4096 --seq 256 --batch 2   # a smoke run
    python benchmarks/bench_gpu_offload.py --json gpu.json --plot benchmarks/bench_gpu_offload.png

Contenders (``--contenders``, comma list): torch_adamw (fused AdamW on fp32 masters kept on the
GPU: the ceiling), torchao (``torchao.optim.CPUOffloadOptimizer``, fused CPU AdamW on bf16
host params, grads offloaded; it cannot clip), deepspeed (ZeRO-2, ``offload_optimizer: cpu``,
bf16, one process: DeepSpeedCPUAdam on fp32 masters), and ``OffloadOptimizer`` named by its
settings, ``cpu_adam:MASTER/STATES[/share=F][/bwd][/bucket=K]``: MASTER fp32, bf16 (rounded to
nearest) or sr (bf16 with stochastic rounding), STATES fp32, bf16 or 8bit, ``share=`` the
``device_fraction`` (a number or auto), ``bwd`` for ``overlap="backward"``, ``bucket=K`` a
``bucket_size`` of 2^K elements: ``cpu_adam:sr/bf16/share=auto/bucket=25``. cpu_adam_fp32,
cpu_adam_bf16 and cpu_adam_sr name cpu_adam:fp32/fp32, cpu_adam:fp32/bf16 and cpu_adam:sr/bf16.

FSDP2 with ``CPUOffloadPolicy`` on a world of one, the optimizer stepping the CPU shards:
``fsdp2:adamw`` (fp32 shards, torch's ``AdamW(fused=True)``: torchtitan's default) and
``fsdp2:SHARDS/STATES`` for ``CPUAdam``: SHARDS fp32 (bf16 compute, fp32 grads reduced) or sr (the
model in bf16, its shards the masters, stochastic rounding), STATES fp32, bf16 or 8bit, and
``/inside`` to clip inside ``CPUAdam``'s step (``max_grad_norm``) rather than with torch's
``clip_grad_norm_`` before it; ``fsdp2:adamw-foreach`` is ``AdamW()``'s default. A contender that
is not installed or runs out of memory gets a row that says so.

``--max-grad-norm`` clips every contender that can (default 1.0, as GPT recipes; ``none``: no
clipping; real training clips almost every step, which decides what the offload step can hide).
``--record-timeline DIR`` writes each cpu_adam contender's timeline of one step (forward,
backward, each bucket's landing, the step) to DIR, for ``bench_replay.py --timeline``.

The tables and each contender's raw result go to stdout; a line as each probe and contender
starts and ends, with the time left, goes to stderr (``--quiet``: none).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import Progress
from _gpt import GPT, lm_loss, param_groups

LR, BETAS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 0.1
MAX_NORM: float | None = 1.0  # --max-grad-norm
CONTENDERS = (
    "torch_adamw",
    "torchao",
    "deepspeed",
    "cpu_adam:fp32/fp32",
    "cpu_adam:fp32/bf16",
    "cpu_adam:sr/bf16",
    "cpu_adam:sr/bf16/share=auto",
)
PEER_MODULES = {"torchao": "torchao", "deepspeed": "deepspeed"}
ALIASES = {
    "cpu_adam_fp32": "cpu_adam:fp32/fp32",
    "cpu_adam_bf16": "cpu_adam:fp32/bf16",
    "cpu_adam_sr": "cpu_adam:sr/bf16",
    "fsdp2_adamw": "fsdp2:adamw",
    "fsdp2_cpu_adam": "fsdp2:sr/bf16",
}
FSDP2_ADAMW = {"fsdp2:adamw": True, "fsdp2:adamw-foreach": False}  # fused or not
MASTERS = {"fp32": torch.float32, "bf16": torch.bfloat16, "sr": torch.bfloat16}


def cpu_adam_settings(name: str) -> dict[str, Any] | None:
    """The OffloadOptimizer options a contender's name gives (``cpu_adam:MASTER/STATES[/share=F][/bwd][/bucket=K]``)."""
    name = ALIASES.get(name, name)
    if not name.startswith("cpu_adam:"):
        return None
    master, states, *rest = name.removeprefix("cpu_adam:").split("/")
    if master not in MASTERS or states not in ("fp32", "bf16", "8bit"):
        raise SystemExit(f"{name}: cpu_adam:MASTER/STATES with MASTER fp32, bf16 or sr, STATES fp32, bf16 or 8bit")
    options = dict(master_weights_dtype=MASTERS[master], state_precision=states, stochastic_rounding=master == "sr")
    options["device_fraction"] = 0.0  # all on the host unless share= says otherwise
    for token in rest:
        if token == "bwd":
            options["overlap"] = "backward"
        elif token.startswith("share="):
            share = token.removeprefix("share=")
            options["device_fraction"] = share if share == "auto" else float(share)
        elif token.startswith("bucket=") and token.removeprefix("bucket=").isdigit():
            options["bucket_size"] = 1 << int(token.removeprefix("bucket="))
        else:
            raise SystemExit(f"{name}: {token!r} is none of share=F, bwd, bucket=K")
    return options


def fsdp2_settings(name: str) -> dict[str, Any] | None:
    """The FSDP2 contender a name gives: ``fsdp2:adamw[-foreach]`` or ``fsdp2:SHARDS/STATES[/inside][/behind]``
    (CPUAdam)."""
    name = ALIASES.get(name, name)
    if not name.startswith("fsdp2:"):
        return None
    if name in FSDP2_ADAMW:
        return dict(optimizer="adamw", fused=FSDP2_ADAMW[name], shards=torch.float32)
    shards, states, *rest = [*name.removeprefix("fsdp2:").split("/"), ""]
    rest = [token for token in rest if token]
    if shards not in ("fp32", "sr") or states not in ("fp32", "bf16", "8bit") or set(rest) - {"inside", "behind"}:
        raise SystemExit(
            f"{name}: fsdp2:adamw, fsdp2:adamw-foreach, or fsdp2:SHARDS/STATES[/inside][/behind] with SHARDS fp32 or sr"
        )
    options = dict(state_precision=states, stochastic_rounding=shards == "sr")
    return dict(
        optimizer="cpu_adam", shards=MASTERS[shards], clip_inside="inside" in rest, behind="behind" in rest, **options
    )


def host_step_bytes(options: dict[str, Any]) -> float:
    """Bytes one element of the host's step moves (``cpu_adam.plan``'s count)."""
    from cpu_adam.plan.probe import step_bytes_per_param

    return step_bytes_per_param(options["state_precision"], options["master_weights_dtype"])


def warmup_steps(name: str, asked: int) -> int:
    """``device_fraction="auto"`` steps on the host first and moves the planned share's state to the device at the
    third step: its warm-up lasts until then, or the timed steps would include that one-time move."""
    options = cpu_adam_settings(name) or {}
    return max(asked, 3) if options.get("device_fraction") == "auto" else asked


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def on_cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if on_cuda():
        torch.cuda.synchronize()


def stream_sync() -> None:
    """Waits for the compute stream only: copies on side streams may still run."""
    if on_cuda():
        torch.cuda.current_stream().synchronize()


def device_memory(peak: bool = False) -> int:
    if not on_cuda():
        return 0
    return torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()


# -- the contenders: each returns (step, zero_grad, forward_backward hooks) ------------------------


class Contender:
    """One optimizer setup: ``loss(tokens)``, ``backward(loss)``, ``step()``, ``zero_grad()``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.host_split: dict[str, float] = {}
        self.extra: dict[str, Any] = {}

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.model, tokens)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        raise NotImplementedError

    def zero_grad(self) -> None:
        pass


class TorchAdamW(Contender):
    """bf16 weights for forward/backward, fp32 masters and fused AdamW on the GPU, as mixed-precision recipes do."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        groups = param_groups(model, WEIGHT_DECAY)
        self.params = [p for g in groups for p in g["params"]]
        self.masters = [p.detach().float() for p in self.params]
        master_groups, i = [], 0
        for g in groups:
            n = len(g["params"])
            master_groups.append({**g, "params": self.masters[i : i + n]})
            i += n
        self.opt = torch.optim.AdamW(master_groups, lr=LR, betas=BETAS, fused=True)

    def step(self) -> None:
        for p, m in zip(self.params, self.masters):
            m.grad = p.grad.float()
            p.grad = None
        if MAX_NORM is not None:
            torch.nn.utils.clip_grad_norm_(self.masters, MAX_NORM, foreach=True)
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)

    def zero_grad(self) -> None:
        for m in self.masters:
            m.grad = None


class TorchAO(Contender):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        from torchao.optim import CPUOffloadOptimizer

        # offload_gradients frees each device grad once it is down; no clipping is possible then.
        self.opt = CPUOffloadOptimizer(
            param_groups(model, WEIGHT_DECAY), torch.optim.AdamW, offload_gradients=True, lr=LR, betas=BETAS
        )
        self.extra["note"] = "bf16 host params and bf16 moments (no fp32 master), no clipping"

    def step(self) -> None:
        self.opt.step()

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def _world_of_one() -> None:
    """torch.distributed's environment for one process on a free local port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


class DeepSpeed(Contender):
    def __init__(self, model: torch.nn.Module, batch: int) -> None:
        super().__init__(model)
        _world_of_one()
        import deepspeed

        config = {
            "train_micro_batch_size_per_gpu": batch,
            "gradient_accumulation_steps": 1,
            "bf16": {"enabled": True},
            "gradient_clipping": MAX_NORM or 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu", "pin_memory": True},
                "overlap_comm": True,
                "contiguous_gradients": True,
            },
            "steps_per_print": 1 << 30,
        }
        self.engine, *_ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, WEIGHT_DECAY), config=config
        )
        self.extra["deepspeed"] = deepspeed.__version__

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return lm_loss(self.engine, tokens)

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()


class CpuAdamOffload(Contender):
    def __init__(self, model: torch.nn.Module, options: dict[str, Any]) -> None:
        super().__init__(model)
        from cpu_adam import OffloadOptimizer

        self.opt = OffloadOptimizer(
            param_groups(model, WEIGHT_DECAY), lr=LR, betas=BETAS, max_grad_norm=MAX_NORM, **options
        )
        self.extra["host_step_bytes_per_element"] = host_step_bytes(options)

    def step(self) -> None:
        self.opt.step()
        t = self.opt.step_timings
        self.host_split = {
            "grads_wait": t["grads_wait_s"],
            "cpu_adam": t["norm_s"] + t["adam_s"] - t["device_launch_s"],
            "device_launch": t["device_launch_s"],
        }

    def zero_grad(self) -> None:
        self.opt.zero_grad()

    def finish(self) -> None:
        stats = self.opt.memory_stats()
        self.extra.update(
            host_bytes_per_param_stats=stats["host_bytes_per_param"],
            optimizer_device_peak_bytes=stats["device_peak_bytes"],
            device_share=stats["device_share"],
            device_state_bytes=stats["device_state_bytes"],
            device_streamed_bytes=stats["device_streamed_bytes"],
            clipped=self.opt.max_grad_norm is not None and self.opt.last_grad_norm > self.opt.max_grad_norm,
        )


class FSDP2(Contender):
    """FSDP2 on a world of one with CPUOffloadPolicy: the optimizer steps the shards on the host. fp32 shards compute
    in bf16 and reduce their grads in fp32 (``MixedPrecisionPolicy``), as torchtitan does; bf16 shards are the model's
    own dtype. ``/behind``: CPUAdam's step runs behind the next forward (``cpu_adam.fsdp2.step_behind_forward``)."""

    def __init__(self, model: torch.nn.Module, settings: dict[str, Any]) -> None:
        super().__init__(model)
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _world_of_one()
        dist.init_process_group("nccl" if on_cuda() else "gloo")
        mesh = init_device_mesh("cuda" if on_cuda() else "cpu", (1,))
        shards = settings["shards"]
        model.to(shards)
        mixed = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        policy = dict(offload_policy=CPUOffloadPolicy(pin_memory=on_cuda()))
        if shards == torch.float32:
            policy["mp_policy"] = mixed
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **policy)
        fully_shard(model, mesh=mesh, **policy)
        groups = param_groups(model, WEIGHT_DECAY)
        self.behind = None
        if settings["optimizer"] == "cpu_adam":
            from cpu_adam import CPUAdam

            options = {k: settings[k] for k in ("state_precision", "stochastic_rounding")}
            if settings["clip_inside"]:
                options["max_grad_norm"] = MAX_NORM
            self.opt = CPUAdam(groups, lr=LR, betas=BETAS, **options)
            if settings["behind"]:
                from cpu_adam.fsdp2 import step_behind_forward

                self.behind = step_behind_forward(model, self.opt)
                self.extra["kernel_threads"] = self.behind.threads
            self._time_the_host_step()
        else:
            self.opt = torch.optim.AdamW(groups, lr=LR, betas=BETAS, fused=settings["fused"])
        self.extra["shards"] = str(shards).removeprefix("torch.")
        self.extra["note"] = f"{type(self.opt).__name__} {settings}"

    def _time_the_host_step(self) -> None:
        """The norm's and the kernel's seconds inside CPUAdam's step (the serial kernel; behind: the units')."""
        import cpu_adam.clipping as clipping_module
        import cpu_adam.optimizer as optimizer_module

        self.host_clock = {"norm": 0.0, "kernel": 0.0}
        for module, name, key in (
            (clipping_module, "total_norm", "norm"),
            (optimizer_module, "adam_step_groups", "kernel"),
        ):
            real = getattr(module, name)

            def timed(*args: Any, _real: Any = real, _key: str = key, **kwargs: Any) -> Any:
                t = time.perf_counter()
                try:
                    return _real(*args, **kwargs)
                finally:
                    self.host_clock[_key] += time.perf_counter() - t

            setattr(module, name, timed)

    def step(self) -> None:
        if MAX_NORM is not None and getattr(self.opt, "max_grad_norm", None) is None:
            t = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), MAX_NORM)
            clip_s = time.perf_counter() - t
        if hasattr(self, "host_clock"):
            self.host_clock.update(norm=0.0, kernel=0.0)
        self.opt.step()
        if hasattr(self, "host_clock"):
            self.host_split = {"norm": self.host_clock["norm"], "kernel": self.host_clock["kernel"]}
            if MAX_NORM is not None and self.opt.max_grad_norm is None:
                self.host_split["norm"] = clip_s

    def settle(self) -> float:
        """Seconds until the step in flight is done (0 for a serial step); its units' kernel time to host_split."""
        if self.behind is None:
            return 0.0
        t = time.perf_counter()
        self.behind.wait()
        waited = time.perf_counter() - t
        self.host_split["kernel"] = sum(self.behind.unit_seconds.values())
        return waited

    def zero_grad(self) -> None:
        self.opt.zero_grad()


def build_contender(name: str, model: torch.nn.Module, batch: int) -> Contender:
    if name == "torch_adamw":
        return TorchAdamW(model)
    if name == "torchao":
        return TorchAO(model)
    if name == "deepspeed":
        return DeepSpeed(model, batch)
    fsdp2 = fsdp2_settings(name)
    if fsdp2 is not None:
        return FSDP2(model, fsdp2)
    options = cpu_adam_settings(name)
    if options is not None:
        return CpuAdamOffload(model, options)
    raise SystemExit(f"unknown contender {name!r}; choose from {', '.join(CONTENDERS)}, fsdp2:adamw, fsdp2:sr/bf16")


# -- measuring one contender (in its own process) ---------------------------------------------------


def memcpy_stats(run_step: Callable[[], None]) -> dict[str, dict[str, float]]:
    """Bytes and busy time of the host<->device copies of one step, from the profiler's trace."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda() else [])
    with profile(activities=activities) as prof:
        run_step()
        sync()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    out: dict[str, dict[str, float]] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "gpu_memcpy" or ("HtoD" not in name and "DtoH" not in name):
            continue
        kind = name.removeprefix("Memcpy ")
        row = out.setdefault(kind, {"bytes": 0.0, "busy_s": 0.0, "copies": 0})
        row["bytes"] += float(e.get("args", {}).get("bytes", 0))
        row["busy_s"] += float(e.get("dur", 0)) * 1e-6
        row["copies"] += 1
    return out


def cap_device_memory(gib: float | None) -> dict[str, Any]:
    """A GPU of ``gib`` GiB: this process's allocator refuses more (``set_per_process_memory_fraction``)."""
    if not gib or not on_cuda():
        return {}
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, gib * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction)
    return {"memory_cap_bytes": int(fraction * total), "memory_fraction": fraction}


def build_model(args: argparse.Namespace, on_host: bool, fsdp2: bool) -> torch.nn.Module:
    """The GPT in bf16: built on the device, or (``on_host``) in bf16 in host RAM, so that a GPU too small for the
    float32 model can hold the bf16 one (moved up whole) or, under FSDP2, never holds it whole (fully_shard moves
    each unit up, shards it and offloads the shards)."""
    torch.manual_seed(0)
    device = torch.device("cuda" if on_cuda() else "cpu")
    if not on_host:
        with device:
            model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
        return model.to(torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq)
    finally:
        torch.set_default_dtype(default)
    return model if fsdp2 else model.to(device)


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    capped = cap_device_memory(args.memory_cap_gib)
    device = torch.device("cuda" if on_cuda() else "cpu")
    model = build_model(args, args.build_on_host, fsdp2_settings(name) is not None)
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(args.vocab, (args.batch, args.seq + 1), generator=gen) for _ in range(4)]
    data = [d.to(device) for d in data]
    sync()
    weights = device_memory()
    rss0 = rss_bytes()
    if on_cuda():
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    c = build_contender(name, model, args.batch)
    sync()
    build_s = time.perf_counter() - t
    construction_peak = device_memory(peak=True)

    def train_step(i: int) -> float:
        loss = c.loss(data[i % len(data)])
        c.backward(loss)
        c.step()
        c.zero_grad()
        return loss

    for i in range(warmup_steps(name, args.warmup)):  # JIT builds, allocator warm-up, lazily allocated buffers
        train_step(i)
    sync()

    t0 = time.perf_counter()
    for i in range(args.steps):
        last_loss = train_step(i)
    sync()
    step_s = (time.perf_counter() - t0) / args.steps

    phases: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "step_call", "upload_tail")}
    host: dict[str, list[float]] = {}
    settle = getattr(c, "settle", lambda: 0.0)  # a step behind the forward: its forward timed alone
    for i in range(args.split_steps):
        settle()
        sync()
        ta = time.perf_counter()
        loss = c.loss(data[i % len(data)])
        sync()
        tb = time.perf_counter()
        c.backward(loss)
        stream_sync()
        tc = time.perf_counter()
        c.step()
        td = time.perf_counter()
        sync()
        te = time.perf_counter()
        host.setdefault("step_after_call", []).append(settle())  # what a step behind the forward has left
        c.zero_grad()
        for key, value in zip(phases, (tb - ta, tc - tb, td - tc, te - td)):
            phases[key].append(value)
        for key, value in c.host_split.items():
            host.setdefault(key, []).append(value)

    if args.record_timeline and isinstance(c, (CpuAdamOffload, FSDP2)):
        path = os.path.join(args.record_timeline, f"{name.replace('/', '_').replace(':', '_')}.json")
        (record_timeline if isinstance(c, CpuAdamOffload) else record_fsdp2_timeline)(c, data[0], path)
    copies = memcpy_stats(lambda: train_step(0))
    peak = device_memory(peak=True)
    rss = rss_bytes()
    if hasattr(c, "finish"):
        c.finish()
    split = {k: statistics.median(v) for k, v in {**phases, **host}.items()}
    return {
        "contender": name,
        "params": params,
        "tokens_per_s": args.batch * args.seq / step_s,
        "step_s": step_s,
        "split_s": split,
        "exposed_optimizer_s": step_s - split["forward"] - split["backward"],
        "build_s": build_s,
        "device_weights_bytes": weights,
        "device_peak_bytes": peak,
        "device_peak_construction_beyond_weights": construction_peak - weights,
        "host_rss_bytes_per_param": (rss - rss0) / params,
        "copies": copies,
        "final_loss": float(last_loss),
        **capped,
        **c.extra,
    }


class _Marks:
    """Points in time on the device's compute stream (CUDA events), or the host's clock on the CPU (or if asked)."""

    def __init__(self, host_clock: bool = False) -> None:
        self.marks: list[tuple[str, Any]] = []
        self.events = on_cuda() and not host_clock

    def mark(self, label: str) -> None:
        if self.events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((label, event))
        else:
            self.marks.append((label, time.perf_counter()))

    def seconds(self) -> list[tuple[str, float]]:
        sync()
        start = self.marks[0][1]
        if self.events:
            return [(label, start.elapsed_time(e) * 1e-3) for label, e in self.marks]
        return [(label, t - start) for label, t in self.marks]


def marked_step(c: Contender, tokens: torch.Tensor, marks: _Marks) -> None:
    """One training step with a mark at its start and after its forward, backward and step() call."""
    sync()
    marks.mark("start")
    loss = c.loss(tokens)
    marks.mark("forward")
    c.backward(loss)
    marks.mark("backward")
    c.step()
    marks.mark("step")


def record_timeline(c: CpuAdamOffload, tokens: torch.Tensor, path: str) -> None:
    """One step's timeline: when the forward ends, each bucket lands (its grads sent, on the device's clock), the
    backward ends, and step() ends; with the step's timings and the optimizer's bytes, for bench_replay.py."""
    rooms = c.opt._rooms
    marks = _Marks()
    real_down = rooms.link.down

    def down(g: int, b: int, staging: torch.Tensor, **kwargs: Any) -> Any:
        marks.mark(f"landing {g} {b} {rooms.layouts[g].pieces[b].numel} {int(rooms.share.on_device(g, b))}")
        return real_down(g, b, staging, **kwargs)

    rooms.link.down = down
    try:
        marked_step(c, tokens, marks)
        c.zero_grad()
    finally:
        rooms.link.down = real_down
    seconds = marks.seconds()
    at = dict(seconds)
    landings = [
        dict(zip(("group", "bucket", "numel", "on_device"), map(int, label.split()[1:])), at_s=t - at["forward"])
        for label, t in seconds
        if label.startswith("landing")
    ]
    timeline = {
        "forward_s": at["forward"],
        "backward_s": at["backward"] - at["forward"],
        "step_s": at["step"] - at["backward"],
        "landings": landings,  # at_s: from the backward's start
        "step_timings": c.opt.step_timings,
        "memory_stats": c.opt.memory_stats(),
        "max_grad_norm": MAX_NORM,
        "last_grad_norm": c.opt.last_grad_norm,
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(timeline, f, indent=1)


def record_fsdp2_timeline(c: FSDP2, tokens: torch.Tensor, path: str) -> None:
    """Two steps' timeline, for bench_fsdp2_replay.py: each unit's forward on the device's clock (from its FSDP2
    pre-forward to the next unit's), the backward, the step() call; the host step's parts (norm, kernel, each unit's
    kernel time behind the forward); then, behind the forward, when each unit's gather began after step() returned."""
    blocks = list(c.model.blocks)
    marks = _Marks()
    hooks = [
        block.register_forward_pre_hook(lambda m, a, i=i: marks.mark(f"unit {i}")) for i, block in enumerate(blocks)
    ]
    try:
        c.settle()
        marked_step(c, tokens, marks)
        host = dict(c.host_split)
        host_ms = {"step_after_call": c.settle(), **host}
        c.zero_grad()
        seconds = marks.seconds()
        behind: list[tuple[str, float]] = []
        if c.behind is not None:  # a second step: the forward right after step() returned, on the host's clock
            loss = c.loss(tokens)
            c.backward(loss)
            host_marks = _Marks(host_clock=True)
            host_marks.mark("start")
            hooks += [
                block.register_forward_pre_hook(lambda m, a, i=i: host_marks.mark(f"unit {i}"))
                for i, block in enumerate(blocks)
            ]
            c.step()
            host_marks.mark("step")
            c.loss(tokens).detach()
            host_marks.mark("forward")
            behind = host_marks.seconds()
            c.settle()
            host_ms["unit_seconds"] = c.behind.unit_seconds
            host_ms["order"] = c.behind.order
            c.zero_grad()
    finally:
        for hook in hooks:
            hook.remove()
    at = dict(seconds)
    units = [t for label, t in seconds if label.startswith("unit")]
    timeline = {
        "forward_s": at["forward"],
        "root_before_first_unit_s": units[0] if units else 0.0,
        "unit_forward_s": [b - a for a, b in zip(units, [*units[1:], at["forward"]])],
        "unit_numels": [sum(p.numel() for p in block.parameters()) for block in blocks],
        "root_numel": sum(p.numel() for p in c.model.parameters())
        - sum(p.numel() for b in blocks for p in b.parameters()),
        "backward_s": at["backward"] - at["forward"],
        "step_s": at["step"] - at["backward"],
        "host": host_ms,
        "behind_host_clock": behind,
        "max_grad_norm": MAX_NORM,
    }
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(timeline, f, indent=1)


def worker(name: str, args: argparse.Namespace, out_path: str) -> None:
    try:
        result = measure(name, args)
    except torch.cuda.OutOfMemoryError as e:
        result = {"contender": name, "error": f"out of device memory: {str(e).splitlines()[0]}"}
    except ImportError as e:
        result = {"contender": name, "error": f"not installed: {e}"}
    with open(out_path, "w") as f:
        json.dump(result, f)


# -- probes and the report --------------------------------------------------------------------------


def pcie_probe(nbytes: int = 1 << 30, reps: int = 5) -> dict[str, float]:
    """GB/s of one large pinned host<->device copy each way, alone on the bus."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = {}
    for label, dst, src in (("down_GBps", host, dev), ("up_GBps", dev, host)):
        times = []
        for _ in range(reps + 1):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        out[label] = nbytes / statistics.median(times[1:]) / 1e9
    return out


def probe_key(options: dict[str, Any]) -> str:
    """The host step config a contender's bytes are probed for."""
    return f"{SHORT[options['master_weights_dtype']]} master / {options['state_precision']} states"


SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def cpu_probe(numel: int, contenders: list[str], reps: int = 5) -> dict[str, float]:
    """GB/s of cpu_adam's bandwidth probe on every core, for the bytes of each host step config of the contenders.

    The best of the probe's variants (prefetch, streaming stores), interleaved round by round.
    """
    from cpu_adam import ops
    from cpu_adam._precision import state_dtype
    from cpu_adam.quant8 import blocks

    configs = {probe_key(o): o for o in (cpu_adam_settings(name) for name in contenders) if o is not None}
    out = {}
    for key, options in configs.items():
        states = state_dtype(options["state_precision"])
        p = torch.zeros(numel, dtype=options["master_weights_dtype"])
        g = torch.zeros(numel, dtype=torch.bfloat16)
        m, v = torch.zeros(numel, dtype=states), torch.zeros(numel, dtype=states)
        scales = [torch.ones(2, blocks(numel))] if states == torch.uint8 else None
        times: dict[str, list[float]] = {variant: [] for variant in ops.PROBE_VARIANTS}
        for _ in range(reps + 1):
            for variant, record in times.items():
                t = time.perf_counter()
                ops.bandwidth_probe([p], [g], [m], [v], bf16_outs=[g], state_scales=scales, variant=variant)
                record.append(time.perf_counter() - t)
        best = min(statistics.median(record[1:]) for record in times.values())
        out[key] = numel * host_step_bytes(options) / best / 1e9
        del p, g, m, v
    return out


def _copy_rate(rows: dict[str, dict[str, float]], params: int) -> tuple[float, float]:
    """(GB/s while copying, bytes per param) of one direction's copies."""
    b = sum(x["bytes"] for x in rows.values())
    busy = sum(x["busy_s"] for x in rows.values())
    return (b / busy / 1e9 if busy else 0.0), b / params


def report(results: list[dict[str, Any]], probes: dict[str, Any]) -> str:
    lines = [
        f"device {probes['device']}, {probes['cpus']} CPUs, torch {probes['torch']}, "
        f"{probes['torch_threads']} threads, max_grad_norm {probes.get('max_grad_norm')}",
        f"PCIe probe (pinned, 1 GiB): down {probes['pcie']['down_GBps']:.1f} GB/s, "
        f"up {probes['pcie']['up_GBps']:.1f} GB/s",
        "CPU bandwidth probe: " + ", ".join(f"{k} {v:.1f} GB/s" for k, v in probes["cpu_GBps"].items()),
        "",
    ]
    ok = [r for r in results if "error" not in r]
    ref = {r["contender"]: r["tokens_per_s"] for r in ok}
    head = (
        f"{'contender':<15}{'tokens/s':>10}{'step ms':>9}{'fwd':>7}{'bwd':>7}{'step()':>8}{'tail':>7}"
        f"{'exposed':>9}{'grads':>7}{'adam':>7}{'adam GB/s':>10}{'% probe':>8}{'peak GiB':>9}{'host B/p':>9}"
        f"{'down GB/s':>10}{'up GB/s':>8}{'B/p down':>9}{'B/p up':>7}"
    )
    lines.append(head)
    for r in results:
        if "error" in r:
            lines.append(f"{r['contender']:<15}{r['error']}")
            continue
        s = {k: v * 1e3 for k, v in r["split_s"].items()}
        down = {k: v for k, v in r["copies"].items() if "DtoH" in k}
        up = {k: v for k, v in r["copies"].items() if "HtoD" in k}

        down_rate, down_bp = _copy_rate(down, r["params"])
        up_rate, up_bp = _copy_rate(up, r["params"])
        adam_gbps = pct = ""
        options = cpu_adam_settings(r["contender"])
        host_elements = r["params"] * (1 - r.get("device_share", 0.0))
        if "cpu_adam" in s and options is not None and host_elements and s["cpu_adam"] > 0:
            gbps = host_elements * host_step_bytes(options) / (s["cpu_adam"] * 1e-3) / 1e9
            adam_gbps, pct = f"{gbps:.1f}", f"{100 * gbps / probes['cpu_GBps'][probe_key(options)]:.0f}"
        lines.append(
            f"{r['contender']:<15}{r['tokens_per_s']:>10.0f}{r['step_s'] * 1e3:>9.1f}{s['forward']:>7.1f}"
            f"{s['backward']:>7.1f}{s['step_call']:>8.1f}{s['upload_tail']:>7.1f}{r['exposed_optimizer_s'] * 1e3:>9.1f}"
            f"{s.get('grads_wait', float('nan')):>7.1f}{s.get('cpu_adam', float('nan')):>7.1f}{adam_gbps:>10}{pct:>8}"
            f"{r['device_peak_bytes'] / 2**30:>9.2f}{r['host_rss_bytes_per_param']:>9.2f}"
            f"{down_rate:>10.1f}{up_rate:>8.1f}{down_bp:>9.2f}{up_bp:>7.2f}"
        )
    lines.append("")
    whole_share = [r for r in ok if (cpu_adam_settings(r["contender"]) or {}).get("device_fraction") == 1.0]
    for r in ok:
        settings = fsdp2_settings(r["contender"])
        if settings is not None and settings["optimizer"] == "cpu_adam":
            peers = [(o, ref[o]) for o in ("fsdp2:adamw",) if o in ref] + [
                (w["contender"], w["tokens_per_s"]) for w in whole_share
            ]
            vs = ", ".join(f"{r['tokens_per_s'] / t:.2f}x {o}" for o, t in peers)
            lines.append(f"{r['contender']} tokens/s: {vs}")
    for r in ok:
        if cpu_adam_settings(r["contender"]) is not None:
            mine = r["contender"]
            peers = [o for o in ("deepspeed", "torchao", "torch_adamw", "fsdp2_adamw") if o in ref]
            vs = ", ".join(f"{ref[mine] / ref[o]:.2f}x {o}" for o in peers)
            share = f"device share {r.get('device_share', 0.0):.2f} ({r.get('device_state_bytes', 0) / 2**30:.1f} GiB "
            share += f"resident, {r.get('device_streamed_bytes', 0) / 2**30:.1f} GiB streamed each way)"
            lines.append(f"{mine} tokens/s: {vs}; {share}")
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if "error" not in r]
    names = [r["contender"] for r in ok]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottom = [0.0] * len(ok)
    for key, label in (
        ("forward", "forward"),
        ("backward", "backward"),
        ("step_call", "step() (grads wait, CPU Adam, uploads launched)"),
        ("upload_tail", "upload tail after step()"),
    ):
        values = [r["split_s"][key] * 1e3 for r in ok]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(names, [r["step_s"] * 1e3 for r in ok], color="black", zorder=3, label="step, back to back (no syncs)")
    ax.set_ylabel("ms per training step")
    p = ok[0]["params"] / 1e9 if ok else 0
    ax.set_title(f"Offload training on one GPU: {p:.2f}B params, time per step by phase")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=15)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--max-grad-norm", default="1.0", help="clip at this global norm (none: no clipping)")
    parser.add_argument("--record-timeline", metavar="DIR", help="each cpu_adam contender's timeline of one step")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--split-steps", type=int, default=3)
    parser.add_argument("--probe-numel", type=int, default=1 << 27)
    parser.add_argument("--timeout", type=int, default=300, help="seconds per contender")
    parser.add_argument("--memory-cap-gib", type=float, help="a GPU of this many GiB (the allocator's limit)")
    parser.add_argument("--build-on-host", action="store_true", help="build the model in bf16 in host RAM")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PATH")
    parser.add_argument("--allow-cpu", action="store_true", help="a smoke run of the CPU-capable contenders")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global MAX_NORM
    MAX_NORM = None if args.max_grad_norm.lower() in ("none", "0") else float(args.max_grad_norm)
    if args.worker:
        worker(args.worker, args, args.out)
        return

    if not on_cuda() and not args.allow_cpu:
        raise SystemExit("bench_gpu_offload.py needs a CUDA GPU (bench_offload.py runs on the CPU)")
    contenders = [ALIASES.get(name, name) for name in args.contenders.split(",")]
    for name in contenders:  # a misspelt contender is refused before the probes run
        cpu_adam_settings(name)
        fsdp2_settings(name)

    # Work in contenders; a probe takes seconds where a contender takes a minute or more.
    def work(name: str) -> float:
        missing = name in PEER_MODULES and importlib.util.find_spec(PEER_MODULES[name]) is None
        return 0.0 if missing else 1.0  # one that is not installed ends at once

    probe_work = 0.1
    probe_phases = 2 if on_cuda() else 1
    total = probe_phases * probe_work + sum(map(work, contenders))
    progress = Progress(probe_phases + len(contenders), total, "bench_gpu_offload", quiet=args.quiet)
    pcie = {"down_GBps": 0.0, "up_GBps": 0.0}
    if on_cuda():
        with progress.phase("PCIe probe", probe_work, 0):
            pcie = pcie_probe()
    with progress.phase(f"CPU bandwidth probe, {args.probe_numel:,} elements", probe_work, 0):
        cpu_gbps = cpu_probe(args.probe_numel, contenders)
    probes = {
        "device": torch.cuda.get_device_name() if on_cuda() else "cpu",
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "max_grad_norm": MAX_NORM,
        "pcie": pcie,
        "cpu_GBps": cpu_gbps,
    }
    gc.collect()
    print(report([], probes), flush=True)
    results = []
    passthrough = [a for a in sys.argv[1:] if not a.startswith(("--json", "--plot", "--contenders"))]
    passthrough = [a for a in passthrough if a not in (args.json, args.plot, args.contenders)]
    for name in contenders:
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            out = f.name
        cmd = [sys.executable, __file__, *passthrough, "--worker", name, "--out", out]
        t = time.perf_counter()
        with progress.phase(f"{name} (at most {args.timeout} s)", work(name), 0) as phase:
            try:
                proc = subprocess.run(cmd, timeout=args.timeout, capture_output=True, text=True)
                with open(out) as f:
                    result = json.load(f)
            except subprocess.TimeoutExpired:
                result = {"contender": name, "error": f"timed out after {args.timeout} s"}
            except (OSError, json.JSONDecodeError):
                tail = (proc.stderr or "").strip().splitlines()[-3:]
                result = {"contender": name, "error": f"failed (exit {proc.returncode}): {' | '.join(tail)}"[:400]}
            with contextlib.suppress(OSError):
                os.unlink(out)
            phase.note = result.get("error") or f"{result['tokens_per_s']:,.0f} tokens/s"
        result["wall_s"] = time.perf_counter() - t
        results.append(result)
        print(f"{name}: {json.dumps(result)}", flush=True)
    print(report(results, probes))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"probes": probes, "config": vars(args), "results": results}, f, indent=2)
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
