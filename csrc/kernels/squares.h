// The sum of the squares of a run of float32 or bfloat16 elements, in double precision: the grads' norm for
// clipping. Torch-free, like the Adam kernels; each ISA file instantiates it under its own target (squares_*).
//
// Each square is exact in double (a float32 significand squared needs 48 bits), and the squares are summed in
// 32 lanes (element i in lane i % 32), whose sums are then added pairwise. The order is fixed by the
// elements alone, so the result is the same for any thread count, on any ISA the compiler vectorizes the lanes
// for, and on both architectures (no multiply-add is contracted: -ffp-contract=off).
#pragma once

#include <cstdint>
#include <cstring>

#include "adam_kernel.h"

namespace cpu_adam {
namespace {  // one copy per ISA file: the linker must not hand one target's code to another

inline double widened(float x) { return static_cast<double>(x); }

inline double widened(uint16_t bf16) {  // bfloat16 is the high half of a float32's bits
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return static_cast<double>(x);
}

// 32 lanes, each its own chain of additions: plain loops the compiler vectorizes for any target.
constexpr int kSquareLanes = 32;

template <typename T>
double sum_of_squares(const T* x, int64_t n) {
  double lane[kSquareLanes] = {};
  int64_t i = 0;
  for (; i + kSquareLanes <= n; i += kSquareLanes) {
    for (int k = 0; k < kSquareLanes; ++k) {
      const double v = widened(x[i + k]);
      lane[k] += v * v;
    }
  }
  const int rest = static_cast<int>(n - i);  // fewer than kSquareLanes
  for (int k = 0; k < rest; ++k) {
    const double v = widened(x[i + k]);
    lane[k] += v * v;
  }
  for (int width = kSquareLanes / 2; width > 0; width /= 2) {  // pairwise, in a fixed order
    for (int k = 0; k < width; ++k) lane[k] += lane[k + width];
  }
  return lane[0];
}

double squares_of(const void* x, DType dtype, int64_t n) {
  return dtype == DType::f32 ? sum_of_squares(static_cast<const float*>(x), n)
                             : sum_of_squares(static_cast<const uint16_t*>(x), n);
}

}  // namespace
}  // namespace cpu_adam
