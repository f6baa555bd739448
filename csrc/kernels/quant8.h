// 8-bit codes of the Adam moments, per block of kQ8Block elements (see README.md,
// "8-bit states").
//
// A block's scale is a power of two (block_scale_bits), so value / scale is exact
// and lies in [0, 2). The normalised magnitude x is a tiny float with
// kMantissa bits of mantissa and a 4-bit exponent field e (bias 15):
//   e > 0: x = 2^(e - 15) * (1 + f / 2^kMantissa)
//   e = 0: x = f * 2^-(14 + kMantissa)   (evenly spaced down to zero)
// exp_avg: sign in bit 7, kMantissa = 3. exp_avg_sq is stored as its root
// u = sqrt(v), unsigned, kMantissa = 4: the step needs sqrt(v) anyway, and the
// root halves the dynamic range the code must cover.
//
// The kernel rounds stochastically (encode_magnitude); cpu_adam/quant8.py finds the
// same codes from the same random bits, and rounds to nearest where it converts
// state dicts. Integer operations only, so every ISA gives the same bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "adam_kernel.h"
#include "random_bits.h"

namespace cpu_adam {
namespace {

constexpr int kAvgMantissa = 3;
constexpr int kRootMantissa = 4;
constexpr uint32_t kSignBit = 0x80000000u;
constexpr uint32_t kExponentMask = 0x7F800000u;
constexpr uint32_t kMantissaMask = 0x007FFFFFu;
constexpr uint32_t kSmallestNormal = 0x00800000u;  // 2^-126; also the implicit bit of a significand
constexpr uint32_t kCodeExponentBias = 15;
constexpr uint32_t kCodeBias = 127 - kCodeExponentBias;  // float32 bias - code bias
constexpr uint32_t kSmallestScale = (127 - 112) << 23;   // 2^-112

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

// The loops below are written per element, branch-free: the compiler vectorizes
// them under each kernel's target (the same exact operations in every lane, so
// the bits do not depend on the ISA). Each has a fast form for the common block,
// whose values all lie in the codes' normal range: there a code and its value
// differ only by the scale's exponent, an integer subtraction or addition. The
// general form gives the same bits there, and also handles zero, the evenly
// spaced codes and scales below 2^-112 (from older versions).

constexpr uint8_t kMagnitudeMask = 0x7F;

// Value bits of a normal code (e > 0) in a block of scale bits `scale` >= 2^-112.
template <int kMantissa>
inline uint32_t decode_normal(uint32_t code, uint32_t scale) {
  return (code << (23 - kMantissa)) + (scale - (kCodeExponentBias << 23));
}

template <int kMantissa>
inline float decode_magnitude(uint32_t code) {
  const uint32_t normal = (code + (kCodeBias << kMantissa)) << (23 - kMantissa);
  const float evenly_spaced = static_cast<float>(static_cast<int32_t>(code)) * (1.0f / (1u << (14 + kMantissa)));
  const uint32_t is_normal = 0u - static_cast<uint32_t>((code >> kMantissa) != 0);  // all ones or zero
  return f32_from_bits((normal & is_normal) | (f32_bits(evenly_spaced) & ~is_normal));
}

// Whether a block's codes all decode through decode_normal.
template <int kMantissa>
inline bool normal_codes(const uint8_t* codes, int64_t n, uint8_t magnitude_mask, float scale) {
  const uint32_t scale_bits = f32_bits(scale);
  // A power of two in [2^-112, 2^127]; a loaded state dict may hold any float.
  if (scale_bits < kSmallestScale || scale_bits >= kExponentMask || (scale_bits & kMantissaMask) != 0) return false;
  uint8_t smallest = 0xFF;
  for (int64_t i = 0; i < n; ++i) smallest = std::min<uint8_t>(smallest, codes[i] & magnitude_mask);
  return smallest >= (1u << kMantissa);
}

inline void decode_avg_block(const uint8_t* codes, int64_t n, float scale, float* m) {
  if (normal_codes<kAvgMantissa>(codes, n, kMagnitudeMask, scale)) {
    const uint32_t scale_bits = f32_bits(scale);
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t c = codes[i];
      m[i] = f32_from_bits(decode_normal<kAvgMantissa>(c & kMagnitudeMask, scale_bits) | (c & 0x80u) << 24);
    }
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float magnitude = decode_magnitude<kAvgMantissa>(codes[i] & kMagnitudeMask) * scale;
    m[i] = f32_from_bits(f32_bits(magnitude) | (uint32_t{codes[i]} & 0x80u) << 24);
  }
}

inline void decode_root_block(const uint8_t* codes, int64_t n, float scale, float* u) {
  if (normal_codes<kRootMantissa>(codes, n, 0xFF, scale)) {
    const uint32_t scale_bits = f32_bits(scale);
    for (int64_t i = 0; i < n; ++i) u[i] = f32_from_bits(decode_normal<kRootMantissa>(codes[i], scale_bits));
    return;
  }
  for (int64_t i = 0; i < n; ++i) u[i] = decode_magnitude<kRootMantissa>(codes[i]) * scale;
}

// A block's scale 2^k as float32 bits, from the largest magnitude's bits: NaN when
// the block holds a non-finite value (the whole block then decodes to NaN), 1 when it
// is all zero, else the power of two at or below the largest magnitude, or the next
// one where the largest lies above the largest code (so that no value saturates and
// the rounding stays unbiased), and at least 2^-112: then the encode's exponent bias
// is never negative, and even a block of the smallest scale holds every float32 the
// step stores (none below 2^-126 under flush-to-zero) in its normal codes.
template <int kMantissa>
inline uint32_t block_scale_bits(uint32_t largest) {
  constexpr uint32_t largest_code_mantissa = ((1u << kMantissa) - 1) << (23 - kMantissa);
  constexpr uint32_t largest_finite_exponent = 254u << 23;
  if (largest >= kExponentMask) return f32_bits(std::numeric_limits<float>::quiet_NaN());
  if (largest == 0) return f32_bits(1.0f);
  uint32_t exponent = largest & kExponentMask;
  if ((largest & kMantissaMask) > largest_code_mantissa && exponent < largest_finite_exponent) exponent += 1u << 23;
  return std::max(exponent, kSmallestScale);
}

// Stochastic rounding of a magnitude aligned so that a code step is 2^(23 - kMantissa):
// up to the next code with probability equal to the fraction of a step cut off, in
// steps of 2^-16 (`random16`: 16 uniform bits), saturating at the largest code.
template <int kMantissa>
inline uint32_t round_code(uint32_t aligned, uint32_t random16) {
  constexpr uint32_t shift = 23 - kMantissa;
  constexpr uint32_t largest_code = (16u << kMantissa) - 1;
  return std::min((aligned + (random16 << (shift - 16))) >> shift, largest_code);
}

// A finite magnitude (float32 bits) relative to a block of scale bits `scale`: for a
// value at least 2^-14 of the scale, the code's bits before rounding (value / scale
// subtracts exponents).
inline int32_t relative_bits(uint32_t magnitude, uint32_t scale) {
  return static_cast<int32_t>(magnitude - (scale - (kCodeExponentBias << 23)));
}

// Any finite magnitude, zero included: below 2^-14 of the scale (exponent field 0,
// evenly spaced codes) the significand is shifted into place as a denormal's would
// be; the bits shifted out lie below the random bits' reach and change no probability.
template <int kMantissa>
inline uint32_t encode_magnitude(uint32_t magnitude, uint32_t scale, uint32_t random16) {
  const int32_t relative = relative_bits(magnitude, scale);
  const uint32_t exponent_deficit = static_cast<uint32_t>(1 - (relative >> 23));                    // > 0 below 2^-14
  const uint32_t significand = (magnitude & kMantissaMask) | std::min(magnitude, kSmallestNormal);  // 0 for 0
  const uint32_t evenly_spaced = significand >> std::min(exponent_deficit, 31u);
  const bool normal = relative >= static_cast<int32_t>(kSmallestNormal);
  return round_code<kMantissa>(normal ? static_cast<uint32_t>(relative) : evenly_spaced, random16);
}

// A magnitude at least 2^-14 of the scale: the same code, fewer operations.
template <int kMantissa>
inline uint32_t encode_normal(uint32_t magnitude, uint32_t scale, uint32_t random16) {
  return round_code<kMantissa>(static_cast<uint32_t>(relative_bits(magnitude, scale)), random16);
}

// Counter-based random bits for the codes: one lowbias32 hash per element (16 bits
// per moment), keyed apart from the bf16 param stores' bits of the same element.
constexpr uint32_t kCodeStream = 0x6A09E667u;

inline uint32_t code_key(uint32_t rng_key) { return lowbias32(rng_key ^ kCodeStream); }

// Encodes elements [lo, hi) of a block whose scales are known, with random bits
// hash(counter + key): exp_avg from the low 16 bits, its root from the high 16.
// kAvgNormal, kRootNormal: every magnitude of that moment is at least 2^-14 of its scale.
template <bool kAvgNormal, bool kRootNormal>
inline void encode_codes(const float* m, const float* u, int64_t lo, int64_t hi, uint32_t m_scale, uint32_t u_scale,
                         uint32_t first_counter, uint32_t key, uint8_t* m_codes, uint8_t* u_codes) {
  // 32-bit indices: the block is short, and 32-bit lanes vectorize without widening.
  const uint32_t counter = first_counter + key;
  for (int32_t i = static_cast<int32_t>(lo); i < static_cast<int32_t>(hi); ++i) {
    const uint32_t random = lowbias32(counter + static_cast<uint32_t>(i));
    const uint32_t m_bits = f32_bits(m[i]);
    const uint32_t m_magnitude = m_bits & ~kSignBit;
    const uint32_t m_code = kAvgNormal ? encode_normal<kAvgMantissa>(m_magnitude, m_scale, random & 0xFFFFu)
                                       : encode_magnitude<kAvgMantissa>(m_magnitude, m_scale, random & 0xFFFFu);
    m_codes[i] = static_cast<uint8_t>((m_bits & kSignBit) >> 24 | m_code);
    const uint32_t u_bits = f32_bits(u[i]) & ~kSignBit;
    if (kRootNormal) {
      u_codes[i] = static_cast<uint8_t>(encode_normal<kRootMantissa>(u_bits, u_scale, random >> 16));
    } else {
      // A positive root never becomes code 0: a zero second moment would turn
      // m / (sqrt(v) + eps) into m / eps.
      const uint32_t u_code = encode_magnitude<kRootMantissa>(u_bits, u_scale, random >> 16);
      u_codes[i] = static_cast<uint8_t>(u_bits != 0 && u_code == 0 ? 1 : u_code);
    }
  }
}

struct BlockCodes {
  const float* m;
  const float* u;
  int64_t n;
  uint8_t* m_codes;
  uint8_t* u_codes;
};

template <bool kAvgNormal, bool kRootNormal>
inline void encode_split(const BlockCodes& b, uint32_t m_scale, uint32_t u_scale, uint32_t first_counter, uint32_t key,
                         int64_t wrap, uint32_t key_after_wrap) {
  const int64_t split = std::max<int64_t>(0, std::min(wrap, b.n));
  encode_codes<kAvgNormal, kRootNormal>(b.m, b.u, 0, split, m_scale, u_scale, first_counter, code_key(key), b.m_codes,
                                        b.u_codes);
  encode_codes<kAvgNormal, kRootNormal>(b.m, b.u, split, b.n, m_scale, u_scale, first_counter, code_key(key_after_wrap),
                                        b.m_codes, b.u_codes);
}

// Encodes a block of new moments (m, and roots u) with new scales, written to
// *m_scale and *u_scale. Element i's random bits are drawn with `key` before
// element `wrap` and with `key_after_wrap` from it on (where the 32-bit counter wraps).
inline void encode_block(const BlockCodes& b, uint32_t first_counter, uint32_t key, int64_t wrap,
                         uint32_t key_after_wrap, float* m_scale, float* u_scale) {
  uint32_t m_largest = 0, u_largest = 0;
  uint32_t m_smallest = ~0u, u_smallest = ~0u;
  for (int64_t i = 0; i < b.n; ++i) {
    const uint32_t m_magnitude = f32_bits(b.m[i]) & ~kSignBit;
    const uint32_t u_magnitude = f32_bits(b.u[i]) & ~kSignBit;
    m_largest = std::max(m_largest, m_magnitude);
    u_largest = std::max(u_largest, u_magnitude);
    m_smallest = std::min(m_smallest, m_magnitude);
    u_smallest = std::min(u_smallest, u_magnitude);
  }
  const uint32_t m_scale_bits = block_scale_bits<kAvgMantissa>(m_largest);
  const uint32_t u_scale_bits = block_scale_bits<kRootMantissa>(u_largest);
  *m_scale = f32_from_bits(m_scale_bits);
  *u_scale = f32_from_bits(u_scale_bits);
  // A non-finite block is NaN as a whole: its codes are 0.
  const bool m_finite = m_largest < kExponentMask, u_finite = u_largest < kExponentMask;
  const auto normal = [](uint32_t smallest, uint32_t scale) {
    return relative_bits(smallest, scale) >= static_cast<int32_t>(kSmallestNormal);
  };
  const bool m_normal = m_finite && normal(m_smallest, m_scale_bits);
  const bool u_normal = u_finite && normal(u_smallest, u_scale_bits);
  using Encode = void (*)(const BlockCodes&, uint32_t, uint32_t, uint32_t, uint32_t, int64_t, uint32_t);
  constexpr Encode kEncode[2][2] = {{encode_split<false, false>, encode_split<false, true>},
                                    {encode_split<true, false>, encode_split<true, true>}};
  kEncode[m_normal][u_normal](b, m_scale_bits, u_scale_bits, first_counter, key, wrap, key_after_wrap);
  if (!m_finite) std::memset(b.m_codes, 0, static_cast<size_t>(b.n));
  if (!u_finite) std::memset(b.u_codes, 0, static_cast<size_t>(b.n));
}

}  // namespace
}  // namespace cpu_adam
