#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

#include <cstdint>
#endif

namespace cpu_adam {
namespace {

#if defined(__x86_64__) || defined(_M_X64)
bool bit(unsigned reg, int i) { return (reg >> i) & 1u; }

uint64_t os_enabled_state() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx)) return f;
  const bool osxsave = bit(ecx, 27), avx = bit(ecx, 28), fma = bit(ecx, 12), f16c = bit(ecx, 29);
  if (!osxsave || !avx) return f;
  const uint64_t xcr0 = os_enabled_state();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;    // SSE and AVX registers saved by the OS
  const bool zmm_state = (xcr0 & 0xE6) == 0xE6;  // plus opmask and both ZMM halves
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, eax, ebx, ecx, edx);
  const bool avx2 = bit(ebx, 5), avx512f = bit(ebx, 16), avx512bw = bit(ebx, 30), avx512vl = bit(ebx, 31);
  const unsigned max_subleaf = eax;
  f.avx2 = ymm_state && avx2 && fma && f16c;
  f.avx512 = f.avx2 && zmm_state && avx512f && avx512bw && avx512vl;
  if (f.avx512 && max_subleaf >= 1) {
    __cpuid_count(7, 1, eax, ebx, ecx, edx);
    f.avx512_bf16 = bit(eax, 5);
  }
  return f;
}
#else
CpuFeatures detect() { return {}; }
#endif

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace cpu_adam
