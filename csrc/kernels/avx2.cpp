// AVX2 kernel: 8 lanes (Haswell, Zen and later).
#if defined(__x86_64__) || defined(_M_X64)
#include "isa_prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif

#include "adam_body.h"
#include "squares.h"

namespace cpu_adam {
namespace {

struct Avx2Bytes {
  using T = __m256i;
  static constexpr int64_t size() { return 32; }
  static T load(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void store(uint8_t* p, T x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static void stream(uint8_t* p, T x) { _mm256_stream_si256(reinterpret_cast<__m256i*>(p), x); }
  static void fence() { _mm_sfence(); }
  static T plus_one(T x) { return _mm256_add_epi8(x, _mm256_set1_epi8(1)); }
  static T fill(uint8_t b) { return _mm256_set1_epi8(static_cast<char>(b)); }
  static void keep(T x) { __asm__ volatile("" : : "x"(x)); }
};

struct Avx2Ops {
  using F = __m256;
  using U = __m256i;
  using H = __m256i;
  using Bytes = Avx2Bytes;
  static constexpr int64_t width() { return 8; }

  static U splat(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const U wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  static void store16(uint16_t* p, H bits) {
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  static H keep_nan(F x, U rounded) {
    const U quiet = _mm256_or_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16), splat(kBf16QuietBit));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
  }
  static H bf16_nearest(F x) {
    const U u = _mm256_castps_si256(x);
    const U lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), splat(1));
    return keep_nan(x, _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, splat(0x7FFF)), lsb), 16));
  }
  static H bf16_stochastic(F x, U random16) {
    const U u = _mm256_castps_si256(x);
    return keep_nan(x, _mm256_srli_epi32(_mm256_add_epi32(u, random16), 16));
  }
  // Four hashes on 128-bit lanes, their 16-bit halves zero-extended in order.
  static U random16(uint32_t first_counter, uint32_t key) {
    __m128i x = _mm_add_epi32(_mm_set1_epi32(static_cast<int>((first_counter >> 1) + key)), _mm_setr_epi32(0, 1, 2, 3));
    x = _mm_xor_si128(x, _mm_srli_epi32(x, 16));
    x = _mm_mullo_epi32(x, _mm_set1_epi32(static_cast<int>(kMix1)));
    x = _mm_xor_si128(x, _mm_srli_epi32(x, 15));
    x = _mm_mullo_epi32(x, _mm_set1_epi32(static_cast<int>(kMix2)));
    x = _mm_xor_si128(x, _mm_srli_epi32(x, 16));
    return _mm256_cvtepu16_epi32(x);
  }
};

}  // namespace

void adam_avx2(const Segment& s, Layout l, const Hyper& h) { run<Avx2Ops>(s, l, h); }
double squares_avx2(const void* x, DType dtype, int64_t n) { return squares_of(x, dtype, n); }

}  // namespace cpu_adam

#include "isa_epilogue.h"
#endif
