"""Seed inputs for the libFuzzer targets, in the formats their headers describe.

    python3 tests/kernels/seeds.py DIR   # writes DIR/adam/* and DIR/overlap/*

adam: every dtype layout with each option set (plain, bf16 output, output = bf16 grad,
stochastic rounding, the probe, an 8-bit state wrapping the counter) at sizes around the vector
widths and the 8-bit block, and inputs made of special bit patterns (NaN, inf, denormals, the
largest float and bf16 values). overlap: the layouts checks.cpp meets (slices, interleaved and
column-block views, transposes, expanded grads) and a few that overlap.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

HEADER_BYTES = 104

# Flags (byte 0 of an adam input).
PARAM_BF16, GRAD_BF16 = 1, 2
STATE_F32, STATE_BF16, STATE_Q8 = 0, 4, 8
OUT, OUT_IS_GRAD, STOCHASTIC, PROBE = 16, 32, 64, 128

# How each array is generated (bytes 99-103): kind | parameter << 2.
SPECIAL, BINADES, EDGE, TINY = 0, 1, 2, 3
POWERS_OF_TWO = 0x80  # state scales only: keep the exponent bits
# Magnitudes 2^-2..2^5 (param), 2^-10..2^-3 (grad), 2^-12..2^-5 (exp_avg), 2^-20..2^-13
# (exp_avg_sq), scales 2^0..2^7.
DEFAULT_HOW = (
    BINADES | 38 << 2,
    BINADES | 30 << 2,
    BINADES | 28 << 2,
    BINADES | 20 << 2,
    POWERS_OF_TWO | BINADES | 8 << 2,
)


def listed(index: int) -> bytes:
    """A scalar: the index-th listed value of its kind."""
    return bytes([index]) + bytes(8)


def raw(value: float) -> bytes:
    """A scalar given as the bits of a double."""
    return b"\x80" + struct.pack("<d", value)


def adam_input(
    flags: int,
    n: int,
    *,
    offset: int = 0,
    counter: int = 0,
    wrap: int = 0,
    adamw: bool = True,
    scalars: tuple[bytes, ...] = (),
    how: tuple[int, ...] = DEFAULT_HOW,
    seed: int = 1,
    words: tuple[int, ...] = (),
) -> bytes:
    size_bits = n if n < 161 else 0x8000 | n
    head = struct.pack("<BBHBIBIIB", flags, 0, size_bits, offset, counter, wrap, 0x12345678, 0x9ABCDEF0, int(adamw))
    scalar_bytes = b"".join(scalars) + b"".join(listed(0) for _ in range(8 - len(scalars)))
    body = head + scalar_bytes + struct.pack("<Q", seed) + bytes(how)
    assert len(body) == HEADER_BYTES
    return body + b"".join(struct.pack("<I", w) for w in words)


def adam_seeds() -> list[bytes]:
    seeds = []
    option_sets = [0, OUT, OUT | OUT_IS_GRAD | STOCHASTIC, STOCHASTIC | OUT, PROBE | OUT]
    for param in (0, PARAM_BF16):
        for grad in (0, GRAD_BF16):
            for state in (STATE_F32, STATE_BF16, STATE_Q8):
                for k, options in enumerate(option_sets):
                    for n in (0, 1, 7, 8, 15, 16, 17, 33, 64, 65, 129, 255, 256, 257, 4097)[k::5]:
                        seeds.append(adam_input(param | grad | state | options, n, offset=n % 3, counter=2 * n))
                # The counter wraps inside the last block of an 8-bit state's segment.
                if state == STATE_Q8:
                    seeds.append(adam_input(param | grad | state | STOCHASTIC, 300, wrap=1 | 40 << 1))
    # Special bit patterns in every array, with L2 decay, a grad scale and tiny eps.
    specials = (SPECIAL, SPECIAL, SPECIAL, SPECIAL, SPECIAL)
    tiny_hyper = (raw(1e-3), raw(0.9), raw(0.999), raw(1e-45), raw(0.01), raw(-2.0))
    for flags in (0, PARAM_BF16 | GRAD_BF16 | OUT, STATE_BF16 | OUT, STATE_Q8, PARAM_BF16 | STATE_Q8 | STOCHASTIC):
        seeds.append(adam_input(flags, 131, how=specials, seed=7))
        seeds.append(adam_input(flags, 67, adamw=False, scalars=tiny_hyper, how=(TINY, TINY, TINY, TINY, SPECIAL)))
    # One edge value per array, then words given outright: NaN, inf, the largest float and bf16 values,
    # denormals, ties between bf16 values.
    edges = (0x7FC00000, 0xFF800000, 0x7F7FFFFF, 0x7F7F0000, 0x00000001, 0x807FFFFF, 0x3F808000, 0x3F818000)
    for flags in (0, PARAM_BF16 | OUT, GRAD_BF16 | STATE_BF16, STATE_Q8):
        seeds.append(adam_input(flags, 17, how=(EDGE | 3 << 2, EDGE | 7 << 2, EDGE, EDGE | 9 << 2, EDGE), words=edges))
    return seeds


def layout(item: int, base: int, dims: list[tuple[int, int]]) -> bytes:
    """One tensor of an overlap input: item size, base address, (byte stride, size) per dim."""
    out = bytes([{1: 0, 2: 1, 4: 2, 8: 3}[item] | len(dims) << 2]) + struct.pack("<I", base)
    for d, (stride, size) in enumerate(dims):
        wide = d == 0 and size > 17
        assert stride < 1 << 16 and size <= (65 if wide else 17)
        out += struct.pack("<HBB", stride, 0x80 if wide else 0, size - 1)
    return out


def overlap_seeds() -> list[bytes]:
    return [
        layout(4, 0, [(4, 64)]) + layout(4, 256, [(4, 64)]),  # neighbouring slices
        layout(4, 0, [(4, 64)]) + layout(4, 252, [(4, 64)]),  # one element shared
        layout(4, 0, [(8, 32)]) + layout(4, 4, [(8, 32)]),  # interleaved
        layout(2, 0, [(2, 8), (64, 16)]) + layout(2, 16, [(2, 8), (64, 16)]),  # column blocks
        layout(4, 0, [(4, 16), (64, 16)]) + layout(4, 0, [(64, 16), (4, 16)]),  # a transpose of itself
        layout(4, 0, [(0, 16), (4, 16)]) + layout(4, 64, [(4, 16)]),  # an expanded grad
        layout(4, 0, [(12, 10), (40, 7)]) + layout(2, 6, [(10, 12), (36, 5)]),  # unrelated strides
        layout(1, 3, [(3, 17), (17, 9), (200, 4)]) + layout(8, 1, [(16, 12), (96, 3), (500, 2)]),
    ]


def main(directory: str) -> None:
    for name, seeds in (("adam", adam_seeds()), ("overlap", overlap_seeds())):
        target = Path(directory) / name
        target.mkdir(parents=True, exist_ok=True)
        for i, seed in enumerate(seeds):
            (target / f"seed-{i:03d}").write_bytes(seed)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: seeds.py DIR")
    main(sys.argv[1])
