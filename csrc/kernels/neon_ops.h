// NEON vector ops (4 lanes), shared by the neon and neon_bf16 kernels.
// Include only from an AArch64 file, after isa_prelude.h.
#pragma once

#include "adam_body.h"

namespace cpu_adam {
namespace {

// NEON has no non-temporal store intrinsic: `stream` is a plain store.
struct NeonBytes {
  using T = uint8x16_t;
  static constexpr int64_t size() { return 16; }
  static T load(const uint8_t* p) { return vld1q_u8(p); }
  static void store(uint8_t* p, T x) { vst1q_u8(p, x); }
  static void stream(uint8_t* p, T x) { vst1q_u8(p, x); }
  static void fence() {}
  static T plus_one(T x) { return vaddq_u8(x, vdupq_n_u8(1)); }
  static T fill(uint8_t b) { return vdupq_n_u8(b); }
  static void keep(T x) { __asm__ volatile("" : : "w"(x)); }
};

struct NeonOps {
  using F = float32x4_t;
  using U = uint32x4_t;
  using H = uint16x4_t;
  using Bytes = NeonBytes;
  static constexpr int64_t width() { return 4; }

  static F set1(float x) { return vdupq_n_f32(x); }
  static F load(const float* p) { return vld1q_f32(p); }
  static F load(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
  static void store(float* p, F x) { vst1q_f32(p, x); }
  static void store16(uint16_t* p, H bits) { vst1_u16(p, bits); }
  static F add(F a, F b) { return vaddq_f32(a, b); }
  static F sub(F a, F b) { return vsubq_f32(a, b); }
  static F mul(F a, F b) { return vmulq_f32(a, b); }
  static F div(F a, F b) { return vdivq_f32(a, b); }
  static F sqrt(F a) { return vsqrtq_f32(a); }
  static F fma(F a, F b, F c) { return vfmaq_f32(c, a, b); }  // c + a * b

  // The upper halves of `wide` (32-bit lanes), narrowed to 16 bits.
  static H high_halves(U wide) { return vshrn_n_u32(wide, 16); }
  static H keep_nan(F x, H rounded) {
    const H quiet = vorr_u16(high_halves(vreinterpretq_u32_f32(x)), vdup_n_u16(static_cast<uint16_t>(kBf16QuietBit)));
    const H is_nan = vmovn_u32(vmvnq_u32(vceqq_f32(x, x)));
    return vbsl_u16(is_nan, quiet, rounded);
  }
  static H bf16_nearest(F x) {
    const U u = vreinterpretq_u32_f32(x);
    const U lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
    return keep_nan(x, high_halves(vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb)));
  }
  static H bf16_stochastic(F x, U random16) {
    return keep_nan(x, high_halves(vaddq_u32(vreinterpretq_u32_f32(x), random16)));
  }
  // Two hashes on a 64-bit vector; zero-extending their 16-bit halves puts the
  // low half of hash k in element 2k and the high half in element 2k + 1.
  static U random16(uint32_t first_counter, uint32_t key) {
    const uint32x2_t pairs = vcreate_u32(uint64_t{1} << 32);  // lanes 0, 1
    uint32x2_t x = vadd_u32(vdup_n_u32((first_counter >> 1) + key), pairs);
    x = veor_u32(x, vshr_n_u32(x, 16));
    x = vmul_u32(x, vdup_n_u32(kMix1));
    x = veor_u32(x, vshr_n_u32(x, 15));
    x = vmul_u32(x, vdup_n_u32(kMix2));
    x = veor_u32(x, vshr_n_u32(x, 16));
    return vmovl_u16(vreinterpret_u16_u32(x));
  }
};

}  // namespace
}  // namespace cpu_adam
