// squared_norms: each tensor's sum of squares in double, for the clip norm of CPUAdam's step. One parallel
// region over every tensor's chunks; a tensor's chunks start at its first element and are added in order, so
// the sums do not depend on the thread count (kernels/squares.h fixes the order within a chunk, the same on
// every ISA: the active one's copy runs, CPU_ADAM_ISA included).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <vector>

#include "dispatch.h"

namespace cpu_adam {
namespace {

using at::Tensor;

constexpr int64_t kChunk = 1 << 16;  // elements; 64K float32 or bf16 elements are 128-256 KiB of one cache level

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t end;
};

Tensor squared_norms(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> flat;
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const Tensor& x = tensors[t];
    TORCH_CHECK_VALUE(x.device().is_cpu(), "cpu_adam.squared_norms: tensor ", t, " is on ", x.device(),
                      ", not the CPU");
    TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
                     "cpu_adam.squared_norms: ", "tensor ", t, " is ", x.scalar_type(), "; float32 and bfloat16 only");
    flat.push_back(x.contiguous());
    for (int64_t begin = 0; begin < x.numel(); begin += kChunk) {
      chunks.push_back({static_cast<int64_t>(t), begin, std::min(begin + kChunk, x.numel())});
    }
  }
  std::vector<double> partial(chunks.size());
  const SquaresFn squares = active_isa().squares;
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t lo, int64_t hi) {
    for (int64_t c = lo; c < hi; ++c) {
      const Chunk& chunk = chunks[c];
      const Tensor& x = flat[chunk.tensor];
      const DType dtype = x.scalar_type() == at::kFloat ? DType::f32 : DType::bf16;
      const auto* first = static_cast<const char*>(x.const_data_ptr()) + chunk.begin * x.element_size();
      partial[c] = squares(first, dtype, chunk.end - chunk.begin);
    }
  });
  Tensor sums = at::zeros({static_cast<int64_t>(tensors.size())}, at::kDouble);
  double* out = sums.data_ptr<double>();
  for (size_t c = 0; c < chunks.size(); ++c) out[chunks[c].tensor] += partial[c];
  return sums;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cpu_adam, m) { m.def("squared_norms(Tensor[] tensors) -> Tensor", &squared_norms); }

}  // namespace cpu_adam
