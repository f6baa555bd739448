"""What the checkpoint's checksums cost: save and load of a state of --gb GB, with and without them.

torch.save computes a CRC-32 of every record unless told not to (save_checkpoint always has it
do so); load_checkpoint reads the file once more to check them, on torch's threads. Rounds
interleave the operations; medians are quoted, and the checks' share of a save plus a load.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import format_table

from cpu_adam import checkpoint, load_checkpoint, save_checkpoint


def _state(gb: float) -> dict[str, torch.Tensor]:
    # An fp32 master and two moments, as an optimizer's state dict holds them.
    n = int(gb * 1e9 / 4 / 3)
    return {name: torch.randn(n) for name in ("master", "exp_avg", "exp_avg_sq")}


@contextlib.contextmanager
def _checksums_off():
    config = torch.utils.serialization.config
    config.save.compute_crc32 = False
    try:
        yield
    finally:
        config.save.compute_crc32 = True


def _save_unchecked(state: dict, path: Path) -> None:
    """save_checkpoint (temporary file, fsync, rename) with the CRC-32s turned off."""
    forced, checkpoint.checksums_on = checkpoint.checksums_on, _checksums_off
    try:
        save_checkpoint(state, path)
    finally:
        checkpoint.checksums_on = forced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gb", type=float, default=1.0, help="size of the state (default 1 GB)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    state = _state(args.gb)
    names = ("save", "save, no CRC", "load, checked", "load, unchecked")
    times: dict[str, list[float]] = {k: [] for k in names}
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        path, plain = Path(directory) / "ckpt.pt", Path(directory) / "plain.pt"
        operations = {
            "save": lambda: save_checkpoint(state, path),
            "save, no CRC": lambda: _save_unchecked(state, plain),
            "load, checked": lambda: load_checkpoint(path),
            "load, unchecked": lambda: load_checkpoint(path, verify=False),
        }
        for r in range(args.rounds + 1):
            order = list(operations)
            for name in order[r % 2 :] + order[: r % 2]:  # each save in turn follows the loads
                start = time.perf_counter()
                operations[name]()
                if r:  # the first round warms the page cache and the allocator
                    times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [[k, f"{v:.3f}", f"{min(times[k]):.3f}", f"{max(times[k]):.3f}"] for k, v in med.items()]
    print(f"state: {args.gb:g} GB (3 fp32 tensors), {args.rounds} rounds, medians in seconds")
    print(format_table(["operation", "median s", "min s", "max s"], rows))
    crc_save = med["save"] - med["save, no CRC"]
    check_load = med["load, checked"] - med["load, unchecked"]
    whole = med["save, no CRC"] + med["load, unchecked"]
    print(f"CRC at save: {crc_save:+.3f} s; the check at load: {check_load:+.3f} s")
    print(f"together {100 * (crc_save + check_load) / whole:.1f}% of an unchecked save plus load ({whole:.3f} s)")
    default = med["save"] + med["load, unchecked"]
    print(f"the check at load: {100 * check_load / default:.1f}% of torch.save's default (CRCs on) plus torch.load")


if __name__ == "__main__":
    main()
