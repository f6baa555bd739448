// Flush-to-zero for the duration of a step, on the calling thread.
//
// x86 cores take a microcode assist (over a hundred cycles) for every vector
// instruction that produces or reads a denormal. Small grads make
// (1 - beta2) * g * g underflow often enough to slow real training steps by
// 40%, so the kernel treats values below 2^-126 as zero, as TensorFlow's CPU
// kernels do. Every ISA, scalar included, runs under the same mode, so they
// still agree bit for bit.
//
// On AArch64, FPCR.FZ does the same for scalar, NEON and SVE instructions
// (inputs and results). One difference remains between the architectures: ARM
// decides that a result is tiny before rounding it, x86 after, so a result
// just below 2^-126 that rounds up to it is flushed on ARM and kept on x86.
// Within one architecture every ISA agrees bit for bit.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>

namespace cpu_adam {

class ScopedFlushDenormals {
 public:
  ScopedFlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero | kDenormalsAreZero); }
  ~ScopedFlushDenormals() { _mm_setcsr(saved_); }
  ScopedFlushDenormals(const ScopedFlushDenormals&) = delete;
  ScopedFlushDenormals& operator=(const ScopedFlushDenormals&) = delete;

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kDenormalsAreZero = 0x0040;
  unsigned saved_;
};

}  // namespace cpu_adam
#elif defined(__aarch64__) && (defined(__GNUC__) || defined(__clang__))
#include <cstdint>

namespace cpu_adam {

class ScopedFlushDenormals {
 public:
  ScopedFlushDenormals() : saved_(read_fpcr()) { write_fpcr(saved_ | kFlushToZero); }
  ~ScopedFlushDenormals() { write_fpcr(saved_); }
  ScopedFlushDenormals(const ScopedFlushDenormals&) = delete;
  ScopedFlushDenormals& operator=(const ScopedFlushDenormals&) = delete;

 private:
  static constexpr uint64_t kFlushToZero = uint64_t{1} << 24;  // FPCR.FZ

  static uint64_t read_fpcr() {
    uint64_t fpcr;
    __asm__ __volatile__("mrs %0, fpcr" : "=r"(fpcr));
    return fpcr;
  }
  static void write_fpcr(uint64_t fpcr) { __asm__ __volatile__("msr fpcr, %0" : : "r"(fpcr) : "memory"); }

  uint64_t saved_;
};

}  // namespace cpu_adam
#else
namespace cpu_adam {
struct ScopedFlushDenormals {};
}  // namespace cpu_adam
#endif
