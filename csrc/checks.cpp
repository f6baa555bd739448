// The checks of a step's tensors, all made before anything is written: each error names the
// tensor, what is wrong with it and the fix.
#include "checks.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "memory_overlap.h"

namespace cpu_adam {
namespace {

using at::Tensor;

// Numbers go into error messages as strings: where the extension's C++ runtime differs from
// torch's (seen with torch 2.11+cu130 wheels built by g++ 13 on Ubuntu 24.04), streaming an
// integer into the message crashed in the locale code instead of raising.
template <class T>
std::string text(T value) {
  return std::to_string(value);
}

// Whether each element of `t` has memory of its own: dims sorted by stride, every stride must
// step past everything the smaller dims span. Stride-0 (expanded) and overlapping as_strided
// views fail; so do a few exotic layouts that do not overlap, which .clone() turns into good ones.
bool elements_have_own_memory(const Tensor& t) {
  std::vector<std::pair<int64_t, int64_t>> dims;  // (|stride|, size)
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) > 1) dims.emplace_back(std::abs(t.stride(d)), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // elements covered by the dims so far, minus one
  for (const auto& [stride, size] : dims) {
    if (stride <= span) return false;
    span += (size - 1) * stride;
  }
  return true;
}

// The names errors give the lists of a step, in schema order.
constexpr const char* kRoleNames[kRoles] = {"params",    "grads",        "exp_avgs",  "exp_avg_sqs",
                                            "bf16_outs", "state_scales", "next_grads"};
constexpr int kGrads = 1, kOuts = 4, kScales = 5, kNextGrads = 6;

struct Piece {
  Extent extent;
  size_t tuple;
  int role;

  bool written() const { return role != kGrads && role != kNextGrads; }
};

Extent extent_of(const Tensor& t) {
  std::vector<Dim> dims;
  for (int64_t d = 0; d < t.dim(); ++d) dims.push_back({t.stride(d) * t.element_size(), t.size(d)});
  return make_extent(reinterpret_cast<int64_t>(t.data_ptr()), t.element_size(), dims);
}

bool is_grad_reused_as_output(const Piece& a, const Piece& b) {
  const bool pair = (a.role == kGrads && b.role == kOuts) || (a.role == kOuts && b.role == kGrads);
  return pair && a.tuple == b.tuple && a.extent.base == b.extent.base && a.extent.end() == b.extent.end();
}

// Overlapping memory between tensors the kernel writes would race or corrupt. Views of one
// buffer that share no byte (slices, interleaved or column-block views) are fine; the one
// overlap allowed is a bf16 output that is exactly its own tuple's grad.
void check_no_aliasing(std::vector<Piece> pieces) {
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.extent.base < b.extent.base; });
  std::vector<const Piece*> open;
  for (const Piece& s : pieces) {
    open.erase(
        std::remove_if(open.begin(), open.end(), [&](const Piece* o) { return o->extent.end() <= s.extent.base; }),
        open.end());
    for (const Piece* o : open) {
      if (!(o->written() || s.written()) || is_grad_reused_as_output(*o, s)) continue;
      const Overlap found = overlap(o->extent, s.extent);
      TORCH_CHECK(found != Overlap::some, "cpu_adam: ", kRoleNames[o->role], "[", text(o->tuple), "] and ",
                  kRoleNames[s.role], "[", text(s.tuple),
                  "] share memory; every param, exp_avg, exp_avg_sq and output needs its own storage "
                  "(only a bf16 output may be the very same tensor as its own grad). Pass each tensor "
                  "once, and .clone() tensors that are views of each other");
      TORCH_CHECK(found != Overlap::unknown, "cpu_adam: ", kRoleNames[o->role], "[", text(o->tuple), "] and ",
                  kRoleNames[s.role], "[", text(s.tuple),
                  "] are views of one buffer whose strides are too intricate to prove they share no memory; "
                  ".clone() one of them");
    }
    open.push_back(&s);
  }
}

// The dispatcher picks a kernel by the tensors' devices and layouts: dense CPU tensors come to
// the CPU kernels, meta ones to the fakes of cpu_adam/ops.py, and all others (sparse, CUDA, ...)
// to the same kernels registered as the fallback, which is also where calls without tensors go.
void check_dense_cpu(const TensorLists& lists) {
  for (int r = 0; r < kRoles; ++r) {
    for (size_t i = 0; i < lists[r]->size(); ++i) {
      const Tensor& t = (*lists[r])[i];
      TORCH_CHECK(t.layout() == at::kStrided && t.device().is_cpu(), "cpu_adam: ", kRoleNames[r], "[", text(i),
                  "] is a ", t.layout(), " tensor on ", t.device().str(),
                  "; the kernel updates dense CPU tensors (cpu_adam.OffloadOptimizer trains parameters that live "
                  "on an accelerator)");
    }
  }
}

}  // namespace

DType dtype_of(const Tensor& t, const char* role, size_t i) {
  if (t.scalar_type() == at::kFloat) return DType::f32;
  if (t.scalar_type() == at::kBFloat16) return DType::bf16;
  TORCH_CHECK(!at::isComplexType(t.scalar_type()), "cpu_adam: ", role, "[", text(i), "] has dtype ", t.scalar_type(),
              "; complex tensors are not supported: step complex params with torch.optim.AdamW, which updates "
              "their real and imaginary parts as real numbers");
  TORCH_CHECK(false, "cpu_adam: ", role, "[", text(i), "] has dtype ", t.scalar_type(),
              "; only float32 and bfloat16 are supported: convert it with .float() or .bfloat16()");
}

// A moment's dtype: float32, bfloat16, or uint8 codes (8-bit states with block scales).
DType state_dtype_of(const Tensor& t, size_t i) {
  if (t.scalar_type() == at::kByte) return DType::q8;
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, "cpu_adam: exp_avgs[", text(i),
              "] has dtype ", t.scalar_type(),
              "; moments are float32, bfloat16, or uint8 (8-bit codes, with state_scales)");
  return dtype_of(t, "exp_avgs", i);
}

// Everything the kernel needs of the tensors, checked before anything is written.
void check_tensors(const TensorLists& lists, const std::vector<int64_t>& counter_offsets) {
  check_dense_cpu(lists);
  const auto& [params, grads, exp_avgs, exp_avg_sqs, outs, scales, next_grads] = lists;
  const size_t n = params->size();
  TORCH_CHECK(next_grads->empty() || (next_grads->size() == n && outs->size() == n),
              "cpu_adam: a step followed by the next one's preview needs one next grad and one bf16 output per "
              "param, got ",
              text(next_grads->size()), " and ", text(outs->size()), " for ", text(n), " params");
  TORCH_CHECK(scales->empty() || scales->size() == n,
              "cpu_adam: state_scales must be empty (float moments) or have one tensor per param (8-bit moments), "
              "got ",
              text(scales->size()), " for ", text(n), " params");
  TORCH_CHECK(grads->size() == n && exp_avgs->size() == n && exp_avg_sqs->size() == n,
              "cpu_adam: params, grads, exp_avgs and exp_avg_sqs must have the same length, got ", text(n), ", ",
              text(grads->size()), ", ", text(exp_avgs->size()), ", ", text(exp_avg_sqs->size()));
  TORCH_CHECK(outs->empty() || outs->size() == n,
              "cpu_adam: bf16_outs must be empty or have one tensor per param, got ", text(outs->size()), " for ",
              text(n), " params");
  TORCH_CHECK(counter_offsets.empty() || counter_offsets.size() == n,
              "cpu_adam: counter_offsets must be empty or have one offset per param, got ",
              text(counter_offsets.size()), " for ", text(n), " params");
  for (const int64_t offset : counter_offsets) {
    TORCH_CHECK(offset >= 0 && offset % 2 == 0, "cpu_adam: counter offsets must be even and >= 0, got ", text(offset),
                "; stochastic rounding hashes pairs of elements");
  }
  std::vector<Piece> pieces;
  for (size_t i = 0; i < n; ++i) {
    const Tensor& param = (*params)[i];
    for (int r = 0; r < kRoles; ++r) {
      if ((r == kOuts && outs->empty()) || (r == kScales && scales->empty()) ||
          (r == kNextGrads && next_grads->empty())) {
        continue;
      }
      const Tensor& t = (*lists[r])[i];
      if (r == kScales) {
        const int64_t blocks = q8_blocks(param.numel());
        TORCH_CHECK(t.scalar_type() == at::kFloat && t.dim() == 2 && t.size(0) == 2 && t.size(1) == blocks,
                    "cpu_adam: state_scales[", text(i), "] is ", t.scalar_type(), " of shape ", t.sizes(),
                    "; it must be float32 of shape [2, ", text(blocks), "]: a scale per moment per block of ",
                    text(kQ8Block), " elements of params[", text(i), "]");
      }
      TORCH_CHECK(r == kScales || t.numel() == param.numel(), "cpu_adam: ", kRoleNames[r], "[", text(i), "] has ",
                  text(t.numel()), " elements but params[", text(i), "] has ", text(param.numel()),
                  "; each tuple must match in size");
      TORCH_CHECK(r == kGrads || r == kNextGrads || elements_have_own_memory(t), "cpu_adam: ", kRoleNames[r], "[",
                  text(i),
                  "] overlaps itself (an expanded or overlapping as_strided view), so its elements would take "
                  "each other's updates; pass a tensor whose elements each have their own memory (.clone() it)");
      if (t.numel() > 0) pieces.push_back({extent_of(t), i, r});
    }
    dtype_of(param, "params", i);
    const DType grad = dtype_of((*grads)[i], "grads", i);
    if (!next_grads->empty()) {
      TORCH_CHECK(dtype_of((*next_grads)[i], "next_grads", i) == grad, "cpu_adam: next_grads[", text(i), "] is ",
                  (*next_grads)[i].scalar_type(), " but grads[", text(i), "] is ", (*grads)[i].scalar_type(),
                  "; both steps' grads must have one dtype");
    }
    const DType state = state_dtype_of((*exp_avgs)[i], i);
    TORCH_CHECK((state == DType::q8) == !scales->empty(), "cpu_adam: exp_avgs[", text(i), "] is ",
                (*exp_avgs)[i].scalar_type(), " and state_scales ", scales->empty() ? "is empty" : "is given",
                "; uint8 (8-bit) moments need their state_scales, float moments none, and one step "
                "cannot mix them");
    TORCH_CHECK((*exp_avg_sqs)[i].scalar_type() == (*exp_avgs)[i].scalar_type(), "cpu_adam: exp_avgs[", text(i),
                "] is ", (*exp_avgs)[i].scalar_type(), " but exp_avg_sqs[", text(i), "] is ",
                (*exp_avg_sqs)[i].scalar_type(), "; keep both moments in one dtype");
    if (!outs->empty()) {
      TORCH_CHECK((*outs)[i].scalar_type() == at::kBFloat16, "cpu_adam: bf16_outs[", text(i), "] has dtype ",
                  (*outs)[i].scalar_type(), "; the output copy is always bfloat16");
    }
  }
  check_no_aliasing(std::move(pieces));
}

}  // namespace cpu_adam
