"""Adam step time: cpu_adam against its bandwidth probe, torch.optim.AdamW and DeepSpeedCPUAdam
(8-bit states: bitsandbytes' and torchao's AdamW8bit).

    python benchmarks/bench_step.py                      # 2^26 params, all threads, about a minute
    python benchmarks/bench_step.py --size 2^20 --threads sweep --json out.json --plot out.png
    python benchmarks/bench_step.py --sections step --states bf16,8bit   # 8-bit states next to bf16
    python benchmarks/bench_step.py --sections step --deepspeed-avx2   # also DeepSpeed's AVX2 build of its op

Two sections, each a set of interleaved groups (one group per dtype config, allocated and
freed in turn so the peak stays near one config's buffers times its contenders):
- step: one Adam step per implementation, with and without cpu_adam's bf16 output copy;
- offload: the offload optimizer's step (grad clip scale + Adam + bf16 weights for the
  upload) as cpu_adam's one pass against the three passes DeepSpeed makes of it.
Every figure is a median over rounds; "% of probe" and speedups are medians of same-round ratios.
The probe runs in every variant (software prefetch or not, plain or streaming stores), interleaved
with the rest; "% of probe" is against the variant with the lowest median in that config and run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
# An installed cpu_adam wins; a source checkout that was not installed works too.
sys.path.append(str(Path(__file__).resolve().parent.parent))
from _common import (
    Contender,
    Progress,
    Step,
    deepspeed_adam,
    deepspeed_adam_avx2,
    describe_deepspeed_build,
    format_table,
    interleave,
    load_deepspeed_op,
    machine,
    parse_size,
    parse_threads,
    peers_quiet,
    ratio,
    size_label,
    spread,
)

from cpu_adam import ops
from cpu_adam.ops import PROBE_VARIANTS

F32, BF16, Q8 = torch.float32, torch.bfloat16, torch.uint8  # Q8: 8-bit states (codes + block scales)
SHORT = {F32: "fp32", BF16: "bf16", Q8: "8bit"}
Q8_BLOCK = 256
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
# The clip factor alternates between these so grads scaled in place (the three-pass sequence)
# neither drift to denormals, which would slow every pass, nor overflow; both are exact.
CLIP_SCALES = (0.5, 2.0)

PROBE, CPU_ADAM = "probe", "cpu_adam"
TORCH_FOREACH, TORCH_FUSED, DEEPSPEED = "torch AdamW foreach", "torch AdamW fused", "DeepSpeedCPUAdam"
# DeepSpeed's op as its builder makes it on an x86 CPU without AVX-512 (--deepspeed-avx2).
DEEPSPEED_AVX2 = "DeepSpeedCPUAdam AVX2 build"
BNB8, TORCHAO8 = "bitsandbytes AdamW8bit", "torchao AdamW8bit"
PEERS = (TORCH_FOREACH, TORCH_FUSED, DEEPSPEED, DEEPSPEED_AVX2)
# How each DeepSpeed op that loaded was built (deepspeed_build), for the header and the JSON.
DEEPSPEED_BUILDS: dict[str, dict] = {}
PEERS8 = (BNB8, TORCHAO8)  # 8-bit states only
# The 8-bit peers take 60-500 ns per param on the CPU (4-30 s per step at 2^26): they run on a
# slice of at most this many params, in the same rounds, and are compared per param. Smaller
# slices only favour them (less of their temporaries leave cache).
PEER8_MAX_PARAMS = 1 << 22


@dataclass(frozen=True)
class Config:
    param: torch.dtype
    grad: torch.dtype
    state: torch.dtype

    @property
    def label(self) -> str:
        return "/".join(SHORT[d] for d in (self.param, self.grad, self.state))

    def bytes_per_param(self, out: bool) -> float:
        # What the step must move at least: params and both moments read and written, grads
        # read, the bf16 output written. Write-allocate reads and temporaries are not counted,
        # so GB/s is the useful bandwidth, the same accounting as the byte budgets in benchmarks/README.md.
        # 8-bit states add their two float32 scales per block, read and written.
        size = {F32: 4, BF16: 2, Q8: 1}
        scales = 2 * 2 * 4 / Q8_BLOCK if self.state == Q8 else 0
        return 2 * size[self.param] + size[self.grad] + 4 * size[self.state] + scales + (2 if out else 0)


STEP_CONFIGS = [Config(F32, F32, F32), Config(F32, BF16, F32), Config(F32, BF16, BF16)]
STEP_CONFIGS += [Config(BF16, BF16, F32), Config(BF16, BF16, BF16)]
STEP_CONFIGS += [Config(F32, F32, Q8), Config(F32, BF16, Q8), Config(BF16, BF16, Q8)]
# Offload: master weights and states on the host, grads arrive as bf16 (master, states).
OFFLOAD_CONFIGS = [(F32, F32), (F32, BF16), (BF16, F32), (BF16, BF16)]


@dataclass
class Buffers:
    param: Tensor
    grad: Tensor
    exp_avg: Tensor
    exp_avg_sq: Tensor
    out: Tensor | None  # the bf16 weights for the upload; the grad itself when that is bf16
    scales: list[Tensor] | None = None  # 8-bit states: the block scales of both moments

    @staticmethod
    def make(source: Tensor, cfg: Config, out: bool) -> Buffers:
        grad = (source * 1e-2).to(cfg.grad)
        bf16_out = None
        if out:
            bf16_out = grad if cfg.grad == BF16 else torch.empty(source.numel(), dtype=BF16)
        return Buffers(
            param=source.to(cfg.param, copy=True),
            grad=grad,
            exp_avg=torch.zeros(source.numel(), dtype=cfg.state),
            exp_avg_sq=torch.zeros(source.numel(), dtype=cfg.state),
            out=bf16_out,
            scales=[torch.ones(2, -(-source.numel() // Q8_BLOCK))] if cfg.state == Q8 else None,
        )

    def lists(self) -> tuple[list[Tensor], ...]:
        return [self.param], [self.grad], [self.exp_avg], [self.exp_avg_sq]


def probe_step(b: Buffers, out: bool, variant: str) -> Step:
    # Raw bytes plus one, no float math: the values it leaves do not change its speed.
    outs = [b.out] if out else None
    return lambda: ops.bandwidth_probe(*b.lists(), bf16_outs=outs, state_scales=b.scales, variant=variant)


def probe_contenders(b: Buffers, out: bool, family: str, bytes_moved: int) -> list[tuple[Contender, str]]:
    """One contender per probe variant, named "<family> [<variant>]"; the best stands for the family."""
    return [(Contender(f"{family} [{v}]", probe_step(b, out, v), bytes_moved), family) for v in PROBE_VARIANTS]


def best_probes(group: list[tuple[Contender, str]]) -> dict[str, Contender]:
    """The fastest variant (lowest median) of each probe family in the group."""
    best: dict[str, Contender] = {}
    for c, family in group:
        if c.name.startswith(family + " [") and (family not in best or c.median_s < best[family].median_s):
            best[family] = c
    return best


def is_probe(c: Contender, family: str) -> bool:
    return c.name.startswith(family + " [")


def cpu_adam_step(b: Buffers, out: bool, stochastic_rounding: bool = False, clip: bool = False) -> Step:
    counter = itertools.count(1)
    outs = [b.out] if out else None

    def step() -> None:
        t = next(counter)
        ops.adam_step(
            *b.lists(),
            step=t,
            lr=HYPER["lr"],
            beta1=HYPER["betas"][0],
            beta2=HYPER["betas"][1],
            eps=HYPER["eps"],
            weight_decay=HYPER["weight_decay"],
            grad_scale=CLIP_SCALES[t % 2] if clip else 1.0,
            bf16_outs=outs,
            stochastic_rounding=stochastic_rounding,
            seed=1234,
            state_scales=b.scales,
        )

    return step


def peer_optimizer(name: str, param: Tensor, grad: Tensor, state: torch.dtype) -> torch.optim.Optimizer | None:
    """The peer on one flat param (no per-tensor overhead), or None where it lacks these dtypes."""
    # torch keeps moments in the param dtype and wants grads in it; DeepSpeed keeps them in
    # fp32 or the param dtype, and silently misreads a grad of another dtype.
    if grad.dtype != param.dtype:
        return None
    p = torch.nn.Parameter(param, requires_grad=True)
    p.grad = grad
    if name in PEERS8:
        if state != Q8:
            return None
        if name == BNB8:
            import bitsandbytes

            return bitsandbytes.optim.AdamW8bit([p], **HYPER)
        from torchao.optim import AdamW8bit

        return AdamW8bit([p], **HYPER)
    if state == Q8:
        return None
    if name in (TORCH_FOREACH, TORCH_FUSED):
        if state != param.dtype:
            return None
        flag = "foreach" if name == TORCH_FOREACH else "fused"
        return torch.optim.AdamW([p], **HYPER, **{flag: True})
    ds_cls, _ = deepspeed_adam()
    if ds_cls is None or (state != F32 and state != param.dtype):
        return None
    if name == DEEPSPEED_AVX2:
        ds_cls = deepspeed_adam_avx2(ds_cls)
    return ds_cls([p], **HYPER, adamw_mode=True, fp32_optimizer_states=state == F32)


def clip_adam_cast_step(b: Buffers, adam: Callable[[], None]) -> Step:
    """DeepSpeed's offload step: grads scaled in place, the optimizer step, a cast pass."""
    counter = itertools.count(1)

    def step() -> None:
        b.grad.mul_(CLIP_SCALES[next(counter) % 2])
        adam()
        b.out.copy_(b.param)

    return step


def step_group(
    cfg: Config, n: int, peers_on: dict[str, bool], peers_status: dict[str, str]
) -> list[tuple[Contender, str]]:
    """Contenders for one dtype config, each paired with the name of its probe."""
    source = torch.randn(n)
    probe_bufs, ours = Buffers.make(source, cfg, out=True), Buffers.make(source, cfg, out=True)
    out_tag = " + out=grad" if cfg.grad == BF16 else " + out"
    plain, with_out = round(cfg.bytes_per_param(False) * n), round(cfg.bytes_per_param(True) * n)
    group = probe_contenders(probe_bufs, False, PROBE, plain)
    group += probe_contenders(probe_bufs, True, PROBE + out_tag, with_out)
    group += [
        (Contender(CPU_ADAM, cpu_adam_step(ours, False), plain), PROBE),
        (Contender(CPU_ADAM + out_tag, cpu_adam_step(ours, True), with_out), PROBE + out_tag),
    ]
    if cfg.param == BF16:
        group.append((Contender(CPU_ADAM + " stochastic", cpu_adam_step(ours, False, True), plain), PROBE))
    for name in PEERS + PEERS8:
        if not peers_on[name]:
            continue
        size = min(n, PEER8_MAX_PARAMS) if name in PEERS8 else n
        b = Buffers.make(source[:size], cfg, out=False)
        try:
            with peers_quiet():
                opt = peer_optimizer(name, b.param, b.grad, cfg.state)
            if opt is None:
                continue
            if name in PEERS8:
                # A first step outside the rounds: torchao compiles its step there (about 20 s).
                print(
                    f"{cfg.label}: first step of {name} on {size_label(size)} params ...", file=sys.stderr, flush=True
                )
                with peers_quiet():
                    opt.step()
        except Exception as exc:  # whatever a peer raises on import or on CPU tensors, its row says why
            peers_on[name] = False
            peers_status[name] = f"failed ({type(exc).__name__})"
            print(f"{name}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
            continue
        group.append((Contender(name, opt.step, round(cfg.bytes_per_param(False) * size)), PROBE))
        PEER_PARAMS[name] = size
    return group


# Params each peer steps (the 8-bit peers: a slice of the config's).
PEER_PARAMS: dict[str, int] = {}


def offload_group(master: torch.dtype, state: torch.dtype, n: int, peers_on: dict[str, bool]):
    source = torch.randn(n)
    one_pass_cfg = Config(master, BF16, state)
    seq_cfg = Config(master, master, state)  # the peers want grads in the param dtype
    bytes_moved = one_pass_cfg.bytes_per_param(True) * n
    group = probe_contenders(Buffers.make(source, one_pass_cfg, True), True, PROBE, round(bytes_moved))
    group += [
        (Contender("cpu_adam 1 pass", cpu_adam_step(Buffers.make(source, one_pass_cfg, True), True, clip=True), 0), ""),
    ]
    ours = Buffers.make(source, seq_cfg, out=False)
    ours.out = torch.empty(n, dtype=BF16)
    group.append((Contender("cpu_adam 3 passes", clip_adam_cast_step(ours, cpu_adam_step(ours, False)), 0), ""))
    for name in (TORCH_FUSED, DEEPSPEED):
        if not peers_on[name]:
            continue
        b = Buffers.make(source, seq_cfg, out=False)
        b.out = torch.empty(n, dtype=BF16)
        opt = peer_optimizer(name, b.param, b.grad, state)
        if opt is not None:
            group.append((Contender(f"{name} 3 passes", clip_adam_cast_step(b, opt.step), 0), ""))
    return group


def fmt(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}"


def step_rows(label: str, group: list[tuple[Contender, str]], n: int, threads: int) -> list[dict]:
    best = best_probes(group)
    by_name = {c.name: c for c, _ in group}
    rows = []
    for c, family in group:
        if is_probe(c, family) and c is not best[family]:
            continue
        size = PEER_PARAMS.get(c.name, n)
        row = {
            "section": "step",
            "threads": threads,
            "config": label,
            "implementation": c.name,
            "params": size,
            "ms_per_step": c.median_s * 1e3,
            "ns_per_param": c.median_s * 1e9 / size,
            "gb_per_s": c.bytes_moved / c.median_s / 1e9,
            "bytes_per_param": round(c.bytes_moved / size, 2),
            "iqr_rel": spread(c),
            # Per param: an 8-bit peer's slice is smaller than the probe's buffers.
            "pct_of_probe": 100.0 if c is best[family] else 100 * size / n / ratio(c, best[family]),
            "speedup": {},
            "times_ms": [t * 1e3 for t in c.times],
        }
        if c is best[family]:
            row["probe_variants_ns_per_param"] = {
                x.name[len(family) + 2 : -1]: x.median_s * 1e9 / n for x, f in group if f == family and is_probe(x, f)
            }
        # Speedups only where both sides do the same work: the peers make no bf16 copy.
        if c.name.startswith(CPU_ADAM) and "out" not in c.name:
            row["speedup"] = {p: ratio(by_name[p], c) * n / PEER_PARAMS[p] for p in PEERS + PEERS8 if p in by_name}
        rows.append(row)
    return rows


def offload_rows(label: str, group: list[tuple[Contender, str]], n: int, threads: int) -> list[dict]:
    probe = best_probes(group)[PROBE]
    one_pass = next(c for c, _ in group if c.name == "cpu_adam 1 pass")
    rows = []
    for c, family in group:
        if is_probe(c, family) and c is not probe:
            continue
        row = {
            "section": "offload",
            "threads": threads,
            "config": label,
            "implementation": c.name,
            "ms_per_step": c.median_s * 1e3,
            "ns_per_param": c.median_s * 1e9 / n,
            "iqr_rel": spread(c),
            "pct_of_probe": 100 / ratio(c, probe),
            "one_pass_speedup": ratio(c, one_pass),
            "times_ms": [t * 1e3 for t in c.times],
        }
        if c is probe:
            row["probe_variants_ns_per_param"] = {
                x.name[len(PROBE) + 2 : -1]: x.median_s * 1e9 / n for x, f in group if f == PROBE and is_probe(x, f)
            }
        rows.append(row)
    return rows


def print_step_table(rows: list[dict], peers_status: dict[str, str]) -> None:
    peers = tuple(p for p in PEERS if p != DEEPSPEED_AVX2 or peers_status[p] != "not asked for")
    peers += PEERS8 if any(r["config"].endswith(SHORT[Q8]) for r in rows) else ()
    headers = ["params/grads/states", "implementation", "ms/step", "ns/param", "GB/s", "B/param", "% of probe"]
    headers += [f"vs {p}" for p in peers] + ["IQR"]
    body = []
    for r in rows:
        name = r["implementation"]
        if r["params"] != rows[0]["params"]:
            name += f" ({size_label(r['params'])} params)"
        cells = [r["config"], name, fmt(r["ms_per_step"]), fmt(r["ns_per_param"], 3)]
        cells += [fmt(r["gb_per_s"], 1), str(r["bytes_per_param"]), fmt(r["pct_of_probe"], 0)]
        for p in peers:
            if not r["implementation"].startswith(CPU_ADAM) or "out" in r["implementation"]:
                cells.append("")
            elif p in r["speedup"]:
                cells.append(f"{r['speedup'][p]:.2f}x")
            elif (p in PEERS8) != r["config"].endswith(SHORT[Q8]):
                cells.append("n/a (dtypes)")
            else:
                cells.append(peers_status[p])
        cells.append(f"{100 * r['iqr_rel']:.0f}%")
        body.append(cells)
    print(format_table(headers, body))


def print_probe_variants(rows: list[dict]) -> None:
    """Each probe variant's median as a % of the best one's speed (100 = the best, shown in the table)."""
    headers = ["config", "probe", *PROBE_VARIANTS]
    body = []
    for r in rows:
        variants = r.get("probe_variants_ns_per_param")
        if variants:
            best = min(variants.values())
            family = r["implementation"].split(" [")[0]
            body.append([r["config"], family] + [fmt(100 * best / variants[v], 0) for v in PROBE_VARIANTS])
    print(format_table(headers, body))


def print_offload_table(rows: list[dict]) -> None:
    headers = ["master/states", "implementation", "ms/step", "ns/param", "% of probe", "1 pass faster by", "IQR"]
    body = [
        [
            r["config"],
            r["implementation"],
            fmt(r["ms_per_step"]),
            fmt(r["ns_per_param"], 3),
            fmt(r["pct_of_probe"], 0),
            "" if r["implementation"].startswith((PROBE, "cpu_adam 1 pass")) else f"{r['one_pass_speedup']:.2f}x",
            f"{100 * r['iqr_rel']:.0f}%",
        ]
        for r in rows
    ]
    print(format_table(headers, body))


def peer_status(
    skip_deepspeed: bool, with_8bit: bool, deepspeed_avx2: bool = False
) -> tuple[dict[str, bool], dict[str, str]]:
    """Which peers run, and for those that cannot, what the table says instead of a speedup."""
    on = {TORCH_FOREACH: True, TORCH_FUSED: True, DEEPSPEED: False, DEEPSPEED_AVX2: False, BNB8: False, TORCHAO8: False}
    status = {name: "n/a (dtypes)" for name in PEERS + PEERS8}
    status[DEEPSPEED_AVX2] = "not asked for"
    for name, module in ((BNB8, "bitsandbytes"), (TORCHAO8, "torchao.optim")):
        if not with_8bit:
            status[name] = "skipped"
            continue
        # Found, not imported: their imports print notices, which come where they are timed, held back there.
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            on[name] = True
        else:
            status[name] = "not installed"
    ds_cls, why = deepspeed_adam()
    builds = [(DEEPSPEED, ds_cls)]
    if deepspeed_avx2:
        status[DEEPSPEED_AVX2] = "n/a (dtypes)"
        if ds_cls is not None:
            builds.append((DEEPSPEED_AVX2, deepspeed_adam_avx2(ds_cls)))
    if skip_deepspeed:
        status[DEEPSPEED] = "skipped"
    elif ds_cls is None:
        status[DEEPSPEED] = why
        if deepspeed_avx2:
            status[DEEPSPEED_AVX2] = why
    else:
        for name, cls in builds:
            print(
                f"{name} ({why}): loading its op; the first run builds it, a silent minute or more ...",
                file=sys.stderr,
                flush=True,
            )
            ok, message, build = load_deepspeed_op(cls)
            print(f"{name}: {why}, {message}", file=sys.stderr)
            on[name] = ok
            if ok:
                DEEPSPEED_BUILDS[name] = build
            else:
                status[name] = "build failed"
    return on, status


def plan_jobs(
    n: int, sections: list[str], states: list[str], peers_on, peers_status
) -> list[tuple[str, str, Callable]]:
    """(section, config label, what builds its group), in the order they run."""
    jobs: list[tuple[str, str, Callable]] = []
    if "step" in sections:
        configs = [c for c in STEP_CONFIGS if SHORT[c.state] in states]
        jobs += [("step", c.label, lambda c=c: step_group(c, n, peers_on, peers_status)) for c in configs]
    if "offload" in sections:
        jobs += [
            ("offload", f"{SHORT[m]}/{SHORT[s]}", lambda m=m, s=s: offload_group(m, s, n, peers_on))
            for m, s in OFFLOAD_CONFIGS
        ]
    return jobs


def run(
    n: int,
    threads: int,
    rounds: int,
    warmup: int,
    sections: list[str],
    states: list[str],
    peers_on,
    peers_status,
    progress: Progress | None = None,
) -> list[dict]:
    """Every group's rows; a phase of `progress` per group, of (warmup + rounds) * n units of work."""
    torch.set_num_threads(threads)
    jobs = plan_jobs(n, sections, states, peers_on, peers_status)
    if progress is None:
        progress = Progress(len(jobs), len(jobs) * (rounds + warmup) * n, "bench_step")
    results: list[dict] = []
    for section, label, build in jobs:
        with progress.phase(
            f"{size_label(n)}, {threads} thread(s), {section} {label}", (rounds + warmup) * n, rounds + warmup, "round"
        ) as tick:
            group = build()
            interleave([c for c, _ in group], rounds, warmup, tick)
            make_rows = step_rows if section == "step" else offload_rows
            results += make_rows(label, group, n, threads)
            del group
            gc.collect()  # the next config's buffers should not stack on this one's
    return results


def plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    threads = max(r["threads"] for r in results)
    sections = [s for s in ("step", "offload") if any(r["section"] == s for r in results)]
    fig, axes = plt.subplots(len(sections), 1, figsize=(12, 4.6 * len(sections)), squeeze=False)
    for ax, section in zip(axes[:, 0], sections):
        rows = [r for r in results if r["threads"] == threads and r["section"] == section]
        _plot_section(ax, rows, section)
    fig.suptitle(f"{title}, {threads} thread(s). Lower is better; black line: bandwidth probe (the floor)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


COLORS = {
    CPU_ADAM: "#1f77b4",
    CPU_ADAM + " stochastic": "#6baed6",
    "cpu_adam 1 pass": "#1f77b4",
    "cpu_adam 3 passes": "#6baed6",
    TORCH_FOREACH: "#bdbdbd",
    TORCH_FUSED: "#ff7f0e",
    TORCH_FUSED + " 3 passes": "#ff7f0e",
    DEEPSPEED: "#d62728",
    DEEPSPEED + " 3 passes": "#d62728",
    DEEPSPEED_AVX2: "#ff9896",
}


def _plot_section(ax, rows: list[dict], section: str) -> None:
    # One x group per config (and per config + bf16 output in the step section); bars are
    # the implementations that ran there, the probe a black line across its group.
    groups: dict[str, dict[str, float]] = {}
    floors: dict[str, float] = {}
    for r in rows:
        name = r["implementation"]
        key = r["config"] + ("\n+ bf16 out" if section == "step" and "out" in name else "")
        if name.startswith(PROBE):
            floors[key] = r["ns_per_param"]
        else:
            groups.setdefault(key, {})[name.replace(" + out=grad", "").replace(" + out", "")] = r["ns_per_param"]
    width = 0.8 / max(len(g) for g in groups.values())
    # torch foreach takes several times the others; clip it and write its value on the bar.
    cap = min(1.1 * max(max(g.values()) for g in groups.values()), 2.5 * max(floors.values()))
    for i, (key, values) in enumerate(groups.items()):
        left = i - width * len(values) / 2
        for j, (name, value) in enumerate(values.items()):
            x = left + (j + 0.5) * width
            ax.bar(x, min(value, cap), width * 0.95, color=COLORS.get(name, "#2ca02c"), label=name)
            if value > cap:
                ax.text(x, cap, f"{value:.1f}", ha="center", va="bottom", fontsize=7)
        if key in floors:
            ax.hlines(floors[key], i - 0.45, i + 0.45, colors="black", linewidth=2.5)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8, ncol=len(unique), loc="upper center", frameon=False)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=8)
    ax.set_ylim(0, cap * 1.2)
    ax.set_ylabel("ns per parameter per step")
    ax.set_title("Adam step (params/grads/states)" if section == "step" else "offload step (master/states)")
    ax.grid(axis="y", alpha=0.3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="26", help="params per step: log2 ('26', '2^26') or a count (default 2^26)")
    parser.add_argument("--threads", default=None, help="'sweep' for 1..nproc, or a list '1,2' (default: torch's)")
    parser.add_argument("--rounds", type=int, default=12, help="timed rounds per group (default 12)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (state allocation, page faults)")
    parser.add_argument("--sections", default="step,offload", help="comma list of: step, offload")
    parser.add_argument("--states", default="fp32,bf16,8bit", help="step configs by state precision (comma list)")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeedCPUAdam out even if installed")
    parser.add_argument(
        "--deepspeed-avx2",
        action="store_true",
        help="also DeepSpeedCPUAdam on its op built as on a CPU without AVX-512 (x86; a second JIT build)",
    )
    parser.add_argument("--no-8bit-peers", action="store_true", help="leave bitsandbytes' and torchao's AdamW8bit out")
    parser.add_argument("--json", metavar="PATH", help="write every figure (and the raw step times) here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG of ns/param per config and implementation")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)

    n = parse_size(args.size)
    sections = args.sections.split(",")
    thread_counts = parse_threads(args.threads)
    peers_on, peers_status = peer_status(
        args.no_deepspeed,
        "step" in sections and "8bit" in args.states.split(",") and not args.no_8bit_peers,
        args.deepspeed_avx2 and not args.no_deepspeed,
    )
    info = machine() | {"isa": ops.active_isa(), "size": n, "rounds": args.rounds, "warmup": args.warmup}
    info["deepspeed_builds"] = DEEPSPEED_BUILDS
    print(f"# {info['cpu']}, {info['cpus']} cpus, torch {info['torch']}, cpu_adam ISA {info['isa']}")
    for name, build in DEEPSPEED_BUILDS.items():
        print(f"# {name}: {describe_deepspeed_build(build)}")
    print(f"# {size_label(n)} params, {args.rounds} interleaved rounds after {args.warmup} warmup")

    states = args.states.split(",")
    groups = len(thread_counts) * len(plan_jobs(n, sections, states, peers_on, peers_status))
    progress = Progress(groups, groups * (args.rounds + args.warmup) * n, "bench_step", quiet=args.quiet)
    results: list[dict] = []
    for threads in thread_counts:
        rows = run(n, threads, args.rounds, args.warmup, sections, states, peers_on, peers_status, progress)
        results += rows
        if "step" in sections:
            print(f"\n## Adam step, {threads} thread(s)\n")
            print_step_table([r for r in rows if r["section"] == "step"], peers_status)
            print("\nProbe variants, speed as % of the best (the table's probe):\n")
            print_probe_variants([r for r in rows if r["section"] == "step"])
        if "offload" in sections:
            print(f"\n## Offload step (clip + Adam + bf16 weights), {threads} thread(s)\n")
            print_offload_table([r for r in rows if r["section"] == "offload"])
            print("\nProbe variants, speed as % of the best (the table's probe):\n")
            print_probe_variants([r for r in rows if r["section"] == "offload"])
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": info, "peers": peers_status, "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot, f"{info['cpu']}, {size_label(n)} params")


if __name__ == "__main__":
    main()
