// 8-bit codes of the Adam moments, per block of kQ8Block elements (see README.md,
// "8-bit states"). Pure integer and IEEE operations, so every ISA and the Python
// conversion (cpu_adam/quant8.py) give the same bits.
//
// A block's scale is a power of two 2^k <= its largest magnitude, so value / scale
// is exact and lies in [0, 2). The normalised magnitude x is a tiny float with
// kMantissa bits of mantissa and a 4-bit exponent field e (bias 15):
//   e > 0: x = 2^(e - 15) * (1 + f / 2^kMantissa)
//   e = 0: x = f * 2^-(14 + kMantissa)   (evenly spaced down to zero)
// exp_avg: sign in bit 7, kMantissa = 3. exp_avg_sq is stored as its root
// u = sqrt(v), unsigned, kMantissa = 4: the step needs sqrt(v) anyway, and the
// root halves the dynamic range the code must cover.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "adam_kernel.h"

namespace cpu_adam {
namespace {

constexpr int kAvgMantissa = 3;
constexpr int kRootMantissa = 4;
constexpr uint32_t kSignBit = 0x80000000u;
constexpr uint32_t kExponentMask = 0x7F800000u;
constexpr uint32_t kSmallestNormal = 0x00800000u;              // 2^-126
constexpr uint32_t kCodeBias = 112;                            // float bias 127 - code bias 15
constexpr uint32_t kEvenSpacingLimit = (kCodeBias + 1) << 23;  // 2^-14: below it, e = 0
constexpr float kRoundingMagic = 8388608.0f;                   // 2^23: adding it rounds to an integer

inline uint32_t f32_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

inline float f32_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Both regions are computed and one is selected, without branches: the compiler
// vectorizes the block loops below under each kernel's target (the same exact
// operations in every lane, so the bits do not depend on the ISA).

// x in [0, 2), finite: the nearest code (ties to even), saturating at the largest.
template <int kMantissa>
inline uint32_t encode_magnitude(float x) {
  const uint32_t b = f32_bits(x);
  const float scaled = x * static_cast<float>(1u << (14 + kMantissa));  // exact: a power of two
  const uint32_t evenly_spaced = f32_bits(scaled + kRoundingMagic) - f32_bits(kRoundingMagic);
  constexpr uint32_t shift = 23 - kMantissa;
  const uint32_t rounded = (b + ((1u << (shift - 1)) - 1) + ((b >> shift) & 1u)) >> shift;
  const uint32_t normal = std::min(rounded - (kCodeBias << kMantissa), (16u << kMantissa) - 1);
  return b < kEvenSpacingLimit ? evenly_spaced : normal;
}

template <int kMantissa>
inline float decode_magnitude(uint32_t code) {
  const uint32_t normal = (code + (kCodeBias << kMantissa)) << (23 - kMantissa);
  const float evenly_spaced = static_cast<float>(static_cast<int32_t>(code)) * (1.0f / (1u << (14 + kMantissa)));
  const uint32_t is_normal = 0u - static_cast<uint32_t>((code >> kMantissa) != 0);  // all ones or zero
  return f32_from_bits((normal & is_normal) | (f32_bits(evenly_spaced) & ~is_normal));
}

// The block's scale: NaN when it holds a non-finite value (the whole block then
// decodes to NaN), 1 when it is all zero, else the power of two of its largest
// magnitude (at least 2^-126, so that a denormal maximum still divides).
inline float block_scale(const float* values, int64_t n) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, f32_bits(values[i]) & ~kSignBit);
  if (largest >= kExponentMask) return std::numeric_limits<float>::quiet_NaN();
  if (largest == 0) return 1.0f;
  return f32_from_bits(std::max(largest & kExponentMask, kSmallestNormal));
}

inline float encode_avg_block(const float* m, int64_t n, uint8_t* codes) {
  const float scale = block_scale(m, n);
  if (scale != scale) {
    std::memset(codes, 0, static_cast<size_t>(n));
    return scale;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = f32_bits(m[i]);
    const float x = f32_from_bits(bits & ~kSignBit) / scale;
    codes[i] = static_cast<uint8_t>((bits & kSignBit) >> 24 | encode_magnitude<kAvgMantissa>(x));
  }
  return scale;
}

// A positive root never becomes code 0: a zero second moment would turn
// m / (sqrt(v) + eps) into m / eps.
inline float encode_root_block(const float* u, int64_t n, uint8_t* codes) {
  const float scale = block_scale(u, n);
  if (scale != scale) {
    std::memset(codes, 0, static_cast<size_t>(n));
    return scale;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t magnitude = f32_bits(u[i]) & ~kSignBit;
    const uint32_t code = encode_magnitude<kRootMantissa>(f32_from_bits(magnitude) / scale);
    codes[i] = static_cast<uint8_t>(magnitude != 0 && code == 0 ? 1 : code);
  }
  return scale;
}

inline void decode_avg_block(const uint8_t* codes, int64_t n, float scale, float* m) {
  for (int64_t i = 0; i < n; ++i) {
    const float magnitude = decode_magnitude<kAvgMantissa>(codes[i] & 0x7Fu) * scale;
    m[i] = f32_from_bits(f32_bits(magnitude) | (uint32_t{codes[i]} & 0x80u) << 24);
  }
}

inline void decode_root_block(const uint8_t* codes, int64_t n, float scale, float* u) {
  for (int64_t i = 0; i < n; ++i) u[i] = decode_magnitude<kRootMantissa>(codes[i]) * scale;
}

}  // namespace
}  // namespace cpu_adam
