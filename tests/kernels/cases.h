// What the kernel drivers share (driver.cpp, fuzz_adam.cpp): input bit patterns, arrays with
// guard zones at any element offset, one kernel call as ops.cpp makes it, and the comparison of
// two calls' results bit for bit.
#pragma once

#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "denormals.h"
#include "kernels/adam_kernel.h"

#if defined(__SANITIZE_ADDRESS__)
#define KERNEL_TESTS_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KERNEL_TESTS_ASAN 1
#endif
#endif
#if defined(KERNEL_TESTS_ASAN)
#include <sanitizer/asan_interface.h>
#endif

namespace kernel_tests {

using cpu_adam::DType;
using cpu_adam::Hyper;
using cpu_adam::KernelFn;
using cpu_adam::Layout;
using cpu_adam::ProbeVariant;
using cpu_adam::Segment;

inline int failures = 0;

inline void fail(const std::string& what) {
  if (++failures <= 20) std::printf("FAIL %s\n", what.c_str());
}

// ---- bit patterns ----

struct Rng {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  uint32_t u32() { return static_cast<uint32_t>(next() >> 32); }
  int range(int lo, int hi) { return lo + static_cast<int>(next() % static_cast<uint64_t>(hi - lo + 1)); }
};

// A float with a random sign and mantissa and an exponent in [lo, hi].
inline uint32_t float_with_exponent(Rng& r, int lo, int hi, bool positive = false) {
  const uint32_t sign = positive ? 0 : (r.u32() & 0x80000000u);
  const uint32_t exponent = static_cast<uint32_t>(r.range(lo, hi) + 127);
  return sign | exponent << 23 | (r.u32() & 0x7FFFFFu);
}

// Bit patterns that matter to a float or bf16 kernel: zeros, infinities, quiet and signaling
// NaNs, the largest float and bf16 values and their neighbours, the smallest normals, denormals.
constexpr uint32_t kEdgeFloats[] = {0x00000000u, 0x80000000u, 0x7F800000u, 0xFF800000u, 0x7F7FFFFFu, 0x7F7F8000u,
                                    0x7F7F7FFFu, 0x7F7F0000u, 0xFF7F0000u, 0x00800000u, 0x80800000u, 0x00008000u,
                                    0x00000001u, 0x807FFFFFu, 0x7FC00000u, 0x7F800001u, 0xFFC00001u, 0x7FFFFFFFu};
constexpr int kEdgeCount = sizeof kEdgeFloats / sizeof kEdgeFloats[0];

// Bit patterns over the whole range: NaNs, infinities, denormals, ties to even.
inline uint32_t special_float(Rng& r) {
  switch (r.range(0, 9)) {
    case 0:
      return r.u32() & 0x807FFFFFu;  // denormal or zero
    case 1:
      return kEdgeFloats[r.range(0, kEdgeCount - 1)];
    case 2:
      return (r.u32() & 0xFFFF0000u) | 0x8000u;  // halfway between two bf16 values
    case 3:
      return (r.u32() & 0xFFFF0000u) | (r.range(0, 1) ? 0x7FFFu : 0x8001u);
    case 4:
      return float_with_exponent(r, -126, -110);
    default:
      return r.u32();
  }
}

// ---- arrays ----

// One array with guard zones on both sides, its elements `offset` elements past the guard
// (misaligned pointers). Under AddressSanitizer the guards are poisoned while a kernel runs, so
// that any read or write of them is reported where it happens.
constexpr int64_t kGuard = 80;  // more than the widest vector (64 lanes)
constexpr unsigned char kGuardByte = 0xA5;

struct Array {
  int size = 4;
  int64_t n = 0;
  int64_t start = 0;
  std::vector<unsigned char> bytes;

  Array() = default;
  Array(DType type, int64_t count, int offset)
      : size(type == DType::q8     ? 1
             : type == DType::bf16 ? 2
                                   : 4),
        n(count),
        start(kGuard + offset),
        bytes(static_cast<size_t>((kGuard + offset + count + kGuard) * size), kGuardByte) {}
  void* data() { return bytes.data() + start * size; }
  uint32_t get(int64_t i) const {
    uint32_t u = 0;
    std::memcpy(&u, bytes.data() + (start + i) * size, static_cast<size_t>(size));
    return u;
  }
  // A float's bits stored in this array's dtype (bf16: the upper half; 8-bit codes: the low byte,
  // any code).
  void set_float(int64_t i, uint32_t bits) {
    const uint32_t u = size == 2 ? bits >> 16 : size == 1 ? bits & 0xFFu : bits;
    std::memcpy(bytes.data() + (start + i) * size, &u, static_cast<size_t>(size));
  }
  bool is_nan(int64_t i) const {
    const uint32_t u = get(i);
    if (size == 1) return false;
    return size == 2 ? (u & 0x7FFFu) > 0x7F80u : (u & 0x7FFFFFFFu) > 0x7F800000u;
  }
  void poison_guards(bool poisoned) {
#if defined(KERNEL_TESTS_ASAN)
    if (bytes.empty()) return;
    if (!poisoned) {
      ASAN_UNPOISON_MEMORY_REGION(bytes.data(), bytes.size());
      return;
    }
    const size_t begin = static_cast<size_t>(start * size), end = static_cast<size_t>((start + n) * size);
    ASAN_POISON_MEMORY_REGION(bytes.data(), begin);  // ASan keeps up to 7 bytes before `begin` open
    ASAN_POISON_MEMORY_REGION(bytes.data() + end, bytes.size() - end);
#else
    (void)poisoned;
#endif
  }
};

// ---- one kernel call ----

constexpr int64_t kQ8Block = cpu_adam::kQ8Block;
inline int64_t q8_blocks(int64_t n) { return (n + kQ8Block - 1) / kQ8Block; }

// Everything of a call but the data.
struct Call {
  Layout layout;
  Hyper hyper;
  bool out, out_is_grad;  // a bf16 output: its own array, or the bf16 grad itself (else its own)
  int64_t n;
  int offset;  // elements past an aligned start, in every array
  uint32_t first_counter, key;
  // q8 states: where the 32-bit counter wraps within the segment (n: nowhere), and the key after.
  int64_t counter_wrap;
  uint32_t key_after_wrap;
};

// param, grad, exp_avg, exp_avg_sq, out (empty when the call has none or it is the grad), and the
// block scales of 8-bit states (empty for float states): those of exp_avg, then of exp_avg_sq.
constexpr int kArrays = 6;
constexpr const char* kArrayNames[kArrays] = {"param", "grad", "exp_avg", "exp_avg_sq", "out", "state_scales"};
struct Tuple {
  Array a[kArrays];
};

// The arrays of a call, their elements still guard bytes: the caller fills them.
inline Tuple make_arrays(const Call& c) {
  Tuple t;
  const DType types[] = {c.layout.param, c.layout.grad, c.layout.state, c.layout.state};
  for (int k = 0; k < 4; ++k) t.a[k] = Array(types[k], c.n, c.offset);
  if (c.out && !(c.out_is_grad && c.layout.grad == DType::bf16)) t.a[4] = Array(DType::bf16, c.n, c.offset);
  if (c.layout.state == DType::q8) t.a[5] = Array(DType::f32, 2 * q8_blocks(c.n), c.offset);
  return t;
}

enum class Mode { flushed, unflushed };

// The kernel on a copy of `inputs`, with denormals flushed as ops.cpp runs every step (or not).
inline Tuple run_call(KernelFn kernel, const Call& c, const Tuple& inputs, Mode mode) {
  Tuple t = inputs;
  Segment s{};
  s.param = t.a[0].data();
  s.grad = t.a[1].data();
  s.exp_avg = t.a[2].data();
  s.exp_avg_sq = t.a[3].data();
  s.bf16_out = nullptr;
  if (c.out) s.bf16_out = static_cast<uint16_t*>(t.a[4].bytes.empty() ? t.a[1].data() : t.a[4].data());
  s.n = c.n;
  s.first_counter = c.first_counter;
  s.rng_key = c.key;
  s.counter_wrap = c.counter_wrap;
  s.rng_key_after_wrap = c.key_after_wrap;
  if (c.layout.state == DType::q8) {
    s.exp_avg_scale = static_cast<float*>(t.a[5].data());
    s.exp_avg_sq_scale = s.exp_avg_scale + q8_blocks(c.n);
  }
  for (Array& a : t.a) a.poison_guards(true);
  if (mode == Mode::flushed) {
    const cpu_adam::ScopedFlushDenormals flush;
    kernel(s, c.layout, c.hyper);
  } else {
    kernel(s, c.layout, c.hyper);
  }
  for (Array& a : t.a) a.poison_guards(false);
  return t;
}

// Nothing written before or after any array (the guard zones as they were made).
inline bool guards_untouched(const Tuple& result, const Tuple& inputs, const std::string& what) {
  for (int k = 0; k < kArrays; ++k) {
    const Array& a = result.a[k];
    const Array& e = inputs.a[k];
    if (a.bytes.empty()) continue;
    const size_t begin = static_cast<size_t>(a.start * a.size), end = static_cast<size_t>((a.start + a.n) * a.size);
    if (std::memcmp(a.bytes.data(), e.bytes.data(), begin) != 0 ||
        std::memcmp(a.bytes.data() + end, e.bytes.data() + end, a.bytes.size() - end) != 0) {
      fail(what + ": written outside " + kArrayNames[k]);
      return false;
    }
  }
  return true;
}

// Elements equal bit for bit or both NaN.
inline bool same_results(const Tuple& actual, const Tuple& expected, const std::string& what) {
  for (int k = 0; k < kArrays; ++k) {
    const Array& a = actual.a[k];
    const Array& e = expected.a[k];
    if (a.bytes.empty()) continue;
    const size_t begin = static_cast<size_t>(a.start * a.size), end = static_cast<size_t>((a.start + a.n) * a.size);
    if (std::memcmp(a.bytes.data() + begin, e.bytes.data() + begin, end - begin) == 0) continue;
    for (int64_t i = 0; i < a.n; ++i) {
      if (a.get(i) != e.get(i) && !(a.is_nan(i) && e.is_nan(i))) {
        char text[96];
        std::snprintf(text, sizeof text, " element %" PRId64 ": 0x%08" PRIx32 " vs 0x%08" PRIx32, i, a.get(i),
                      e.get(i));
        fail(what + ": " + kArrayNames[k] + text);
        return false;
      }
    }
  }
  return true;
}

inline const char* dtype_name(DType d) { return d == DType::q8 ? "q8" : d == DType::bf16 ? "bf16" : "f32"; }

}  // namespace kernel_tests
