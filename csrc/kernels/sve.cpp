// SVE kernel: as many lanes as the CPU has (A64FX 16, Graviton 3 8,
// Grace and Graviton 4 4), with predicated tails. bf16 stores round with
// integer arithmetic, as the scalar kernel does.
#include "adam_kernel.h"

#if defined(CPU_ADAM_HAS_SVE)
#include "isa_prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("sve"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("arch=armv8.2-a+sve")
#endif

#include "sve_ops.h"

namespace cpu_adam {

void adam_sve(const Segment& s, Layout l, const Hyper& h) { run<SveOps>(s, l, h); }

}  // namespace cpu_adam

#include "isa_epilogue.h"
#endif
