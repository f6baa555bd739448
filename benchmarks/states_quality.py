"""Do 8-bit Adam moments train as well as fp32 ones? Final held-out loss per state precision, two tasks.

Every optimizer trains the same model from the same init on the same batches in the same order,
with the same hyper-parameters (AdamW, warmup then cosine decay) and float32 params, so that only
how the moments are stored differs:

    lm   a byte-level GPT (2 layers, dim 128, seq 64, batch 8) on the source of the Python standard
         library found on this machine (every 10th file held out); cross-entropy in nats per byte
    mlp  the teacher-student MLP regression of sr_experiment.py (held-out MSE, unit-variance targets)

Rows: CPUAdam with fp32, bf16 and 8-bit states; bitsandbytes' and torchao's AdamW8bit where they
import and run on CPU tensors (a row that cannot run says why); torch.optim.AdamW as an independent
fp32 reference. The final loss is the mean of the last few evaluations on fixed held-out data;
seeds change init, data order (and the teacher); every row of a seed shares them.

    python benchmarks/states_quality.py                 # 2 seeds (peers 1), both tasks: 8-15 min on 2 busy cores
    python benchmarks/states_quality.py --seeds 3       # the README's figures: 25 min at load 5-6
    python benchmarks/states_quality.py --quick         # smoke run: 30 steps, ~20 s
    python benchmarks/states_quality.py --tasks mlp --seeds 5 --json q.json --plot q.png

The table and the verdicts go to stdout; each run's end (its final loss) and the time left for
the whole benchmark go to stderr, with the run's start and a bar of its steps when it runs in
this process (``--jobs 1``; ``--quiet``: nothing on stderr).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import sysconfig
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
# An installed cpu_adam wins; a source checkout that was not installed works too.
sys.path.append(str(Path(__file__).resolve().parent.parent))
from _common import Progress, format_table, machine, phase_time
from _gpt import GPT, lm_loss, param_groups
from sr_experiment import Task, mlp

from cpu_adam import CPUAdam

# name -> what builds it (see make_optimizer); the first row is the reference of the relative column
ROWS = {
    "fp32": "CPUAdam, fp32 states",
    "bf16": "CPUAdam, bf16 states",
    "8bit": "CPUAdam, 8-bit states",
    "bnb": "bitsandbytes AdamW8bit",
    "torchao": "torchao AdamW8bit",
    "torch": "torch.optim.AdamW",
}
STYLES = {"fp32": ("black", "-"), "bf16": ("tab:blue", "--"), "8bit": ("tab:red", "-"), "bnb": ("tab:green", "-"),
          "torchao": ("tab:orange", "-"), "torch": ("tab:gray", ":")}  # fmt: skip
REFERENCE = "fp32"
CRITERION = 0.01  # the bar: 8-bit states within 1% of fp32 states
PEER_MODULES = {"bnb": "bitsandbytes", "torchao": "torchao"}
# Time of a step relative to an mlp step with CPUAdam (the README's "wall s" column), so that the
# time left weighs the runs still to come by what they cost.
TASK_COST = {"lm": 7.0, "mlp": 1.0}
ROW_COST = {"bnb": 1.5, "torchao": 3.0}


@dataclass(frozen=True)
class TaskConfig:
    steps: int
    lr: float
    weight_decay: float
    warmup: int
    eval_every: int
    last_evals: int  # the final loss is the mean of this many last evaluations
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    min_lr_ratio: float = 0.1  # cosine decay from lr to lr * this at the last step

    def lr_at(self, step: int) -> float:
        """Linear warmup over `warmup` steps, then cosine to min_lr_ratio * lr (step counts from 1)."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


FULL = {
    "lm": TaskConfig(steps=2000, lr=2e-3, weight_decay=0.1, warmup=100, eval_every=100, last_evals=3),
    "mlp": TaskConfig(steps=2000, lr=1e-3, weight_decay=0.01, warmup=100, eval_every=100, last_evals=3),
}
QUICK = {
    "lm": TaskConfig(steps=30, lr=2e-3, weight_decay=0.1, warmup=5, eval_every=10, last_evals=2),
    "mlp": TaskConfig(steps=30, lr=1e-3, weight_decay=0.01, warmup=5, eval_every=10, last_evals=2),
}

# The LM: bytes in, bytes out.
VOCAB, DIM, LAYERS, HEADS, SEQ, LM_BATCH = 256, 128, 2, 4, 64, 8
HELD_OUT_EVERY = 10  # every 10th stdlib file (by sorted name) is held out
EVAL_WINDOWS, EVAL_CHUNK, EVAL_SEED = 128, 32, 1234


# ---------------------------------------------------------------- data and models


def stdlib_text() -> tuple[Tensor, Tensor, int]:
    """(train bytes, held-out bytes, file count) from the top-level .py files of this Python's stdlib."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if len(files) < 2 * HELD_OUT_EVERY:
        raise RuntimeError(f"too few stdlib sources for the LM task ({len(files)} files)")
    train, held = bytearray(), bytearray()
    for i, path in enumerate(files):
        (held if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1 else train).extend(path.read_bytes() + b"\n")
    train_bytes, held_bytes = (torch.frombuffer(b, dtype=torch.uint8).clone() for b in (train, held))
    return train_bytes, held_bytes, len(files)


def windows(text: Tensor, starts: Tensor) -> Tensor:
    return text[starts[:, None] + torch.arange(SEQ + 1)].long()


class LMTask:
    name = "lm"
    loss_name = "eval loss (nats/byte)"

    def __init__(self, seed: int, batch: int = LM_BATCH) -> None:
        self.seed, self.batch = seed, batch
        self.train, held, self.files = stdlib_text()
        # The same held-out windows for every optimizer and every seed.
        starts = torch.randint(
            0, held.numel() - SEQ - 1, (EVAL_WINDOWS,), generator=torch.Generator().manual_seed(EVAL_SEED)
        )
        self.eval_tokens = windows(held, starts)

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return GPT(VOCAB, DIM, LAYERS, HEADS, SEQ)

    def batches(self, steps: int) -> Iterator[Tensor]:
        gen = torch.Generator().manual_seed(self.seed)
        for _ in range(steps):
            yield windows(self.train, torch.randint(0, self.train.numel() - SEQ - 1, (self.batch,), generator=gen))

    def loss(self, model: nn.Module, batch: Tensor) -> Tensor:
        return lm_loss(model, batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        chunks = self.eval_tokens.split(EVAL_CHUNK)
        return sum(lm_loss(model, c).item() * len(c) for c in chunks) / len(self.eval_tokens)


class MLPTask:
    """sr_experiment.py's teacher-student regression: the teacher, eval set and batches come from its Task."""

    name = "mlp"
    loss_name = "eval MSE"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.task = Task(seed)  # seeds torch's generator, then draws the teacher and the eval set
        # The student's init follows in the same stream, as in sr_experiment.py (reseeding would make it teacher / 3).
        self.init = mlp().state_dict()

    def model(self) -> nn.Module:
        student = mlp()
        student.load_state_dict(self.init)
        return student

    def batches(self, steps: int) -> Iterator[tuple[Tensor, Tensor]]:
        return self.task.batches(self.seed, steps)

    def loss(self, model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.mse_loss(model(x), y)

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        return F.mse_loss(model(self.task.eval_x), self.task.eval_y).item()


TASKS: dict[str, Callable[[int], Any]] = {"lm": LMTask, "mlp": MLPTask}


# ---------------------------------------------------------------- optimizers


def make_optimizer(row: str, groups: list[dict], cfg: TaskConfig) -> torch.optim.Optimizer:
    hyper = {"lr": cfg.lr_at(1), "betas": cfg.betas, "eps": cfg.eps}
    if row in ("fp32", "bf16", "8bit"):
        return CPUAdam(groups, **hyper, state_precision=row)
    if row == "bnb":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(groups, **hyper)
    if row == "torchao":
        from torchao.optim import AdamW8bit

        return AdamW8bit(groups, **hyper)
    if row == "torch":
        return torch.optim.AdamW(groups, **hyper, foreach=False)
    raise ValueError(f"unknown row {row!r}; rows: {', '.join(ROWS)}")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        if isinstance(group["lr"], Tensor):  # torchao keeps lr as a tensor so that a new value does not recompile
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr


def quantized_fraction(optimizer: torch.optim.Optimizer, params: list[Tensor]) -> float:
    """Share of the params whose first moment is held in 8 bits (the peers keep small tensors in fp32)."""

    def is_8bit(state: dict[str, Any]) -> bool:
        for key in ("exp_avg", "state1"):
            if key in state:
                value = state[key]
                # torchao's OptimState8bit subclass reports float32 but holds uint8 codes
                return value.dtype == torch.uint8 or hasattr(value, "codes")
        return False

    quantized = sum(p.numel() for p in params if is_8bit(optimizer.state.get(p, {})))
    return quantized / sum(p.numel() for p in params)


# ---------------------------------------------------------------- one run


@dataclass
class Run:
    task: str
    row: str
    seed: int
    final: float = math.nan  # mean of the last `last_evals` evaluations
    eval_steps: list[int] = field(default_factory=list)
    evals: list[float] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list, repr=False)
    seconds: float = math.nan  # training wall time: forward, backward, step (evaluations excluded)
    first_step_s: float = math.nan  # the first step() alone (torchao compiles there)
    step_ms: float = math.nan  # median step() time after the first
    quantized: float = math.nan  # share of params with 8-bit moments
    # Steps whose global grad norm exceeded CLIP_NORM: how often max_grad_norm=1.0 would clip (this
    # benchmark does not clip), that is how often a step speculated during backward would be redone.
    clipped: float = math.nan
    error: str = ""  # why the row did not run


CLIP_NORM = 1.0


def train(
    task_name: str, row: str, seed: int, cfg: TaskConfig, threads: int, tick: Callable[[], None] = lambda: None
) -> Run:
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", message="cpu_adam: the optimizer step runs on 1 thread")
    run = Run(task_name, row, seed)
    if row in PEER_MODULES and importlib.util.find_spec(PEER_MODULES[row]) is None:
        run.error = f"{PEER_MODULES[row]} not installed"
        return run
    task = TASKS[task_name](seed)
    model = task.model()
    try:
        optimizer = make_optimizer(row, param_groups(model, cfg.weight_decay), cfg)
    except Exception as exc:  # a peer that imports but refuses CPU tensors or this torch
        run.error = f"cannot build: {type(exc).__name__}: {exc}"[:200]
        return run
    params = [p for g in optimizer.param_groups for p in g["params"]]
    step_times: list[float] = []
    clipped = 0
    began = time.perf_counter()
    in_evals = 0.0
    for step, batch in enumerate(task.batches(cfg.steps), 1):
        set_lr(optimizer, cfg.lr_at(step))
        loss = task.loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        clipped += float(norm) > CLIP_NORM
        start = time.perf_counter()
        try:
            optimizer.step()
        except Exception as exc:  # e.g. a peer whose CPU path (or torch.compile on CPU) fails
            run.error = f"step failed: {type(exc).__name__}: {exc}"[:200]
            return run
        step_times.append(time.perf_counter() - start)
        run.train_losses.append(loss.item())
        if step % cfg.eval_every == 0 or step == cfg.steps:
            start = time.perf_counter()
            run.eval_steps.append(step)
            run.evals.append(task.evaluate(model))
            in_evals += time.perf_counter() - start
        tick()
    run.seconds = time.perf_counter() - began - in_evals
    run.first_step_s = step_times[0]
    run.step_ms = 1000 * statistics.median(step_times[1:] or step_times)
    run.final = statistics.fmean(run.evals[-cfg.last_evals :])
    run.quantized = quantized_fraction(optimizer, params)
    run.clipped = clipped / cfg.steps
    return run


# ---------------------------------------------------------------- summary


@dataclass
class Summary:
    task: str
    row: str
    seeds: int
    final_mean: float
    final_sd: float  # across seeds
    rel_mean: float  # mean over seeds of (row - reference) / reference, same seed
    rel_min: float
    rel_max: float
    seconds: float  # median over seeds
    step_ms: float
    quantized: float
    clipped: float
    error: str = ""


def summarize(runs: list[Run], tasks: list[str], rows: list[str]) -> list[Summary]:
    out = []
    for task in tasks:
        ref = {r.seed: r.final for r in runs if r.task == task and r.row == REFERENCE and not r.error}
        for row in rows:
            mine = [r for r in runs if r.task == task and r.row == row]
            ok = [r for r in mine if not r.error]
            if not ok:
                error = mine[0].error if mine else "not run"
                out.append(Summary(task, row, 0, *[math.nan] * 9, error=error))
                continue
            finals = [r.final for r in ok]
            rel = [(r.final - ref[r.seed]) / ref[r.seed] for r in ok if r.seed in ref]
            out.append(
                Summary(
                    task,
                    row,
                    len(ok),
                    statistics.fmean(finals),
                    statistics.stdev(finals) if len(finals) > 1 else math.nan,
                    statistics.fmean(rel) if rel else math.nan,
                    min(rel, default=math.nan),
                    max(rel, default=math.nan),
                    statistics.median(r.seconds for r in ok),
                    statistics.median(r.step_ms for r in ok),
                    statistics.fmean(r.quantized for r in ok),
                    statistics.fmean(r.clipped for r in ok),
                )
            )
    return out


def table(summaries: list[Summary]) -> str:
    headers = [
        "task",
        "optimizer",
        "seeds",
        "final loss (mean ± sd)",
        "vs fp32 states (mean, seed range)",
        "8-bit share",
        "wall s",
        "step() ms",
        f"steps with grad norm > {CLIP_NORM}",
    ]
    rows = []
    for s in summaries:
        if s.error:
            rows.append([s.task, ROWS[s.row], "", s.error, "", "", "", "", ""])
            continue
        sd = f" ± {s.final_sd:.4f}" if not math.isnan(s.final_sd) else ""
        rel = (
            "" if s.row == REFERENCE else f"{100 * s.rel_mean:+.2f}% ({100 * s.rel_min:+.2f} .. {100 * s.rel_max:+.2f})"
        )
        rows.append(
            [
                s.task,
                ROWS[s.row],
                str(s.seeds),
                f"{s.final_mean:.4f}{sd}",
                rel,
                f"{100 * s.quantized:.0f}%",
                f"{s.seconds:.0f}",
                f"{s.step_ms:.2f}",
                f"{100 * s.clipped:.1f}%",
            ]
        )
    return format_table(headers, rows)


def verdicts(summaries: list[Summary], runs: list[Run]) -> list[str]:
    lines = []
    for s in summaries:
        if s.row != "8bit" or s.error:
            continue
        ref = [r.final for r in runs if r.task == s.task and r.row == REFERENCE and not r.error]
        seed_sd = f"{100 * statistics.stdev(ref) / statistics.fmean(ref):.2f}%" if len(ref) > 1 else "n/a (1 seed)"
        within = all(abs(x) <= CRITERION for x in (s.rel_mean, s.rel_min, s.rel_max))
        lines.append(
            f"{s.task}: 8-bit states {100 * s.rel_mean:+.2f}% vs fp32 states (every seed in "
            f"{100 * s.rel_min:+.2f} .. {100 * s.rel_max:+.2f}%): {'within' if within else 'NOT within'} 1%; "
            f"seed-to-seed sd of the fp32 final loss {seed_sd}"
        )
    return lines


# ---------------------------------------------------------------- plot


def plot(runs: list[Run], tasks: list[str], rows: list[str], path: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, len(tasks), figsize=(6.2 * len(tasks), 7.2), dpi=100, squeeze=False)
    for col, task in enumerate(tasks):
        top, bottom = axes[0][col], axes[1][col]
        ref = {r.seed: r for r in runs if r.task == task and r.row == REFERENCE and not r.error}
        late: list[float] = []  # relative differences over the second half of the run, for the y range
        # The top panel averages the seeds every row ran (the peers may run fewer): one set of seeds per curve.
        done = [{r.seed for r in runs if r.task == task and r.row == row and not r.error} for row in rows]
        common = set.intersection(*[d for d in done if d] or [set()])
        for row in rows:
            mine = [r for r in runs if r.task == task and r.row == row and not r.error and r.seed in common]
            if not mine:
                continue
            steps = mine[0].eval_steps
            mean = [statistics.fmean(r.evals[i] for r in mine) for i in range(len(steps))]
            style = {"color": STYLES[row][0], "ls": STYLES[row][1], "lw": 1.5}
            label = f"{ROWS[row]} ({statistics.fmean(r.final for r in mine):.4f})"
            top.plot(steps, mean, label=label, **style)
            paired = [r for r in runs if r.task == task and r.row == row and not r.error and r.seed in ref]
            if paired and row != REFERENCE:
                rel = [
                    statistics.fmean(100 * (r.evals[i] / ref[r.seed].evals[i] - 1) for r in paired)
                    for i in range(len(steps))
                ]
                bottom.plot(steps, rel, **style)
                late += [abs(x) for x, step in zip(rel, steps) if step >= steps[-1] / 2]
        seeds = len(common)
        top.set_title(f"{task}: {'byte-level GPT on stdlib source' if task == 'lm' else 'MLP teacher-student'}")
        top.set_ylabel(f"{TASKS[task].loss_name}, mean of {seeds} seed{'s' * (seeds != 1)}")
        top.set_yscale("log")
        for axis in (top.yaxis.set_major_formatter, top.yaxis.set_minor_formatter):
            axis(matplotlib.ticker.FormatStrFormatter("%g"))
        top.legend(fontsize=8)
        bottom.axhspan(-100 * CRITERION, 100 * CRITERION, color="tab:green", alpha=0.12, lw=0)
        bottom.axhline(0, color="black", lw=1)
        bottom.set_ylabel("vs fp32 states, same seed: mean over seeds (%)")
        bottom.set_xlabel("step")
        # Early evaluations differ by tens of percent; the range shows the late ones and the 1% band.
        limit = min(25.0, max(2.5 * 100 * CRITERION, 1.15 * max(late, default=0.0)))
        bottom.set_ylim(-limit, limit)
        for ax in (top, bottom):
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="30 steps, 1 seed, no torchao (its compile takes a minute)"
    )
    parser.add_argument("--tasks", default="lm,mlp", help="comma list of: lm, mlp")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma list of: {', '.join(ROWS)}")
    parser.add_argument(
        "--seeds",
        type=int,
        default=2,
        help="seeds 0..N-1 (init, data order, teacher) for every row but the peers (--peer-seeds)",
    )
    parser.add_argument("--lm-steps", type=int, help="default 2000")
    parser.add_argument("--mlp-steps", type=int, help="default 2000")
    parser.add_argument(
        "--peer-seeds", type=int, default=1, help="seeds for the bitsandbytes and torchao rows (slow CPU steps)"
    )
    parser.add_argument("--jobs", type=int, help="runs in parallel, each in its own process (default 2; --quick 1)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--plot", default="benchmarks/states_quality.png")
    parser.add_argument("--json", help="also write config, summaries and every run's curves here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args()

    tasks = args.tasks.split(",")
    rows = args.rows.split(",")
    for name, known in ((tasks, TASKS), (rows, ROWS)):
        unknown = [x for x in name if x not in known]
        if unknown:
            parser.error(f"unknown {unknown}; choose from {', '.join(known)}")
    if REFERENCE not in rows:
        rows.insert(0, REFERENCE)
    configs = dict(QUICK if args.quick else FULL)
    if args.jobs is None:
        args.jobs = 1 if args.quick else 2
    for task, steps in (("lm", args.lm_steps), ("mlp", args.mlp_steps)):
        if steps:
            configs[task] = TaskConfig(**{**asdict(configs[task]), "steps": steps})
    seeds = 1 if args.quick and args.seeds == parser.get_default("seeds") else args.seeds
    runs: list[Run] = []
    if args.quick and args.rows == parser.get_default("rows"):
        rows.remove("torchao")
        runs += [Run(t, "torchao", 0, error="skipped in --quick (its first step compiles for a minute)") for t in tasks]
    # Longest runs first, so that the parallel jobs end together: the LM, and the peers' slow Python steps.
    cost = {"torchao": 0, "bnb": 1}
    seeds_of = {r: min(seeds, args.peer_seeds) if r in PEER_MODULES else seeds for r in rows}
    jobs = sorted(
        ((t, r, s) for t in tasks for r in rows for s in range(seeds_of[r])),
        key=lambda j: (j[0] != "lm", cost.get(j[1], 2), j[2]),
    )

    # Each run uses `threads` torch threads; inductor (torchao's compile) would otherwise start a worker per core.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    began = time.perf_counter()

    def work(task: str, row: str) -> float:
        if row in PEER_MODULES and importlib.util.find_spec(PEER_MODULES[row]) is None:
            return 0.0  # ends at once with "not installed"
        return configs[task].steps * TASK_COST[task] * ROW_COST.get(row, 1.0)

    def name(task: str, row: str, seed: int) -> str:
        return f"{task} {ROWS[row]} seed {seed}"

    def outcome(run: Run) -> str:
        return run.error or f"final loss {run.final:.4f}, training {phase_time(run.seconds)}"

    progress = Progress(len(jobs), sum(work(t, r) for t, r, _ in jobs), "states_quality", quiet=args.quiet)
    done: dict[int, Run] = {}
    if args.jobs > 1:
        progress.say(f"{len(jobs)} runs in {args.jobs} processes: a line as each ends")
        with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(train, t, r, s, configs[t], args.threads): i for i, (t, r, s) in enumerate(jobs)}
            for future in as_completed(futures):
                i = futures[future]
                done[i] = future.result()
                t, r, s = jobs[i]
                progress.finished(name(t, r, s), work(t, r), outcome(done[i]))
    else:
        for i, (t, r, s) in enumerate(jobs):
            with progress.phase(name(t, r, s), work(t, r), configs[t].steps) as phase:
                done[i] = train(t, r, s, configs[t], args.threads, phase)
                phase.note = outcome(done[i])
    runs += [done[i] for i in range(len(jobs))]
    elapsed = time.perf_counter() - began

    order = {row: i for i, row in enumerate(ROWS)}
    shown = sorted(set(rows) | {r.row for r in runs}, key=order.__getitem__)
    summaries = summarize(runs, tasks, shown)
    print()
    print(table(summaries))
    print()
    for line in verdicts(summaries, runs):
        print(line)
    plural = "s" * (seeds != 1)
    print(f"{len(jobs)} runs, {seeds} seed{plural}, {args.jobs} jobs x {args.threads} thread(s): {elapsed:.0f} s")
    if plot(runs, tasks, shown, args.plot):
        print(f"wrote {args.plot}")
    else:
        print("matplotlib is not installed: no plot")
    if args.json:
        config = {
            "tasks": {t: asdict(configs[t]) for t in tasks},
            "seeds": seeds,
            "jobs": args.jobs,
            "threads": args.threads,
            "lm": {
                "vocab": VOCAB,
                "dim": DIM,
                "layers": LAYERS,
                "heads": HEADS,
                "seq": SEQ,
                "batch": LM_BATCH,
                "eval_windows": EVAL_WINDOWS,
            },
        }
        out = {
            "config": config,
            "machine": machine(),
            "seconds": elapsed,
            "summaries": [asdict(s) for s in summaries],
            "verdicts": verdicts(summaries, runs),
            "runs": [asdict(r) for r in runs],
        }
        Path(args.json).write_text(json.dumps(out))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
