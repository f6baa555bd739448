// AVX-512 kernel: 16 lanes (Skylake-SP, Zen 4 and later).
#if defined(__x86_64__) || defined(_M_X64)
#include "isa_prelude.h"

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")
#endif

#include "avx512_ops.h"
#include "squares.h"

namespace cpu_adam {

void adam_avx512(const Segment& s, Layout l, const Hyper& h) { run<Avx512Ops>(s, l, h); }
double squares_avx512(const void* x, DType dtype, int64_t n) { return squares_of(x, dtype, n); }

}  // namespace cpu_adam

#include "isa_epilogue.h"
#endif
