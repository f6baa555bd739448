#include "cpu_features.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <cpuid.h>

#include <cstdint>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>

// The bits as the Linux UAPI defines them, for C libraries whose headers lack them.
#ifndef HWCAP_SVE
#define HWCAP_SVE (1UL << 22)
#endif
#ifndef HWCAP2_SVEBF16
#define HWCAP2_SVEBF16 (1UL << 12)
#endif
#ifndef HWCAP2_BF16
#define HWCAP2_BF16 (1UL << 14)
#endif
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
#elif defined(__aarch64__) && defined(__linux__)
// The kernel sets HWCAP_SVE only where it saves and restores SVE state.
CpuFeatures detect() {
  CpuFeatures f;
  const unsigned long hwcap = getauxval(AT_HWCAP);
  const unsigned long hwcap2 = getauxval(AT_HWCAP2);
  f.neon_bf16 = (hwcap2 & HWCAP2_BF16) != 0;
  f.sve = (hwcap & HWCAP_SVE) != 0;
  f.sve_bf16 = f.sve && (hwcap2 & HWCAP2_SVEBF16) != 0;
  return f;
}
#else
// Elsewhere (macOS arm64 included) only the baseline: scalar, and NEON on AArch64.
CpuFeatures detect() { return {}; }
#endif

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = detect();
  return features;
}

}  // namespace cpu_adam
