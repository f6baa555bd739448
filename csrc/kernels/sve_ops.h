// SVE vector ops, shared by the sve and sve_bf16 kernels. Vector-length
// agnostic: the width is read from the CPU (4 to 64 lanes), and the last,
// short vector of a segment loads and stores under a predicate.
// Include only from a file whose target pragma enables SVE.
#pragma once

#include "adam_body.h"

namespace cpu_adam {
namespace {

// The same ops, with memory narrowed to the first `lanes` elements.
template <class Full>
struct SvePartial : Full {
  int64_t lanes;

  svbool_t active() const { return svwhilelt_b32_s64(0, lanes); }
  typename Full::F load(const float* p) const { return svld1_f32(active(), p); }
  typename Full::F load(const uint16_t* p) const { return Full::widen16(svld1uh_u32(active(), p)); }
  void store(float* p, typename Full::F x) const { svst1_f32(active(), p, x); }
  void store16(uint16_t* p, typename Full::H bits) const { svst1h_u32(active(), p, bits); }
};

struct SveBytes {
  using T = svuint8_t;
  static int64_t size() {
    int64_t bytes = static_cast<int64_t>(svcntb());
    __asm__("" : "+r"(bytes));  // as in SveOps::width()
    return bytes;
  }
  static svbool_t all() { return svptrue_b8(); }
  static T load(const uint8_t* p) { return svld1_u8(all(), p); }
  static void store(uint8_t* p, T x) { svst1_u8(all(), p, x); }
  static void stream(uint8_t* p, T x) { svstnt1_u8(all(), p, x); }
  static void fence() {}
  static T plus_one(T x) { return svadd_n_u8_x(all(), x, 1); }
  static T fill(uint8_t b) { return svdup_n_u8(b); }
  static void keep(T x) { __asm__ volatile("" : : "w"(x)); }
};

struct SveOps {
  using F = svfloat32_t;
  using U = svuint32_t;
  using H = svuint32_t;  // bf16 bits in the low half of each lane; stores narrow
  using Bytes = SveBytes;
  // Read once per segment. The empty asm hides the value's origin: GCC 11 crashes
  // (in value-range propagation) dividing by a vector-length count.
  static int64_t width() {
    int64_t lanes = static_cast<int64_t>(svcntw());
    __asm__("" : "+r"(lanes));
    return lanes;
  }
  static SvePartial<SveOps> partial(int64_t lanes) { return {{}, lanes}; }

  static svbool_t all() { return svptrue_b32(); }
  static F widen16(U bits) { return svreinterpret_f32_u32(svlsl_n_u32_x(all(), bits, 16)); }
  static F set1(float x) { return svdup_n_f32(x); }
  static F load(const float* p) { return svld1_f32(all(), p); }
  static F load(const uint16_t* p) { return widen16(svld1uh_u32(all(), p)); }
  static void store(float* p, F x) { svst1_f32(all(), p, x); }
  static void store16(uint16_t* p, H bits) { svst1h_u32(all(), p, bits); }
  static F add(F a, F b) { return svadd_f32_x(all(), a, b); }
  static F sub(F a, F b) { return svsub_f32_x(all(), a, b); }
  static F mul(F a, F b) { return svmul_f32_x(all(), a, b); }
  static F div(F a, F b) { return svdiv_f32_x(all(), a, b); }
  static F sqrt(F a) { return svsqrt_f32_x(all(), a); }
  static F fma(F a, F b, F c) { return svmla_f32_x(all(), c, a, b); }  // c + a * b

  static H keep_nan(F x, U rounded) {
    const U quiet = svorr_n_u32_x(all(), svlsr_n_u32_x(all(), svreinterpret_u32_f32(x), 16), kBf16QuietBit);
    return svsel_u32(svcmpuo_f32(all(), x, x), quiet, rounded);
  }
  static H bf16_nearest(F x) {
    const U u = svreinterpret_u32_f32(x);
    const U lsb = svand_n_u32_x(all(), svlsr_n_u32_x(all(), u, 16), 1);
    return keep_nan(x, svlsr_n_u32_x(all(), svadd_u32_x(all(), svadd_n_u32_x(all(), u, 0x7FFF), lsb), 16));
  }
  static H bf16_stochastic(F x, U random16) {
    return keep_nan(x, svlsr_n_u32_x(all(), svadd_u32_x(all(), svreinterpret_u32_f32(x), random16), 16));
  }
  // Hashes of consecutive pairs in every lane; unpacking the 16-bit halves of
  // the low half of the lanes puts the low half of hash k in element 2k and the
  // high half in element 2k + 1.
  static U random16(uint32_t first_counter, uint32_t key) {
    U x = svindex_u32((first_counter >> 1) + key, 1);
    x = sveor_u32_x(all(), x, svlsr_n_u32_x(all(), x, 16));
    x = svmul_n_u32_x(all(), x, kMix1);
    x = sveor_u32_x(all(), x, svlsr_n_u32_x(all(), x, 15));
    x = svmul_n_u32_x(all(), x, kMix2);
    x = sveor_u32_x(all(), x, svlsr_n_u32_x(all(), x, 16));
    return svunpklo_u32(svreinterpret_u16_u32(x));
  }
};

}  // namespace
}  // namespace cpu_adam
