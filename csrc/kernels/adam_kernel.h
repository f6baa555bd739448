// The contract between ops.cpp and the per-ISA kernels. Torch-free on purpose:
// the ISA files compile fast and cannot pick up torch's inline code under a
// foreign target pragma.
#pragma once

#include <cstdint>

namespace cpu_adam {

// q8: the moments as 8-bit codes with a float32 scale per block of kQ8Block
// elements (quant8.h); a state dtype only.
enum class DType : uint8_t { f32, bf16, q8 };

constexpr int64_t kQ8Block = 256;

// One contiguous run of elements of one (param, grad, exp_avg, exp_avg_sq[, out])
// tuple. Pointers are already offset to the run's first element.
struct Segment {
  void* param;
  const void* grad;
  void* exp_avg;
  void* exp_avg_sq;
  uint16_t* bf16_out;  // nullptr: no output copy
  int64_t n;
  uint32_t first_counter;  // counter of element 0 for stochastic rounding; even
  uint32_t rng_key;        // (seed, step, high counter bits) hashed
  // q8 states only. The scales of the segment's first block (a q8 segment starts on a
  // block boundary); and, since blocks cannot be split, where within the segment the
  // 32-bit counter wraps (n: nowhere) and the key of the counters after it.
  float* exp_avg_scale;
  float* exp_avg_sq_scale;
  int64_t counter_wrap;
  uint32_t rng_key_after_wrap;
  // A step followed by the preview of the next (Hyper::next): the next step's grads and keys.
  const void* next_grad;
  uint32_t next_rng_key;
  uint32_t next_rng_key_after_wrap;
};

struct Layout {
  DType param;
  DType grad;
  DType state;
};

// The bandwidth probe (probe_body.h) instead of the Adam step, and how it asks
// memory for the bytes: with the kernel's software prefetch or without, with
// plain or non-temporal (streaming) stores.
enum class ProbeVariant : uint8_t { none, plain, prefetched, streaming, prefetched_streaming };

// Scalars already folded the way torch folds them in double precision; the
// kernels only cast them to float.
struct Hyper {
  float step_size;     // lr / bias_correction1
  float inv_bc2_sqrt;  // 1 / sqrt(bias_correction2)
  float eps;
  float decay;  // 1 - lr * weight_decay (AdamW), else 1
  float l2;     // weight_decay (Adam L2 mode), else 0
  float grad_scale;
  float one_minus_beta1;  // the weight of the first moment's lerp toward the grad
  // torch's lerp is two-sided: from a weight of 0.5 up it computes end - (end - start) * (1 - weight),
  // so that beta1 = 0 gives the grad exactly. The choice is per call; 1 - weight in float, as torch.
  bool lerp_from_grad;
  float one_minus_weight;
  float beta2;
  float one_minus_beta2;
  bool stochastic_rounding;  // bf16 param stores only
  bool preview;              // the new weights into bf16_out alone: params and moments are not written
  ProbeVariant probe;        // none: the Adam step
  // Not null: after each vector's step, the next step is previewed from what was just stored
  // (Segment::next_grad), writing its weights into bf16_out; the step itself writes no output.
  const Hyper* next;
};

using KernelFn = void (*)(const Segment&, Layout, const Hyper&);
// The sum of the squares of n float32 or bfloat16 elements (squares.h): the same bits on every ISA.
using SquaresFn = double (*)(const void* x, DType dtype, int64_t n);

void adam_scalar(const Segment&, Layout, const Hyper&);
double squares_scalar(const void*, DType, int64_t);
#if defined(__x86_64__) || defined(_M_X64)
void adam_avx2(const Segment&, Layout, const Hyper&);
void adam_avx512(const Segment&, Layout, const Hyper&);
double squares_avx2(const void*, DType, int64_t);
double squares_avx512(const void*, DType, int64_t);
#if (defined(__GNUC__) && __GNUC__ >= 10) || (defined(__clang__) && __clang_major__ >= 9)
#define CPU_ADAM_HAS_AVX512_BF16 1
void adam_avx512_bf16(const Segment&, Layout, const Hyper&);
#endif
#elif defined(__aarch64__)
void adam_neon(const Segment&, Layout, const Hyper&);
double squares_neon(const void*, DType, int64_t);
// The bf16 and SVE kernels need intrinsics that work under a target pragma
// (GCC 11, Clang 16), and the auxiliary vector to detect them at run time.
#if defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 16) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define CPU_ADAM_HAS_NEON_BF16 1
#define CPU_ADAM_HAS_SVE 1
void adam_neon_bf16(const Segment&, Layout, const Hyper&);
void adam_sve(const Segment&, Layout, const Hyper&);
void adam_sve_bf16(const Segment&, Layout, const Hyper&);
#endif
#endif

}  // namespace cpu_adam
