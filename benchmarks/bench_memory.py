"""Host bytes per parameter held by CPUAdam, torch.optim.AdamW and DeepSpeedCPUAdam; then by the
offload optimizer (master weights, moments and its pinned bf16 buffer, on the CPU device).

    python benchmarks/bench_memory.py                 # 2^24 params per case
    python benchmarks/bench_memory.py --size 2^26 --json memory.json

The tables go to stdout; a line as each case starts and ends, with the time left, goes to
stderr (``--quiet``: none).

Each case runs in a fresh child process, so the allocator's leftovers and the high-water mark
of one case never count towards another. Measured, not computed from the dtypes:
- state: the bytes of the tensors the optimizer put in ``optimizer.state`` (storages counted once);
- RSS delta: the process's resident memory after the first step minus before it (the state the
  step allocated and kept, as the OS sees it);
- peak extra: the high-water mark of resident memory (ru_maxrss) above the pre-step level, i.e.
  the kept state plus temporaries the step needed while it ran.
Params and grads are allocated before the step and reported from their dtypes: the optimizer
takes them as given (torch wants a grad in its param's dtype, so all three get the same).
For the offload optimizer the model's bf16 weights and grads are on the device: its host bytes
are what ``memory_stats()`` counts after two steps, and the RSS delta over its construction
(every host buffer is allocated and zeroed there). Here the CPU stands in for the device, so
the process's RSS also grows by the stand-in device's grads and their temporaries, which on a
GPU are device memory; that growth is not the optimizer's host state and is not reported.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# An installed cpu_adam wins; a source checkout that was not installed works too.
sys.path.append(str(Path(__file__).resolve().parent.parent))
from _common import Progress, deepspeed_adam, format_table, parse_size, size_label

CPU_ADAM, TORCH_FOREACH, TORCH_FUSED, DEEPSPEED = (
    "CPUAdam",
    "torch AdamW foreach",
    "torch AdamW fused",
    "DeepSpeedCPUAdam",
)
# (params, states): the rows of the byte budget (benchmarks/README.md, "Bytes per parameter").
CASES = [("fp32", "fp32"), ("fp32", "bf16"), ("bf16", "fp32"), ("bf16", "bf16"), ("fp32", "8bit"), ("bf16", "8bit")]
IMPLEMENTATIONS = (CPU_ADAM, TORCH_FOREACH, TORCH_FUSED, DEEPSPEED)
OFFLOAD = "OffloadOptimizer"
# (master weights, states, stochastic rounding of bf16 masters)
OFFLOAD_CASES = [
    ("fp32", "fp32", False),
    ("fp32", "bf16", False),
    ("bf16", "bf16", True),
    ("fp32", "8bit", False),
    ("bf16", "8bit", True),
]


def supported(impl: str, param: str, state: str) -> bool:
    if state == "8bit":
        return impl == CPU_ADAM  # codes + block scales; the peers have no 8-bit states
    if impl in (TORCH_FOREACH, TORCH_FUSED):
        return state == param  # torch keeps moments in the param dtype
    if impl == DEEPSPEED:
        return state == "fp32" or state == param  # fp32 states, or the param dtype
    return True


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(impl: str, param: str, state: str, n: int) -> dict:
    """Runs in the child: one optimizer on one flat param, two steps, the figures per param."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}
    # Filled in place: a temporary here would lift ru_maxrss above the pre-step level and
    # hide the step's own peak under it.
    p = torch.nn.Parameter(torch.randn(n, dtype=dtype[param]))
    p.grad = torch.randn(n, dtype=dtype[param]).mul_(1e-2)
    hyper = {"lr": 1e-3, "weight_decay": 0.01}
    if impl == CPU_ADAM:
        from cpu_adam import CPUAdam, ops

        ops.active_isa()  # loads the kernels before the measurement, not inside it
        opt = CPUAdam([p], **hyper, state_precision=state)
    elif impl in (TORCH_FOREACH, TORCH_FUSED):
        flag = "foreach" if impl == TORCH_FOREACH else "fused"
        opt = torch.optim.AdamW([p], **hyper, **{flag: True})
    else:
        ds_cls, _ = deepspeed_adam()
        opt = ds_cls([p], **hyper, fp32_optimizer_states=state == "fp32")
    before = rss_bytes()
    opt.step()
    after = rss_bytes()
    opt.step()  # a second step must not grow anything: the state is allocated once
    after_two = rss_bytes()
    peak = peak_rss_bytes()
    storages: dict[int, int] = {}
    moment_dtypes = set()
    for s in opt.state.values():
        for t in s.values():
            if torch.is_tensor(t):  # the step count is a 0-d tensor in torch, an int in DeepSpeed
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                if t.numel() == n:
                    moment_dtypes.add(str(t.dtype).replace("torch.", ""))
    return {
        "implementation": impl,
        "params": param,
        "states": state,
        "size": n,
        "param_grad_bytes_per_param": (p.element_size() + p.grad.element_size()),
        "state_bytes_per_param": sum(storages.values()) / n,
        "state_dtypes": sorted(moment_dtypes),
        "rss_delta_bytes_per_param": (after - before) / n,
        "rss_growth_second_step_per_param": (after_two - after) / n,
        "peak_extra_bytes_per_param": (peak - before) / n,
    }


def measure_offload(master: str, state: str, n: int) -> dict:
    """Runs in the child: the offload optimizer over one flat bf16 param, two steps."""
    import torch

    from cpu_adam import OffloadOptimizer, ops

    ops.active_isa()
    warm = torch.nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
    OffloadOptimizer([warm]).close()  # torch.optim's first construction imports ~70 MB of modules
    p = torch.nn.Parameter(torch.randn(n, dtype=torch.bfloat16))
    grad = torch.randn(n, dtype=torch.bfloat16).mul_(1e-2)
    before = rss_bytes()
    master_dtype = torch.float32 if master == "fp32" else torch.bfloat16
    opt = OffloadOptimizer(
        [p],
        lr=1e-3,
        weight_decay=0.01,
        master_weights_dtype=master_dtype,
        state_precision=state,
        stochastic_rounding=master == "bf16",
    )
    built = rss_bytes()
    for _ in range(2):
        p.backward(grad)  # the optimizer's hook takes the grad as backward delivers it
        opt.step()
        opt.zero_grad()
    stats = opt.memory_stats()
    return {
        "implementation": OFFLOAD,
        "master": master,
        "states": state,
        "size": n,
        "host_bytes_per_param": stats["host_bytes_per_param"],
        "master_bytes_per_param": stats["master_bytes"] / n,
        "state_bytes_per_param": stats["state_bytes"] / n,
        "pinned_bytes_per_param": stats["pinned_bytes"] / n,
        "accumulator_bytes_per_param": stats["accumulator_bytes"] / n,
        "rss_delta_built_bytes_per_param": (built - before) / n,
    }


def run_child(impl: str, param: str, state: str, n: int) -> dict:
    cmd = [sys.executable, __file__, "--child", impl, param, state, "--size", str(n)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{impl} {param}/{state} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="24", help="params: log2 ('24', '2^24') or a count (default 2^24)")
    parser.add_argument("--json", metavar="PATH", help="write the figures here")
    parser.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeedCPUAdam out even if installed")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument("--child", nargs=3, metavar=("IMPL", "PARAMS", "STATES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    n = parse_size(args.size)
    if args.child:
        impl, first, state = args.child
        print(json.dumps(measure_offload(first, state, n) if impl == OFFLOAD else measure(impl, first, state, n)))
        return

    ds_cls, ds_status = deepspeed_adam()
    if args.no_deepspeed:
        ds_status = "skipped"

    def why_not(impl: str, param: str, state: str) -> str:
        if impl == DEEPSPEED and (ds_cls is None or args.no_deepspeed):
            return ds_status
        return "" if supported(impl, param, state) else "not supported"

    children = sum(not why_not(impl, *case) for case in CASES for impl in IMPLEMENTATIONS) + len(OFFLOAD_CASES)
    progress = Progress(children, children, "bench_memory", quiet=args.quiet)
    rows, results = [], []
    for param, state in CASES:
        for impl in IMPLEMENTATIONS:
            label = [f"{param}/{state}", impl]
            if reason := why_not(impl, param, state):
                rows.append([*label, reason, "", "", "", ""])
                continue
            with progress.phase(f"{impl}, {param}/{state}", 1, 0):
                r = run_child(impl, param, state, n)
            results.append(r)
            total = r["param_grad_bytes_per_param"] + r["state_bytes_per_param"]
            rows.append(
                [
                    *label,
                    f"{r['state_bytes_per_param']:.2f} ({','.join(r['state_dtypes'])})",
                    f"{r['rss_delta_bytes_per_param']:.2f}",
                    f"{r['peak_extra_bytes_per_param']:.2f}",
                    str(r["param_grad_bytes_per_param"]),
                    f"{total:.2f}",
                ]
            )
    print(f"# host bytes per parameter, {size_label(n)} params, one flat param per optimizer\n")
    headers = ["params/states", "optimizer", "state (tensors)", "RSS delta, 1st step", "peak extra", "param+grad"]
    print(format_table([*headers, "held in all"], rows))

    offload_rows = []
    for master, state, stochastic in OFFLOAD_CASES:
        with progress.phase(f"{OFFLOAD}, {master}{' SR' if stochastic else ''}/{state}", 1, 0):
            r = run_child(OFFLOAD, master, state, n)
        results.append(r)
        offload_rows.append(
            [
                f"{master}{' SR' if stochastic else ''}/{state}",
                *(f"{r[k]:.2f}" for k in ("master_bytes_per_param", "state_bytes_per_param", "pinned_bytes_per_param")),
                f"{r['host_bytes_per_param']:.2f}",
                f"{r['rss_delta_built_bytes_per_param']:.2f}",
            ]
        )
    print(f"\n# {OFFLOAD}: host bytes per parameter, {size_label(n)} params (bf16 weights and grads on the device)\n")
    headers = ["master/states", "master", "states", "pinned bf16", "host (memory_stats)", "RSS delta, built"]
    print(format_table(headers, offload_rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"size": n, "deepspeed": ds_status, "results": results}, indent=1))


if __name__ == "__main__":
    main()
