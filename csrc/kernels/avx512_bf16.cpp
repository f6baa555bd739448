// AVX-512 kernel with the AVX512-BF16 round-to-nearest-even convert.
//
// vcvtneps2bf16 treats denormal inputs as zero where torch would keep them;
// that never matters here because the kernel runs with denormals flushed
// (denormals.h), so no float it stores is denormal.
#include "adam_kernel.h"

#if defined(CPU_ADAM_HAS_AVX512_BF16)
#include "isa_prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#endif

#include "avx512_ops.h"

namespace cpu_adam {
namespace {

struct Avx512Bf16Ops : Avx512Ops {
  using H = __m256i;

  static void store16(uint16_t* p, H bits) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits); }
  static H bf16_nearest(F x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // NOLINT: vector-type cast
  // The random bits are added to every lane but NaNs, the low half cleared, and
  // the convert, exact on such values, packs and quiets NaNs as the scalar code
  // does. (Stored values are arithmetic results, so a NaN here is never
  // signaling: its quiet bit survives the clearing.)
  static H bf16_stochastic(F x, U random16) {
    const U u = _mm512_castps_si512(x);
    const __mmask16 not_nan = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    const U truncated = _mm512_and_si512(_mm512_mask_add_epi32(u, not_nan, u, random16), splat(0xFFFF0000u));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(truncated));  // NOLINT: vector-type cast
  }
};

}  // namespace

void adam_avx512_bf16(const Segment& s, Layout l, const Hyper& h) { run<Avx512Bf16Ops>(s, l, h); }

}  // namespace cpu_adam

#include "isa_epilogue.h"
#endif
