// AVX-512 (F/BW/VL) vector ops, shared by the avx512 and avx512_bf16 kernels.
// Include only from a file whose target pragma enables at least avx512f,bw,vl.
#pragma once

#include "adam_body.h"

namespace cpu_adam {
namespace {

struct Avx512Bytes {
  using T = __m512i;
  static constexpr int64_t size() { return 64; }
  static T load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void store(uint8_t* p, T x) { _mm512_storeu_si512(p, x); }
  static void stream(uint8_t* p, T x) { _mm512_stream_si512(reinterpret_cast<__m512i*>(p), x); }
  static void fence() { _mm_sfence(); }
  static T plus_one(T x) { return _mm512_add_epi8(x, _mm512_set1_epi8(1)); }
  static T fill(uint8_t b) { return _mm512_set1_epi8(static_cast<char>(b)); }
  static void keep(T x) { __asm__ volatile("" : : "v"(x)); }
};

struct Avx512Ops {
  using F = __m512;
  using U = __m512i;
  using H = __m512i;
  using Bytes = Avx512Bytes;
  static constexpr int64_t width() { return 16; }

  static U splat(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static F load(const uint16_t* p) {
    const U wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  static void store16(uint16_t* p, H bits) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  static H keep_nan(F x, U rounded) {
    const U quiet = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), splat(kBf16QuietBit));
    return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), quiet);
  }
  static H bf16_nearest(F x) {
    const U u = _mm512_castps_si512(x);
    const U lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), splat(1));
    return keep_nan(x, _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, splat(0x7FFF)), lsb), 16));
  }
  static H bf16_stochastic(F x, U random16) {
    const U u = _mm512_castps_si512(x);
    return keep_nan(x, _mm512_srli_epi32(_mm512_add_epi32(u, random16), 16));
  }
  // Eight hashes on 256-bit lanes; zero-extending their 16-bit halves puts the
  // low half of hash k in element 2k and the high half in element 2k + 1.
  static U random16(uint32_t first_counter, uint32_t key) {
    const __m256i pairs = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>((first_counter >> 1) + key)), pairs);
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMix1)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(kMix2)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    return _mm512_cvtepu16_epi32(x);
  }
};

}  // namespace
}  // namespace cpu_adam
