// The checks of a step's tensors (the scalars are checked in hyper.h), and what the step needs
// of them besides: the kernel's dtypes and the size of 8-bit states' scales.
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kernels/adam_kernel.h"

namespace cpu_adam {

// The tensors of one step: lists in schema order (params, grads, exp_avgs, exp_avg_sqs, bf16_outs,
// state_scales), and the grads of the next step where a step is followed by its preview.
constexpr int kRoles = 7;
using TensorLists = std::array<const std::vector<at::Tensor>*, kRoles>;

// state_scales[i] is float32 [2, q8_blocks(params[i].numel())]: a scale per moment per block.
inline int64_t q8_blocks(int64_t numel) { return (numel + kQ8Block - 1) / kQ8Block; }

// The kernel's dtype of a param or grad; refuses any other, naming it as `role`[i].
DType dtype_of(const at::Tensor& t, const char* role, size_t i);
// A moment's dtype: float32, bfloat16, or uint8 codes (8-bit states with block scales).
DType state_dtype_of(const at::Tensor& t, size_t i);

// Everything the kernel needs of the tensors, checked before anything is written.
void check_tensors(const TensorLists& lists, const std::vector<int64_t>& counter_offsets);

}  // namespace cpu_adam
