// What the running CPU and OS can execute, read once: from cpuid and xgetbv on
// x86-64, from the auxiliary vector on Linux/AArch64.
#pragma once

namespace cpu_adam {

struct CpuFeatures {
  // x86-64
  bool avx2 = false;    // with FMA and F16C, and AVX state enabled by the OS
  bool avx512 = false;  // F, BW, VL, and ZMM state enabled by the OS
  bool avx512_bf16 = false;
  // AArch64 (NEON is part of the baseline)
  bool neon_bf16 = false;  // BFCVTN and friends (FEAT_BF16)
  bool sve = false;        // SVE, its state enabled by the OS
  bool sve_bf16 = false;   // SVE and its BF16 instructions
};

const CpuFeatures& cpu_features();

}  // namespace cpu_adam
