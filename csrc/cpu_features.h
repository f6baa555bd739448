// What the running CPU and OS can execute, read once from cpuid and xgetbv.
#pragma once

namespace cpu_adam {

struct CpuFeatures {
  bool avx2 = false;    // with FMA and F16C, and AVX state enabled by the OS
  bool avx512 = false;  // F, BW, VL, and ZMM state enabled by the OS
  bool avx512_bf16 = false;
};

const CpuFeatures& cpu_features();

}  // namespace cpu_adam
