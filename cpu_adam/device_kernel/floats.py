"""float32 arithmetic as the host kernel does it: each operation rounded once, under flush-to-zero.

The host kernel runs with denormals flushed (MXCSR FTZ and DAZ on x86-64, FPCR.FZ on AArch64):
a denormal input counts as a zero of its sign, and a result that is tiny becomes a zero of its
sign. The two architectures decide "tiny" differently: x86 after rounding (the result rounded to
24 bits with an unbounded exponent is below 2^-126), ARM before (the exact result is). A device
neither flushes as the host does nor flushes the same way on every backend, so these functions
compute each result as IEEE does and then decide tininess exactly, from a scaled copy of the
operation (2^48 times the exact result lies in the normal range, where rounding is exact and
scaling commutes with it), or, before rounding, from exact float64 products and sums:

- x86: tiny when the scaled result is below 2^-78; a result the scaled one puts at or just above
  2^-126 whose IEEE value a flushing backend dropped is 2^-126.
- ARM: tiny when the exact magnitude is below 2^-126.

Every function takes inputs that are normal or zero (``daz`` at each load) and gives results that
are. Division and square root are the correctly rounded ones; Triton's ``/`` and ``tl.sqrt`` are
approximations. Nothing here may be fused: kernels are compiled with ``enable_fp_fusion=False``,
and the one fused multiply-add (``fma``) is the host kernel's own.
"""

import triton
import triton.language as tl

TINY: tl.constexpr = tl.constexpr(2.0**-126)  # the smallest normal float32
TINY_BITS: tl.constexpr = tl.constexpr(0x00800000)
SCALED_TINY: tl.constexpr = tl.constexpr(2.0**-78)  # 2^48 * TINY
SCALED_TWICE_TINY: tl.constexpr = tl.constexpr(2.0**-77)
HALF_SCALE: tl.constexpr = tl.constexpr(2.0**24)
SCALE: tl.constexpr = tl.constexpr(2.0**48)
SIGN: tl.constexpr = tl.constexpr(0x80000000)
MAGNITUDE: tl.constexpr = tl.constexpr(0x7FFFFFFF)
INFINITY_BITS: tl.constexpr = tl.constexpr(0x7F800000)


@triton.jit
def bits(x):
    return x.to(tl.uint32, bitcast=True)


@triton.jit
def from_bits(u):
    return u.to(tl.float32, bitcast=True)


@triton.jit
def wide(x):
    """x as a float64; ``tl.cast`` takes the folded scalars too, which the interpreter passes as Python floats."""
    return tl.cast(x, tl.float64)


@triton.jit
def signed_zero(x):
    return from_bits(bits(x) & SIGN)


@triton.jit
def daz(x):
    """A loaded value as the host reads it: a denormal counts as a zero of its sign."""
    return tl.where((bits(x) & MAGNITUDE) < TINY_BITS, signed_zero(x), x)


@triton.jit
def _after_rounding(r, scaled):
    """``r``, flushed as x86 flushes it, given ``scaled``: the same operation's result times 2^48, rounded once."""
    near = tl.abs(scaled)
    raised = (near >= SCALED_TINY) & (near < SCALED_TWICE_TINY) & ((bits(r) & MAGNITUDE) < TINY_BITS)
    kept = tl.where(raised, from_bits((bits(r) & SIGN) | TINY_BITS), r)
    return tl.where(near < SCALED_TINY, signed_zero(r), kept)


@triton.jit
def _before_rounding(r, tiny):
    return tl.where(tiny, signed_zero(r), r)


@triton.jit
def add(a, b):
    # A sum of normals below 2^-125 is exact (both are multiples of 2^-149): tiny either way when below 2^-126.
    r = a + b
    return tl.where((bits(r) & MAGNITUDE) < TINY_BITS, signed_zero(r), r)


@triton.jit
def sub(a, b):
    r = a - b
    return tl.where((bits(r) & MAGNITUDE) < TINY_BITS, signed_zero(r), r)


@triton.jit
def mul(a, b, BEFORE_ROUNDING: tl.constexpr):
    r = a * b
    if BEFORE_ROUNDING:
        exact = wide(a) * wide(b)  # 48 bits: exact
        return _before_rounding(r, tl.abs(exact) < TINY)
    else:
        return _after_rounding(r, (a * HALF_SCALE) * (b * HALF_SCALE))


@triton.jit
def div(a, b, BEFORE_ROUNDING: tl.constexpr):
    r = tl.math.div_rn(a, b)
    if BEFORE_ROUNDING:
        return _before_rounding(r, tl.abs(wide(a)) < tl.abs(wide(b)) * TINY)
    else:
        return _after_rounding(r, tl.math.div_rn(tl.abs(a) * SCALE, tl.abs(b)))


@triton.jit
def fma(a, b, c, BEFORE_ROUNDING: tl.constexpr):
    """a * b + c, rounded once."""
    r = tl.fma(a, b, c)
    if BEFORE_ROUNDING:
        # The exact sum as a float64 and its rounding error (Knuth's two-sum): below 2^-126 exactly when the
        # rounded sum is, or equals it and the error points below.
        product = wide(a) * wide(b)
        addend = wide(c)
        total = product + addend
        back = total - product
        error = (product - (total - back)) + (addend - back)
        magnitude = tl.abs(total)
        inward = ((total > 0) & (error < 0)) | ((total < 0) & (error > 0))
        return _before_rounding(r, (magnitude < TINY) | ((magnitude == TINY) & inward))
    else:
        return _after_rounding(r, tl.fma(a * HALF_SCALE, b * HALF_SCALE, c * SCALE))


@triton.jit
def sqrt(a):
    # Of a normal or zero: never tiny.
    return tl.math.sqrt_rn(a)


@triton.jit
def load_bf16(bits16):
    """float32 of bf16 bits (int16), as the host widens them: the bits moved up, denormals read as zeros."""
    return daz(from_bits(bits16.to(tl.uint16, bitcast=True).to(tl.uint32) << 16))


@triton.jit
def _keep_nan(x, rounded):
    u = bits(x)
    return tl.where((u & MAGNITUDE) > INFINITY_BITS, (u >> 16) | 0x40, rounded)


@triton.jit
def bf16_nearest(x):
    """bf16 bits (in a uint32) of x rounded to nearest even; a NaN stays a NaN."""
    u = bits(x)
    return _keep_nan(x, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)


@triton.jit
def bf16_stochastic(x, random16):
    """bf16 bits of x rounded away from zero with probability the fraction cut off (16 random bits)."""
    return _keep_nan(x, (bits(x) + random16) >> 16)


@triton.jit
def as_int16(bits32):
    return bits32.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def lowbias32(x):
    """The host kernel's counter hash, on uint32."""
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def random16(counter, key):
    """16 random bits of an element: half of one hash of (counter / 2 + key)."""
    return (lowbias32((counter >> 1) + key) >> ((counter & 1) * 16)) & 0xFFFF
