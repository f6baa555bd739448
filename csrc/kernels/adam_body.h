// The one Adam loop, written once against a small vector-ops interface and
// compiled by every ISA file under its own target pragma.
//
// Everything here has internal linkage (anonymous namespace): each ISA file gets
// its own copy compiled for its own target, so the linker can never hand the
// AVX-512 copy of a helper to the scalar kernel.
//
// Bitwise equality across ISAs rests on: the same operation order for every
// lane, no FMA contraction (-ffp-contract=off), correctly rounded sqrt and div,
// and the tails running either the scalar ops below or, on SVE, the same vector
// ops with memory narrowed to the remaining lanes.
#pragma once

#include <cmath>
#include <cstdint>

#include "adam_kernel.h"
#include "probe_body.h"
#include "quant8.h"
#include "random_bits.h"

namespace cpu_adam {
namespace {

// Counter-based random bits: 16 per element, half of one lowbias32 hash of
// (counter / 2 + key), so a vector of 16 elements costs 8 hashes. The key, a
// 64-bit mix of (seed, step, tensor), differs per step, so neighbouring
// counters of one step and one counter over steps both get unrelated bits.
// Vector kernels hash pairs, so a segment's first counter must be even.
constexpr uint32_t kBf16QuietBit = 0x40u;
constexpr uint32_t kF32AbsMask = 0x7FFFFFFFu;
constexpr uint32_t kF32Inf = 0x7F800000u;

// Width-1 ops: the scalar kernel, and the tails of the vector kernels.
struct ScalarOps {
  using F = float;
  using U = uint32_t;
  using H = uint32_t;         // bf16 bits, in whatever form the ISA stores fastest
  using Bytes = ScalarBytes;  // the probe's raw vectors (probe_body.h)
  static constexpr int64_t width() { return 1; }

  static F set1(float x) { return x; }
  static F load(const float* p) { return *p; }
  static F load(const uint16_t* p) { return f32_from_bits(uint32_t{*p} << 16); }
  static void store(float* p, F x) { *p = x; }
  static void store16(uint16_t* p, H bits) { *p = static_cast<uint16_t>(bits); }
  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }

  static H bf16_nearest(F x) {
    const uint32_t u = f32_bits(x);
    if ((u & kF32AbsMask) > kF32Inf) return (u >> 16) | kBf16QuietBit;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  }
  // Rounds away from zero with probability equal to the discarded fraction.
  static H bf16_stochastic(F x, U random16) {
    const uint32_t u = f32_bits(x);
    if ((u & kF32AbsMask) > kF32Inf) return (u >> 16) | kBf16QuietBit;
    return (u + random16) >> 16;
  }
  static U random16(uint32_t counter, uint32_t key) {
    return (lowbias32((counter >> 1) + key) >> (16 * (counter & 1))) & 0xFFFFu;
  }
};

template <class T>
constexpr bool is_bf16 = sizeof(T) == 2;

// g + p * l2 rounded once, as torch's grad.add(param, alpha=weight_decay): rounding the product
// first leaves a residue where g = -p * l2 gives torch 0 (and, with eps = 0, an update of 0 / 0).
// The one multiply-add the kernels fuse on purpose: the ARM build that checks that the compiler
// fused nothing (tests/arm/run.sh) keeps its two halves apart instead.
template <class V, class F>
inline F with_l2(F g, F p, float l2) {
#if defined(CPU_ADAM_CHECK_NO_FUSION)
  F product = V::mul(p, V::set1(l2));
  __asm__ volatile("" : "+w"(product));
  return V::add(g, product);
#else
  return V::fma(p, V::set1(l2), g);
#endif
}

// One vector of elements from i on. Memory goes through `ops`, which a kernel may
// narrow to the first lanes (a predicated tail); the arithmetic runs on every lane.
// kRoot: exp_avg_sq holds float32 roots sqrt(v) (the decoded 8-bit state), read
// as u * u and written as the new sqrt(v).
template <class V, class P, class G, class S, bool kRoot = false>
inline void update(int64_t i, const Segment& s, const Hyper& h, V ops = {}) {
  using F = typename V::F;
  using H = typename V::H;
  P* param = static_cast<P*>(s.param) + i;
  S* exp_avg = static_cast<S*>(s.exp_avg) + i;
  S* exp_avg_sq = static_cast<S*>(s.exp_avg_sq) + i;

  F g = ops.load(static_cast<const G*>(s.grad) + i);
  F p = ops.load(param);
  F m = ops.load(exp_avg);
  F v = ops.load(exp_avg_sq);
  g = V::mul(g, V::set1(h.grad_scale));
  if (h.l2 != 0.0f) g = with_l2<V>(g, p, h.l2);
  p = V::mul(p, V::set1(h.decay));
  m = h.lerp_from_grad ? V::sub(g, V::mul(V::sub(g, m), V::set1(h.one_minus_weight)))
                       : V::add(m, V::mul(V::sub(g, m), V::set1(h.one_minus_beta1)));
  if (kRoot) v = V::mul(v, v);
  v = V::add(V::mul(v, V::set1(h.beta2)), V::mul(V::mul(V::set1(h.one_minus_beta2), g), g));
  const F root = V::sqrt(v);
  const F denom = V::add(V::mul(root, V::set1(h.inv_bc2_sqrt)), V::set1(h.eps));
  p = V::sub(p, V::mul(V::set1(h.step_size), V::div(m, denom)));

  if (!h.preview) {
    if constexpr (is_bf16<S>) {
      ops.store16(exp_avg, V::bf16_nearest(m));
      ops.store16(exp_avg_sq, V::bf16_nearest(v));
    } else {
      ops.store(exp_avg, m);
      ops.store(exp_avg_sq, kRoot ? root : v);
    }
  }
  // The output may alias a bf16 grad: the grad was loaded above.
  if constexpr (is_bf16<P>) {
    const H bits = h.stochastic_rounding
                       ? V::bf16_stochastic(p, V::random16(s.first_counter + static_cast<uint32_t>(i), s.rng_key))
                       : V::bf16_nearest(p);
    if (!h.preview) ops.store16(param, bits);
    if (s.bf16_out) ops.store16(s.bf16_out + i, bits);
  } else {
    if (!h.preview) ops.store(param, p);
    if (s.bf16_out) ops.store16(s.bf16_out + i, V::bf16_nearest(p));
  }
}

// Hardware prefetchers alone keep too few misses in flight once the loop
// carries Adam's arithmetic; asking for each stream's line this far ahead keeps
// memory busy (measured: 5-17% faster steps at 2^26 params, 2 threads).
// Prefetches past the end of a tensor are harmless hints and never fault.
constexpr int64_t kLineElements = 16;       // one 64-byte line of float32
constexpr int64_t kPrefetchDistance = 512;  // elements: 2 KiB of float32 per stream

template <class T, int kForWrite>
inline void prefetch(const void* base, int64_t i) {
  const auto address = reinterpret_cast<uintptr_t>(base) + static_cast<uintptr_t>(i) * sizeof(T);
  __builtin_prefetch(reinterpret_cast<const void*>(address), kForWrite);
}

template <class P, class G, class S>
inline void prefetch_ahead(int64_t i, const Segment& s) {
  const int64_t ahead = i + kPrefetchDistance;
  prefetch<P, 1>(s.param, ahead);
  prefetch<G, 0>(s.grad, ahead);
  prefetch<S, 1>(s.exp_avg, ahead);
  prefetch<S, 1>(s.exp_avg_sq, ahead);
}

// A kernel whose ops have `partial(lanes)` (SVE) runs its last, short vector
// through ops that load and store only those lanes; the others finish with the
// scalar ops, one element at a time.
template <class V, class = void>
constexpr bool kHasPartial = false;
template <class V>
constexpr bool kHasPartial<V, decltype(void(V::partial(int64_t{1})))> = true;

// The preview of the next step, run right after a step over the same elements: it reads back what
// the step stored (rounded as stored), from cache.
struct Then {
  Segment s;
  Hyper h;
  bool active;
};

inline Then then_of(const Segment& s, const Hyper& h) {
  Then t{s, h, h.next != nullptr};
  if (t.active) {
    t.h = *h.next;
    t.h.preview = true;
    t.h.next = nullptr;
    t.s.grad = s.next_grad;
    t.s.rng_key = s.next_rng_key;
    t.s.rng_key_after_wrap = s.next_rng_key_after_wrap;
  }
  return t;
}

template <class V, class P, class G, class S, bool kRoot = false>
void run_segment(const Segment& segment, const Hyper& hyper) {
  // Local copies: the compiler cannot prove that stores through the data
  // pointers leave the caller's structs alone, and would reload every field
  // (and re-test every flag) on every iteration.
  const Then then = then_of(segment, hyper);
  Segment s = segment;
  if (then.active) s.bf16_out = nullptr;  // the output is the next step's
  const Hyper h = hyper;
  // A compile-time constant on x86 and NEON; read from the CPU on SVE. Each
  // group of vectors covers whole lines, with one prefetch per line.
  const int64_t width = V::width();
  const int64_t group = (kLineElements + width - 1) / width * width;
  int64_t i = 0;
  for (; i + group <= s.n; i += group) {
    prefetch_ahead<P, G, S>(i, s);
    // Only vectors wider than a line (SVE from 1024 bits) span more lines; where the
    // width is a constant, this folds away and the loop is the one it always was.
    if (group > kLineElements) {
      for (int64_t line = i + kLineElements; line < i + group; line += kLineElements) prefetch_ahead<P, G, S>(line, s);
    }
    for (int64_t j = i; j < i + group; j += width) {
      update<V, P, G, S, kRoot>(j, s, h);
      if (then.active) update<V, P, G, S, kRoot>(j, then.s, then.h);
    }
  }
  for (; i + width <= s.n; i += width) {
    update<V, P, G, S, kRoot>(i, s, h);
    if (then.active) update<V, P, G, S, kRoot>(i, then.s, then.h);
  }
  if constexpr (kHasPartial<V>) {
    if (i < s.n) {
      update<decltype(V::partial(1)), P, G, S, kRoot>(i, s, h, V::partial(s.n - i));
      if (then.active) update<decltype(V::partial(1)), P, G, S, kRoot>(i, then.s, then.h, V::partial(s.n - i));
    }
  } else {
    for (; i < s.n; ++i) {
      update<ScalarOps, P, G, S, kRoot>(i, s, h);
      if (then.active) update<ScalarOps, P, G, S, kRoot>(i, then.s, then.h);
    }
  }
}

// 8-bit states, one block at a time: decode the codes into float32 buffers on the
// stack, run the Adam loop above on them (the param update sees the new, unrounded
// m and v), then encode the block with its new scales, rounding stochastically.
template <class V, class P, class G>
void run_q8_segment(const Segment& segment, const Hyper& hyper) {
  // The step and the next one's preview run block by block, each on the block's decoded codes.
  const Then then = then_of(segment, hyper);
  Segment s = segment;
  if (then.active) s.bf16_out = nullptr;
  Hyper h = hyper;
  h.next = nullptr;
  alignas(64) float m[kQ8Block] = {};
  alignas(64) float u[kQ8Block] = {};
  auto* m_codes = static_cast<uint8_t*>(s.exp_avg);
  auto* u_codes = static_cast<uint8_t*>(s.exp_avg_sq);
  // Adam over elements [lo, hi) of the block starting at `start`.
  const auto adam = [&](const Segment& from, const Hyper& with, int64_t start, int64_t lo, int64_t hi, uint32_t key) {
    Segment part = from;
    part.param = static_cast<P*>(from.param) + start + lo;
    part.grad = static_cast<const G*>(from.grad) + start + lo;
    part.bf16_out = from.bf16_out ? from.bf16_out + start + lo : nullptr;
    part.exp_avg = m + lo;
    part.exp_avg_sq = u + lo;
    part.n = hi - lo;
    part.first_counter = from.first_counter + static_cast<uint32_t>(start + lo);
    part.rng_key = key;
    run_segment<V, P, G, float, true>(part, with);
  };
  const auto block = [&](const Segment& from, const Hyper& with, int64_t b, int64_t start, int64_t n) {
    decode_avg_block(m_codes + start, n, from.exp_avg_scale[b], m);
    decode_root_block(u_codes + start, n, from.exp_avg_sq_scale[b], u);
    const int64_t wrap = from.counter_wrap - start;
    if (wrap <= 0) {
      adam(from, with, start, 0, n, from.rng_key_after_wrap);
    } else if (wrap >= n) {
      adam(from, with, start, 0, n, from.rng_key);
    } else {
      adam(from, with, start, 0, wrap, from.rng_key);
      adam(from, with, start, wrap, n, from.rng_key_after_wrap);
    }
    if (!with.preview) {
      encode_block({m, u, n, m_codes + start, u_codes + start}, from.first_counter + static_cast<uint32_t>(start),
                   from.rng_key, wrap, from.rng_key_after_wrap, &from.exp_avg_scale[b], &from.exp_avg_sq_scale[b]);
    }
  };
  for (int64_t b = 0, start = 0; start < s.n; ++b, start += kQ8Block) {
    const int64_t n = std::min(kQ8Block, s.n - start);
    block(s, h, b, start, n);
    if (then.active) block(then.s, then.h, b, start, n);  // decodes the codes the step just encoded
  }
}

template <class V>
void run_layout(const Segment& s, Layout l, const Hyper& h) {
  using B = uint16_t;
  if (l.state == DType::q8) {
    switch ((l.param == DType::bf16) << 1 | (l.grad == DType::bf16)) {
      case 0:
        return run_q8_segment<V, float, float>(s, h);
      case 1:
        return run_q8_segment<V, float, B>(s, h);
      case 2:
        return run_q8_segment<V, B, float>(s, h);
      default:
        return run_q8_segment<V, B, B>(s, h);
    }
  }
  const int code = (l.param == DType::bf16) << 2 | (l.grad == DType::bf16) << 1 | (l.state == DType::bf16);
  switch (code) {
    case 0:
      return run_segment<V, float, float, float>(s, h);
    case 1:
      return run_segment<V, float, float, B>(s, h);
    case 2:
      return run_segment<V, float, B, float>(s, h);
    case 3:
      return run_segment<V, float, B, B>(s, h);
    case 4:
      return run_segment<V, B, float, float>(s, h);
    case 5:
      return run_segment<V, B, float, B>(s, h);
    case 6:
      return run_segment<V, B, B, float>(s, h);
    default:
      return run_segment<V, B, B, B>(s, h);
  }
}

template <class V>
void run(const Segment& s, Layout l, const Hyper& h) {
  if (h.probe != ProbeVariant::none) {
    run_probe<typename V::Bytes>(s, l, h.probe);
  } else {
    run_layout<V>(s, l, h);
  }
}

}  // namespace
}  // namespace cpu_adam
