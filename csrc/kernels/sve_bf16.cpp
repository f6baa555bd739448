// SVE kernel with the BF16 convert (BFCVT) for round-to-nearest bf16 stores
// (Graviton 3 and 4, Grace, Neoverse V1/V2/N2).
//
// BFCVT rounds to nearest even and quiets NaNs as the scalar code does, leaving
// each result in the low half of its 32-bit lane, which is the half the
// narrowing store keeps. What it does with denormal inputs does not matter: the
// kernel runs with FPCR.FZ set (denormals.h), so no float it converts is denormal.
#include "adam_kernel.h"

#if defined(CPU_ADAM_HAS_SVE)
#include "isa_prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("sve,bf16"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+sve+bf16")
#endif

#include "sve_ops.h"

namespace cpu_adam {
namespace {

struct SveBf16Ops : SveOps {
  static SvePartial<SveBf16Ops> partial(int64_t lanes) { return {{}, lanes}; }
  static H bf16_nearest(F x) { return svreinterpret_u32_bf16(svcvt_bf16_f32_x(all(), x)); }
};

}  // namespace

void adam_sve_bf16(const Segment& s, Layout l, const Hyper& h) { run<SveBf16Ops>(s, l, h); }

}  // namespace cpu_adam

#include "isa_epilogue.h"
#endif
