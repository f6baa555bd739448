// NEON kernel with the ARMv8.6 BF16 convert (BFCVTN) for round-to-nearest bf16
// stores, for CPUs with BF16 and without SVE (where SVE exists, its kernels
// come first).
//
// BFCVTN rounds to nearest even and quiets NaNs as the scalar code does. What it
// does with denormal inputs does not matter: the kernel runs with FPCR.FZ set
// (denormals.h), so no float it converts is denormal. Stochastic rounding keeps
// the integer path: the narrowing store costs nothing extra there.
#include "adam_kernel.h"

#if defined(CPU_ADAM_HAS_NEON_BF16)
#include "isa_prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+bf16")
#endif

#include "neon_ops.h"

namespace cpu_adam {
namespace {

struct NeonBf16Ops : NeonOps {
  static H bf16_nearest(F x) { return vreinterpret_u16_bf16(vcvt_bf16_f32(x)); }
};

}  // namespace

void adam_neon_bf16(const Segment& s, Layout l, const Hyper& h) { run<NeonBf16Ops>(s, l, h); }

}  // namespace cpu_adam

#include "isa_epilogue.h"
#endif
