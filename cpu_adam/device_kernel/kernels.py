"""The host kernel's Adam loop (csrc/kernels/adam_body.h) as Triton kernels: the same operations in the same order.

``update`` is one element's step; ``adam_kernel`` runs it over float32 or bf16 moments, a block of
elements per program; ``adam_q8_kernel`` over 8-bit moments, whole 256-element scale blocks per
program (decode, step, encode with new block scales). bf16 tensors arrive as their int16 bits.
"""

import triton
import triton.language as tl

from .codes import decode_avg, decode_root, encode, load_scale
from .floats import (
    add,
    as_int16,
    bf16_nearest,
    bf16_stochastic,
    daz,
    div,
    fma,
    from_bits,
    load_bf16,
    mul,
    random16,
    sqrt,
    sub,
)

# Triton compiles an integer argument equal to 1 as a constant, and each divisibility by 16 as its own variant: the
# counter and keys change every step (a key is 1 once in 2^32 draws), so they are plain arguments always.
RANDOM_ARGUMENTS = ("first_counter", "key", "key_after_wrap", "wrap")

F32: tl.constexpr = tl.constexpr(0)
BF16: tl.constexpr = tl.constexpr(1)


@triton.jit
def update(
    g,
    p,
    m,
    v,
    step_size,
    inv_bc2_sqrt,
    eps,
    decay,
    l2,
    grad_scale,
    one_minus_beta1,
    one_minus_weight,
    beta2,
    one_minus_beta2,
    HAS_L2: tl.constexpr,
    LERP_FROM_GRAD: tl.constexpr,
    ROOT: tl.constexpr,
    BEFORE_ROUNDING: tl.constexpr,
):
    """(new param, new exp_avg, new exp_avg_sq or, with ``ROOT``, new sqrt(exp_avg_sq)): ``v`` is then the root."""
    g = mul(g, grad_scale, BEFORE_ROUNDING)
    if HAS_L2:
        g = fma(p, l2, g, BEFORE_ROUNDING)
    p = mul(p, decay, BEFORE_ROUNDING)
    if LERP_FROM_GRAD:
        m = sub(g, mul(sub(g, m), one_minus_weight, BEFORE_ROUNDING))
    else:
        m = add(m, mul(sub(g, m), one_minus_beta1, BEFORE_ROUNDING))
    if ROOT:
        v = mul(v, v, BEFORE_ROUNDING)
    # The host's (1 - beta2) * g and step_size * (m / denom), with the block first: products commute, and Triton's
    # interpreter types a scalar-first product as a scalar.
    v = add(mul(v, beta2, BEFORE_ROUNDING), mul(mul(g, one_minus_beta2, BEFORE_ROUNDING), g, BEFORE_ROUNDING))
    root = sqrt(v)
    denom = add(mul(root, inv_bc2_sqrt, BEFORE_ROUNDING), eps)
    p = sub(p, mul(div(m, denom, BEFORE_ROUNDING), step_size, BEFORE_ROUNDING))
    if ROOT:
        v = root
    return p, m, v


@triton.jit
def _load(ptr, offsets, mask, DTYPE: tl.constexpr):
    if DTYPE == BF16:
        return load_bf16(tl.load(ptr + offsets, mask=mask, other=0))
    else:
        return daz(tl.load(ptr + offsets, mask=mask, other=0.0))


@triton.jit
def _store_param(
    param_ptr,
    out_ptr,
    offsets,
    mask,
    p,
    first_counter,
    key,
    key_after_wrap,
    wrap,
    PARAM: tl.constexpr,
    HAS_OUT: tl.constexpr,
    STOCHASTIC: tl.constexpr,
):
    """The new param in its dtype, and its bf16 bits into the output where there is one."""
    if PARAM == BF16:
        if STOCHASTIC:
            counter = first_counter + offsets.to(tl.uint32)
            rng = tl.where(offsets < wrap, key, key_after_wrap)
            rounded = as_int16(bf16_stochastic(p, random16(counter, rng)))
        else:
            rounded = as_int16(bf16_nearest(p))
        tl.store(param_ptr + offsets, rounded, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offsets, rounded, mask=mask)
    else:
        tl.store(param_ptr + offsets, p, mask=mask)
        if HAS_OUT:
            tl.store(out_ptr + offsets, as_int16(bf16_nearest(p)), mask=mask)


@triton.jit(do_not_specialize=RANDOM_ARGUMENTS)
def adam_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, n,
    first_counter, key, key_after_wrap, wrap,
    step_size, inv_bc2_sqrt, eps, decay, l2, grad_scale, one_minus_beta1, one_minus_weight, beta2, one_minus_beta2,
    PARAM: tl.constexpr, GRAD: tl.constexpr, STATE: tl.constexpr, HAS_OUT: tl.constexpr, STOCHASTIC: tl.constexpr,
    HAS_L2: tl.constexpr, LERP_FROM_GRAD: tl.constexpr, BEFORE_ROUNDING: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = _load(grad_ptr, offsets, mask, GRAD)
    p = _load(param_ptr, offsets, mask, PARAM)
    m = _load(exp_avg_ptr, offsets, mask, STATE)
    v = _load(exp_avg_sq_ptr, offsets, mask, STATE)
    p, m, v = update(
        g, p, m, v, step_size, inv_bc2_sqrt, eps, decay, l2, grad_scale, one_minus_beta1, one_minus_weight, beta2,
        one_minus_beta2, HAS_L2, LERP_FROM_GRAD, False, BEFORE_ROUNDING,
    )  # fmt: skip
    if STATE == BF16:
        tl.store(exp_avg_ptr + offsets, as_int16(bf16_nearest(m)), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, as_int16(bf16_nearest(v)), mask=mask)
    else:
        tl.store(exp_avg_ptr + offsets, m, mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, v, mask=mask)
    first = first_counter.to(tl.uint32, bitcast=True)
    k0, k1 = key.to(tl.uint32, bitcast=True), key_after_wrap.to(tl.uint32, bitcast=True)
    _store_param(param_ptr, out_ptr, offsets, mask, p, first, k0, k1, wrap, PARAM, HAS_OUT, STOCHASTIC)


@triton.jit(do_not_specialize=RANDOM_ARGUMENTS)
def adam_q8_kernel(
    param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, out_ptr, scales_ptr, n, scale_stride,
    first_counter, key, key_after_wrap, wrap,
    step_size, inv_bc2_sqrt, eps, decay, l2, grad_scale, one_minus_beta1, one_minus_weight, beta2, one_minus_beta2,
    PARAM: tl.constexpr, GRAD: tl.constexpr, HAS_OUT: tl.constexpr, STOCHASTIC: tl.constexpr,
    HAS_L2: tl.constexpr, LERP_FROM_GRAD: tl.constexpr, BEFORE_ROUNDING: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """``scales_ptr``: the segment's first block's exp_avg scale; its root's lies ``scale_stride`` further."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offsets = rows[:, None] * 256 + tl.arange(0, 256)[None, :]
    mask = offsets < n
    row_mask = rows * 256 < n
    m_scale = load_scale(scales_ptr, rows, row_mask)[:, None]
    u_scale = load_scale(scales_ptr + scale_stride, rows, row_mask)[:, None]
    m = decode_avg(tl.load(exp_avg_ptr + offsets, mask=mask, other=0), m_scale, BEFORE_ROUNDING)
    u = decode_root(tl.load(exp_avg_sq_ptr + offsets, mask=mask, other=0), u_scale, BEFORE_ROUNDING)
    g = _load(grad_ptr, offsets, mask, GRAD)
    p = _load(param_ptr, offsets, mask, PARAM)
    p, m, u = update(
        g, p, m, u, step_size, inv_bc2_sqrt, eps, decay, l2, grad_scale, one_minus_beta1, one_minus_weight, beta2,
        one_minus_beta2, HAS_L2, LERP_FROM_GRAD, True, BEFORE_ROUNDING,
    )  # fmt: skip
    first = first_counter.to(tl.uint32, bitcast=True)
    k0, k1 = key.to(tl.uint32, bitcast=True), key_after_wrap.to(tl.uint32, bitcast=True)
    m_codes, u_codes, m_scale_bits, u_scale_bits = encode(
        tl.where(mask, m, 0.0), tl.where(mask, u, 0.0), first, k0, k1, wrap, offsets
    )
    tl.store(exp_avg_ptr + offsets, m_codes, mask=mask)
    tl.store(exp_avg_sq_ptr + offsets, u_codes, mask=mask)
    tl.store(scales_ptr + rows, from_bits(m_scale_bits), mask=row_mask)
    tl.store(scales_ptr + scale_stride + rows, from_bits(u_scale_bits), mask=row_mask)
    _store_param(param_ptr, out_ptr, offsets, mask, p, first, k0, k1, wrap, PARAM, HAS_OUT, STOCHASTIC)
