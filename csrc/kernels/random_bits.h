// Counter-based random bits: lowbias32, a 32-bit integer hash (two multiplies,
// three xor-shifts) whose outputs for neighbouring inputs look unrelated. The
// kernels hash (counter + key), with keys drawn from (seed, step, stream).
#pragma once

#include <cstdint>

namespace cpu_adam {
namespace {

constexpr uint32_t kMix1 = 0x7FEB352Du;
constexpr uint32_t kMix2 = 0x846CA68Bu;

inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= kMix1;
  x ^= x >> 15;
  x *= kMix2;
  x ^= x >> 16;
  return x;
}

}  // namespace
}  // namespace cpu_adam
