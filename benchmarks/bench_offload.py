"""End-to-end training steps of a small GPT with OffloadOptimizer, on CUDA if present else the CPU.

Per step: forward+backward, grads down (the wait left after the compute stream finished),
CPU step (norm + kernel chunks), weights up (the upload tail left after step() returned);
host and device bytes per parameter from memory_stats() and from the process itself. The
bare kernel (one adam_step over buffers of the same sizes and dtypes) runs interleaved with
the optimizer's step, so both see the same memory-bandwidth weather; their ratio is the
optimizer's overhead.

    python benchmarks/bench_offload.py                 # ~1 minute on 2 CPU cores
    python benchmarks/bench_offload.py --json out.json
    python benchmarks/bench_offload.py --nproc 2       # ZeRO: 2 ranks (gloo on CPU, nccl on GPUs)

The tables go to stdout; a line as the warmup and the timed steps start and end, with the time
left, goes to stderr (``--quiet``: none).

With --nproc N the N ranks train one data-parallel model (--batch is per rank), each holding
1/N of the host state; every rank reports its host bytes per param and step time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _common import Progress
from _gpt import GPT

from cpu_adam.offload import OffloadOptimizer
from cpu_adam.ops import adam_step


def rss_bytes() -> int | None:
    try:
        import psutil

        return psutil.Process().memory_info().rss
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(0)
    model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device=device, dtype=torch.bfloat16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    rss_model = rss_bytes()
    opt = OffloadOptimizer(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4,
        betas=(0.9, 0.95),
        max_grad_norm=1.0,
        state_precision=args.states,
        master_weights_dtype=torch.bfloat16 if args.bf16_master else torch.float32,
        stochastic_rounding=args.bf16_master,
        process_group=dist.group.WORLD if dist.is_initialized() else None,
    )
    rss_opt = rss_bytes()  # before any training: the host buffers, not activations or caches
    stats = opt.memory_stats()
    params = stats["params"]

    # The bare kernel on buffers of the same sizes and dtypes as the optimizer's. Its speed
    # depends on the data (real grads make subnormal moments, a slow path of the FPU), so on
    # the CPU each round it gets a copy of the real grads; on CUDA they are gone by then.
    shards = [g for g, layout in enumerate(opt._rooms.layouts) if layout is not None]
    opt._rooms.model.sync_masters(
        opt._rooms.store
    )  # the masters as the first step will see them: the weights, in the host layout
    state = [opt._rooms.store.export(g) for g in shards]
    bare = [
        (
            s["master"].clone(),
            torch.randn(s["master"].numel()).to(torch.bfloat16),
            torch.zeros(s["master"].numel(), dtype=opt.state_dtype),
            torch.zeros(s["master"].numel(), dtype=opt.state_dtype),
            torch.zeros(s["master"].numel(), dtype=torch.bfloat16),
            s["state_scales"].clone() if "state_scales" in s else None,
        )
        for s in state
    ]
    real_grads = device.type == "cpu"

    def bare_step(step: int, scale: float) -> None:
        p, g, m, v, o, scales = (list(t) for t in zip(*bare))
        adam_step(
            p,
            g,
            m,
            v,
            state_scales=scales if opt.state_precision == "8bit" else None,
            step=step,
            lr=3e-4,
            beta1=0.9,
            beta2=0.95,
            eps=1e-8,
            weight_decay=0.1,
            grad_scale=scale,
            bf16_outs=o,
            stochastic_rounding=opt.stochastic_rounding,
            seed=step,
        )

    gen = torch.Generator().manual_seed(1)
    phases: dict[str, list[float]] = {
        k: [] for k in ("fwd_bwd", "grads_down", "cpu_step", "weights_up", "step", "bare")
    }
    device_peak = 0
    # Rank 0 alone reports: the ranks step together.
    progress = Progress(2, args.warmup + args.steps, "bench_offload", quiet=args.quiet or opt.rank != 0)
    timed = range(args.warmup, args.warmup + args.steps)
    for label, steps in (("warmup", range(args.warmup)), ("timed", timed)):
        with progress.phase(f"{label}, {len(steps)} step{'s' * (len(steps) != 1)}", len(steps)) as tick:
            for i in steps:
                tokens = torch.randint(args.vocab, (args.batch, args.seq), generator=gen).to(device)
                sync(device)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
                loss.backward()
                if device.type == "cuda":
                    torch.cuda.current_stream(device).synchronize()  # compute done; copies down may still run
                    device_peak = max(device_peak, torch.cuda.max_memory_allocated(device))
                t1 = time.perf_counter()
                scale = 1.0
                if real_grads:  # and the same clipping scale: how small the moments get depends on it
                    for g, buffers in zip(shards, bare):
                        buffers[1].copy_(opt._rooms.link.buffers[g].tensor)
                    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b[1].float()) for b in bare]))
                    scale = min(1.0, 1.0 / (float(norm) + 1e-6))
                    t1 = time.perf_counter()
                # Whichever runs first after backward pays for its aftermath: alternate the order.
                if i % 2:
                    tb = time.perf_counter()
                    bare_step(i + 1, scale)
                    bare_s = time.perf_counter() - tb
                    t1 += bare_s
                opt.step()
                t2 = time.perf_counter()
                sync(device)  # the part of the upload that step() left running
                t3 = time.perf_counter()
                if not i % 2:
                    bare_step(i + 1, scale)
                    bare_s = time.perf_counter() - t3
                if i >= args.warmup:
                    timings = opt.step_timings
                    phases["fwd_bwd"].append(t1 - t0)
                    phases["grads_down"].append(timings["grads_wait_s"])
                    phases["cpu_step"].append(timings["norm_s"] + timings["adam_s"])
                    phases["weights_up"].append(t3 - t2)
                    phases["step"].append(t2 - t1)
                    phases["bare"].append(bare_s)
                tick()
    median = {k: statistics.median(v) for k, v in phases.items()}
    overhead = median["step"] / median["bare"] - 1.0
    result = {
        "device": str(device),
        "rank": opt.rank,
        "world_size": opt.world_size,
        "torch_threads": torch.get_num_threads(),
        "params": params,
        "bare_kernel_grads": "real" if real_grads else "random",
        "config": vars(args),
        "median_s": median,
        "step_overhead_vs_bare_kernel": overhead,
        "host_bytes_per_param": stats["host_bytes_per_param"],
        "host_bytes": stats["host_bytes"],
        "rss_growth_per_param": None if rss_model is None else (rss_opt - rss_model) / params,
        "device_buffer_peak_bytes_per_param": opt.memory_stats()["device_peak_bytes"] / params,
        "weights_bytes_per_param": stats["weights_bytes"] / params,
    }
    if device.type == "cuda":
        result["device_peak_beyond_weights_per_param"] = (device_peak - stats["weights_bytes"]) / params
    return result


def share_check(args: argparse.Namespace, fraction: float, steps: int = 3) -> dict[str, Any]:
    """The device's share against the all-host step: the same model and batches, bit for bit, and each one's step().

    On the CPU device the device kernel runs in Triton's interpreter: its time says nothing of a GPU's.
    """
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    runs = {}
    for share in (0.0, fraction):
        torch.manual_seed(0)
        model = GPT(args.vocab, args.dim, args.layers, args.heads, args.seq).to(device=device, dtype=torch.bfloat16)
        opt = OffloadOptimizer(
            model.parameters(),
            lr=3e-4,
            max_grad_norm=1.0,
            state_precision=args.states,
            master_weights_dtype=torch.bfloat16 if args.bf16_master else torch.float32,
            stochastic_rounding=args.bf16_master,
            device_fraction=share,
            bucket_size=2**16,  # groups of several buckets: the share is a fraction of each
        )
        gen = torch.Generator().manual_seed(1)
        times = []
        for _ in range(steps):
            tokens = torch.randint(args.vocab, (args.batch, args.seq), generator=gen).to(device)
            F.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1)).backward()
            sync(device)
            t = time.perf_counter()
            opt.step()
            sync(device)
            times.append(time.perf_counter() - t)
            opt.zero_grad()
        state = opt.state_dict()["state"]
        bits = [p.detach().cpu() for p in model.parameters()]
        bits += [t for g in state.values() for t in g.values() if torch.is_tensor(t)]
        runs[share] = (bits, statistics.median(times), opt.memory_stats()["device_share"])
        opt.close()
    (host_bits, host_s, _), (bits, share_s, share) = runs[0.0], runs[fraction]
    equal = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(bits, host_bits))
    return {"device_share": share, "bitwise_equal": equal, "step_s": share_s, "host_only_step_s": host_s}


def _rank_main(rank: int, args: argparse.Namespace, store_path: str, results_path: str) -> None:
    # torchrun's environment, so the optimizer sees the ranks sharing this node's cores.
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(args.nproc)})
    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if gpu:
        torch.cuda.set_device(rank)
        args.device = f"cuda:{rank}"
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    store = dist.FileStore(store_path, args.nproc)
    dist.init_process_group("nccl" if gpu else "gloo", store=store, rank=rank, world_size=args.nproc)
    try:
        result = run(args)
        results = [None] * args.nproc
        dist.all_gather_object(results, result)
        if rank == 0:
            torch.save(results, results_path)
    finally:
        dist.destroy_process_group()


def run_ranks(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Runs ``run(args)`` on ``args.nproc`` local ranks; returns each rank's result."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only
    with tempfile.TemporaryDirectory() as tmp:
        results_path = os.path.join(tmp, "results.pt")
        mp.start_processes(
            _rank_main, args=(args, os.path.join(tmp, "store"), results_path), nprocs=args.nproc, start_method="spawn"
        )
        return torch.load(results_path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=129)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--states", choices=("fp32", "bf16", "8bit"), default="fp32", help="Adam states' precision")
    parser.add_argument("--bf16-master", action="store_true", help="bf16 master weights (stochastic rounding)")
    parser.add_argument("--max-overhead", type=float, default=0.15, help="on the CPU: fail above this step overhead")
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (ZeRO over torch.distributed)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    parser.add_argument(
        "--device-fraction",
        type=float,
        metavar="F",
        help="also train with the device stepping this share: its bits against the all-host run, and its step()",
    )
    args = parser.parse_args()
    if args.nproc > 1:
        results = run_ranks(args)
        print(f"{'rank':<6}{'host B/param':>14}{'step() ms':>11}{'CPU step ms':>13}{'fwd+bwd ms':>12}{'threads':>9}")
        for r in results:
            m = r["median_s"]
            print(
                f"{r['rank']:<6}{r['host_bytes_per_param']:>14.2f}{m['step'] * 1e3:>11.2f}"
                f"{m['cpu_step'] * 1e3:>13.2f}{m['fwd_bwd'] * 1e3:>12.2f}{r['torch_threads']:>9}"
            )
        result = results[0]
        print("rank 0 in detail:")
    else:
        result = run(args)

    m = result["median_s"]
    print(f"device {result['device']}, {result['params'] / 1e6:.1f}M params, {result['torch_threads']} threads")
    print(f"{'phase':<28}{'median ms':>10}")
    for key, label in (
        ("fwd_bwd", "forward + backward"),
        ("grads_down", "grads down (exposed wait)"),
        ("cpu_step", "CPU step (norm + kernel)"),
        ("weights_up", "weights up (exposed tail)"),
        ("step", "step() total"),
        ("bare", "bare adam_step, same sizes"),
    ):
        print(f"{label:<28}{m[key] * 1e3:>10.2f}")
    overhead = result["step_overhead_vs_bare_kernel"]
    print(f"step overhead over the bare kernel ({result['bare_kernel_grads']} grads): {overhead * 100:+.1f}%")
    print(f"{'bytes per param':<28}{'':>10}")
    for key in (
        "host_bytes_per_param",
        "rss_growth_per_param",
        "weights_bytes_per_param",
        "device_buffer_peak_bytes_per_param",
        "device_peak_beyond_weights_per_param",
    ):
        if result.get(key) is not None:
            print(f"{key:<40}{result[key]:>8.2f}")
    if args.device_fraction is not None and args.nproc == 1:
        share = result["share_check"] = share_check(args, args.device_fraction)
        print(
            f"device share {share['device_share']:.2f}: bitwise equal to the all-host run: "
            f"{'yes' if share['bitwise_equal'] else 'NO'}; step() {share['step_s'] * 1e3:.1f} ms against "
            f"{share['host_only_step_s'] * 1e3:.1f} ms all-host"
            + (" (the device kernel in Triton's interpreter: bits, not speed)" if result["device"] == "cpu" else "")
        )
        if not share["bitwise_equal"]:
            raise SystemExit("the device's share changed the results")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if args.nproc > 1 else result, f, indent=2)
    # With several ranks the step also waits for the collectives: no bare-kernel bound then.
    if result["device"] == "cpu" and args.nproc == 1 and result["step_overhead_vs_bare_kernel"] > args.max_overhead:
        raise SystemExit(f"step overhead above {args.max_overhead:.0%}")


if __name__ == "__main__":
    main()
