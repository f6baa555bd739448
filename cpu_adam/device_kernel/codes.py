"""8-bit moments on the device: the host kernel's codes and block scales (csrc/kernels/quant8.h), bit for bit.

Blocks are rows of a [rows, 256] tile. Decoding takes the general form of the host's (a code's
magnitude times the block's scale, flushed as the host flushes it), which gives the bits of its fast
form wherever that applies; encoding likewise (``encode_magnitude``), the fast form being the same
code for magnitudes at least 2^-14 of the scale.
"""

import triton
import triton.language as tl

from .floats import MAGNITUDE, SIGN, bits, daz, from_bits, lowbias32, mul

EXPONENT: tl.constexpr = tl.constexpr(0x7F800000)
MANTISSA: tl.constexpr = tl.constexpr(0x007FFFFF)
SMALLEST_NORMAL: tl.constexpr = tl.constexpr(0x00800000)
CODE_EXPONENT_BIAS: tl.constexpr = tl.constexpr(15)
CODE_BIAS: tl.constexpr = tl.constexpr(112)  # float32's exponent bias less the code's
SMALLEST_SCALE: tl.constexpr = tl.constexpr(15 << 23)  # 2^-112
QUIET_NAN: tl.constexpr = tl.constexpr(0x7FC00000)
ONE: tl.constexpr = tl.constexpr(0x3F800000)
CODE_STREAM: tl.constexpr = tl.constexpr(0x6A09E667)


@triton.jit
def decode_magnitude(code, scale, MANTISSA_BITS: tl.constexpr, BEFORE_ROUNDING: tl.constexpr):
    """The magnitude a code holds in a block of ``scale``: 2^(e-15) (1 + f/2^M) times it, or f 2^-(14+M) times it."""
    normal = from_bits((code + (CODE_BIAS << MANTISSA_BITS)) << (23 - MANTISSA_BITS))
    evenly_spaced = code.to(tl.int32).to(tl.float32) * (1.0 / (1 << (14 + MANTISSA_BITS)))
    x = tl.where((code >> MANTISSA_BITS) != 0, normal, evenly_spaced)
    return mul(x, scale, BEFORE_ROUNDING)


@triton.jit
def decode_avg(codes, scale, BEFORE_ROUNDING: tl.constexpr):
    """exp_avg from its codes (sign in bit 7, 3 mantissa bits); ``scale`` broadcasts over the block."""
    c = codes.to(tl.uint32)
    magnitude = decode_magnitude(c & 0x7F, scale, 3, BEFORE_ROUNDING)
    return from_bits(bits(magnitude) | ((c & 0x80) << 24))


@triton.jit
def decode_root(codes, scale, BEFORE_ROUNDING: tl.constexpr):
    """sqrt(exp_avg_sq) from its codes (unsigned, 4 mantissa bits)."""
    return decode_magnitude(codes.to(tl.uint32), scale, 4, BEFORE_ROUNDING)


@triton.jit
def load_scale(scales_ptr, blocks, mask):
    return daz(tl.load(scales_ptr + blocks, mask=mask, other=1.0))


@triton.jit
def block_scale_bits(largest, MANTISSA_BITS: tl.constexpr):
    """A block's scale 2^k (float32 bits) from its largest magnitude's bits: NaN for a non-finite block, 1 for
    an all-zero one, else the power of two at or below the largest, or the next where the largest lies above
    the largest code, and at least 2^-112."""
    largest_code_mantissa = ((1 << MANTISSA_BITS) - 1) << (23 - MANTISSA_BITS)
    exponent = largest & EXPONENT
    up = ((largest & MANTISSA) > largest_code_mantissa) & (exponent < (254 << 23))
    exponent = tl.where(up, exponent + (1 << 23), exponent)
    scale = tl.maximum(exponent, SMALLEST_SCALE)
    scale = tl.where(largest == 0, ONE, scale)
    return tl.where(largest >= EXPONENT, QUIET_NAN, scale)


@triton.jit
def encode_magnitude(magnitude, scale, random16, MANTISSA_BITS: tl.constexpr):
    """The code of a finite magnitude (float32 bits) in a block of scale bits ``scale``, rounded up with
    probability the fraction of a code step cut off, saturating at the largest code."""
    relative = (magnitude - (scale - (CODE_EXPONENT_BIAS << 23))).to(tl.int32, bitcast=True)
    deficit = (1 - (relative >> 23)).to(tl.uint32, bitcast=True)  # > 0 below 2^-14 of the scale
    significand = (magnitude & MANTISSA) | tl.minimum(magnitude, SMALLEST_NORMAL)
    evenly_spaced = significand >> tl.minimum(deficit, 31)
    aligned = tl.where(relative >= SMALLEST_NORMAL, relative.to(tl.uint32, bitcast=True), evenly_spaced)
    shift = 23 - MANTISSA_BITS
    return tl.minimum((aligned + (random16 << (shift - 16))) >> shift, (16 << MANTISSA_BITS) - 1)


@triton.jit
def _largest(magnitudes):
    return tl.reduce(magnitudes, 1, tl.standard._elementwise_max)


@triton.jit
def encode(m, root, first_counter, key, key_after_wrap, wrap, index):
    """Codes of a tile of new moments (rows are blocks) and each block's scales (float32 bits).

    Element ``index`` (from the segment's start) draws hash(first_counter + index + code key) with the key of
    its side of ``wrap``: exp_avg's bits from the low 16, the root's from the high 16.
    """
    m_bits, u_bits = bits(m), bits(root) & MAGNITUDE
    m_magnitude = m_bits & MAGNITUDE
    m_scale = block_scale_bits(_largest(m_magnitude), 3)
    u_scale = block_scale_bits(_largest(u_bits), 4)
    code_key = tl.where(index < wrap, lowbias32(key ^ CODE_STREAM), lowbias32(key_after_wrap ^ CODE_STREAM))
    random = lowbias32(first_counter + index.to(tl.uint32) + code_key)
    m_code = encode_magnitude(m_magnitude, m_scale[:, None], random & 0xFFFF, 3) | ((m_bits & SIGN) >> 24)
    u_code = encode_magnitude(u_bits, u_scale[:, None], random >> 16, 4)
    u_code = tl.where((u_bits != 0) & (u_code == 0), 1, u_code)  # a zero root would make the update m / eps
    m_code = tl.where(m_scale[:, None] == QUIET_NAN, 0, m_code)  # a non-finite block decodes to NaN
    u_code = tl.where(u_scale[:, None] == QUIET_NAN, 0, u_code)
    return m_code.to(tl.uint8), u_code.to(tl.uint8), m_scale, u_scale
