// NEON kernel: 4 lanes, on every AArch64 CPU (Advanced SIMD is part of the
// baseline, so this file needs no target pragma). bf16 stores round with
// integer arithmetic, as the scalar kernel does.
#if defined(__aarch64__)
#include "isa_prelude.h"
#include "neon_ops.h"
#include "squares.h"

namespace cpu_adam {

void adam_neon(const Segment& s, Layout l, const Hyper& h) { run<NeonOps>(s, l, h); }
double squares_neon(const void* x, DType dtype, int64_t n) { return squares_of(x, dtype, n); }

}  // namespace cpu_adam
#endif
