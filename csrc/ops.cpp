// The torch-facing side: schema, the parallel split, and the call into the kernel chosen by
// dispatch.cpp, once checks.cpp has accepted the tensors.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <Python.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "checks.h"
#include "denormals.h"
#include "dispatch.h"
#include "hyper.h"

namespace cpu_adam {
namespace {

using at::Tensor;

const std::vector<Tensor> kNone;  // a list a call does not use

// 4096 elements is a whole number of cache lines for both dtypes; threads split
// the work on these blocks, so no cache line is written by two threads.
constexpr int64_t kBlock = 4096;
// Below about 32K elements per thread, waking a second thread costs more than it saves.
constexpr int64_t kGrainBlocks = 8;
// Segments start at block or 2^32 boundaries: even counters, as the kernels need.
static_assert(kBlock % 2 == 0, "stochastic rounding hashes pairs of elements");
static_assert(kBlock % kQ8Block == 0, "threads split 8-bit states on whole scale blocks");

struct Tuple {
  Tensor param, grad, exp_avg, exp_avg_sq, out, scales, next_grad;  // contiguous (staged copies where needed)
  Layout layout;
};

// The kernel runs on contiguous tensors: non-contiguous ones are copied here and back after.
std::vector<Tuple> stage(const TensorLists& lists) {
  const auto& [params, grads, exp_avgs, exp_avg_sqs, outs, scales, next_grads] = lists;
  std::vector<Tuple> tuples(params->size());
  for (size_t i = 0; i < params->size(); ++i) {
    Tuple& tu = tuples[i];
    tu.layout = {dtype_of((*params)[i], "params", i), dtype_of((*grads)[i], "grads", i),
                 state_dtype_of((*exp_avgs)[i], i)};
    tu.param = (*params)[i].contiguous();
    tu.grad = (*grads)[i].contiguous();
    tu.exp_avg = (*exp_avgs)[i].contiguous();
    tu.exp_avg_sq = (*exp_avg_sqs)[i].contiguous();
    if (!outs->empty()) tu.out = (*outs)[i].contiguous();
    if (!scales->empty()) tu.scales = (*scales)[i].contiguous();
    if (!next_grads->empty()) tu.next_grad = (*next_grads)[i].contiguous();
  }
  return tuples;
}

// Non-contiguous inputs were updated in contiguous copies: write them back (the outputs alone after a preview).
void write_back(const TensorLists& lists, const std::vector<Tuple>& tuples, bool preview) {
  const auto& [params, grads, exp_avgs, exp_avg_sqs, outs, scales, next_grads] = lists;
  for (size_t i = 0; i < tuples.size(); ++i) {
    const Tuple& tu = tuples[i];
    if (!outs->empty() && !(*outs)[i].is_same(tu.out)) (*outs)[i].copy_(tu.out);
    if (preview) continue;
    if (!(*params)[i].is_same(tu.param)) (*params)[i].copy_(tu.param);
    if (!(*exp_avgs)[i].is_same(tu.exp_avg)) (*exp_avgs)[i].copy_(tu.exp_avg);
    if (!(*exp_avg_sqs)[i].is_same(tu.exp_avg_sq)) (*exp_avg_sqs)[i].copy_(tu.exp_avg_sq);
    if (!scales->empty() && !(*scales)[i].is_same(tu.scales)) (*scales)[i].copy_(tu.scales);
  }
}

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The random bits of an element depend on (seed, step, counter) only: the caller places each
// tensor in one counter space (its offset), so how tensors are split into calls, lists or
// threads changes no bit.
uint32_t rng_key(int64_t seed, int64_t step, uint64_t high_counter) {
  uint64_t k = mix64(static_cast<uint64_t>(seed));
  k = mix64(k ^ static_cast<uint64_t>(step));
  return static_cast<uint32_t>(mix64(k ^ high_counter));
}

// The one parallel split of a step: whole blocks per thread.
template <class Fn>
void split_blocks(int64_t blocks, const Fn& fn) {
  at::parallel_for(0, blocks, kGrainBlocks, fn);
}

// How many threads a step of `numel` elements runs on: proves the build's
// parallel backend works (without OpenMP, at::parallel_for silently runs serially).
int64_t threads_for(int64_t numel) {
  std::mutex mutex;
  std::set<int> threads;
  split_blocks((numel + kBlock - 1) / kBlock, [&](int64_t, int64_t) {
    const std::lock_guard<std::mutex> lock(mutex);
    threads.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(threads.size());
}

void run_all(std::vector<Tuple>& tuples, const Hyper& h, int64_t seed, int64_t step, int64_t next_step,
             const std::vector<int64_t>& counter_offsets) {
  const KernelFn kernel = active_isa().kernel;
  std::vector<int64_t> block_start(tuples.size() + 1, 0);
  for (size_t i = 0; i < tuples.size(); ++i) {
    block_start[i + 1] = block_start[i] + (tuples[i].param.numel() + kBlock - 1) / kBlock;
  }
  auto run_elements = [&](size_t i, int64_t begin, int64_t end) {
    const Tuple& tu = tuples[i];
    const uint64_t offset = counter_offsets.empty() ? 0 : static_cast<uint64_t>(counter_offsets[i]);
    const bool q8 = tu.layout.state == DType::q8;
    while (begin < end) {
      // Counters are 32 bits: split where the high bits change and fold those into the key.
      // An 8-bit state's scale block cannot be split: its segment runs on to the end of the
      // block holding the wrap, and the kernel changes keys there.
      const uint64_t counter = offset + static_cast<uint64_t>(begin);
      const uint64_t high = counter >> 32;
      const int64_t wrap = begin + static_cast<int64_t>(((high + 1) << 32) - counter);
      const int64_t stop = std::min(end, q8 ? (wrap + kQ8Block - 1) / kQ8Block * kQ8Block : wrap);
      Segment s;
      s.param = static_cast<char*>(tu.param.data_ptr()) + begin * tu.param.element_size();
      s.grad = static_cast<const char*>(tu.grad.const_data_ptr()) + begin * tu.grad.element_size();
      s.exp_avg = static_cast<char*>(tu.exp_avg.data_ptr()) + begin * tu.exp_avg.element_size();
      s.exp_avg_sq = static_cast<char*>(tu.exp_avg_sq.data_ptr()) + begin * tu.exp_avg_sq.element_size();
      s.bf16_out = tu.out.defined() ? static_cast<uint16_t*>(tu.out.data_ptr()) + begin : nullptr;
      s.n = stop - begin;
      s.first_counter = static_cast<uint32_t>(counter);
      const bool random_bits = h.stochastic_rounding || q8;  // 8-bit codes round stochastically
      s.rng_key = random_bits ? rng_key(seed, step, high) : 0;
      s.exp_avg_scale = nullptr;
      s.exp_avg_sq_scale = nullptr;
      s.counter_wrap = std::min(s.n, wrap - begin);
      s.rng_key_after_wrap = random_bits ? rng_key(seed, step, high + 1) : 0;
      s.next_grad = nullptr;
      s.next_rng_key = s.next_rng_key_after_wrap = 0;
      if (tu.next_grad.defined()) {
        s.next_grad = static_cast<const char*>(tu.next_grad.const_data_ptr()) + begin * tu.next_grad.element_size();
        const bool next_bits = h.next->stochastic_rounding || q8;
        s.next_rng_key = next_bits ? rng_key(seed, next_step, high) : 0;
        s.next_rng_key_after_wrap = next_bits ? rng_key(seed, next_step, high + 1) : 0;
      }
      if (q8) {
        float* scales = tu.scales.data_ptr<float>();
        s.exp_avg_scale = scales + begin / kQ8Block;
        s.exp_avg_sq_scale = scales + q8_blocks(tu.param.numel()) + begin / kQ8Block;
      }
      kernel(s, tu.layout, h);
      begin = stop;
    }
  };
  split_blocks(block_start.back(), [&](int64_t b0, int64_t b1) {
    const ScopedFlushDenormals flush_denormals;
    size_t i = std::upper_bound(block_start.begin(), block_start.end(), b0) - block_start.begin() - 1;
    for (int64_t b = b0; b < b1;) {
      while (block_start[i + 1] <= b) ++i;
      const int64_t b_end = std::min(b1, block_start[i + 1]);
      const int64_t numel = tuples[i].param.numel();
      run_elements(i, (b - block_start[i]) * kBlock, std::min(numel, (b_end - block_start[i]) * kBlock));
      b = b_end;
    }
  });
}

void launch(const TensorLists& lists, const Hyper& h, int64_t seed, int64_t step,
            const std::vector<int64_t>& counter_offsets, int64_t next_step = 0) {
  check_tensors(lists, counter_offsets);
  const auto& [params, grads, exp_avgs, exp_avg_sqs, outs, scales, next_grads] = lists;
  TORCH_CHECK_VALUE(!h.preview || outs->size() == params->size(),
                    "cpu_adam: a preview writes the new weights into bf16_outs alone: give one per param (got ",
                    outs->size(), " for ", params->size(), " params)");
  std::vector<Tuple> tuples = stage(lists);
  run_all(tuples, h, seed, step, next_step, counter_offsets);
  write_back(lists, tuples, h.preview);
  // As torch's in-place ops do: a backward through a graph that saved these tensors before the
  // step then fails instead of running on the new values.
  const std::vector<const std::vector<Tensor>*> stepped = {params, exp_avgs, exp_avg_sqs, outs, scales};
  for (const auto* written : h.preview ? std::vector<const std::vector<Tensor>*>{outs} : stepped) {
    for (const Tensor& t : *written) torch::autograd::impl::bump_version(t);
  }
}

// The scalars are checked and folded where the tests' drivers can use them too (hyper.h).
Hyper adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
                 double bias_correction1, double bias_correction2, double grad_scale, bool stochastic_rounding,
                 int64_t step) {
  Hyper h;
  const std::string error = fold_hyper({lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction1,
                                        bias_correction2, grad_scale, stochastic_rounding, step},
                                       h);
  TORCH_CHECK_VALUE(error.empty(), error);
  return h;
}

void adam_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads, const std::vector<Tensor>& exp_avgs,
               const std::vector<Tensor>& exp_avg_sqs, const std::vector<Tensor>& bf16_outs, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool adamw_mode, double bias_correction1,
               double bias_correction2, double grad_scale, bool stochastic_rounding, int64_t seed, int64_t step,
               const std::vector<int64_t>& counter_offsets, const std::vector<Tensor>& state_scales) {
  const Hyper h = adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction1, bias_correction2,
                             grad_scale, stochastic_rounding, step);
  launch({&params, &grads, &exp_avgs, &exp_avg_sqs, &bf16_outs, &state_scales, &kNone}, h, seed, step, counter_offsets);
}

// The bf16 weights adam_step_ would write into bf16_outs, bit for bit, with params and moments left
// as they are: a step computed ahead of knowing whether it will be taken.
void adam_preview(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                  const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                  const std::vector<Tensor>& bf16_outs, double lr, double beta1, double beta2, double eps,
                  double weight_decay, bool adamw_mode, double bias_correction1, double bias_correction2,
                  double grad_scale, bool stochastic_rounding, int64_t seed, int64_t step,
                  const std::vector<int64_t>& counter_offsets, const std::vector<Tensor>& state_scales) {
  Hyper h = adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction1, bias_correction2, grad_scale,
                       stochastic_rounding, step);
  h.preview = true;
  launch({&params, &grads, &exp_avgs, &exp_avg_sqs, &bf16_outs, &state_scales, &kNone}, h, seed, step, counter_offsets);
}

// A step, and right after each element's step the preview of the next step from what it stored, in
// one pass: the bf16 weights of the next step (as adam_preview_ would write them after adam_step_)
// go into bf16_outs, which may be the step's own grads; the step itself writes no output.
void adam_step_then_preview(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                            const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                            const std::vector<Tensor>& bf16_outs, double lr, double beta1, double beta2, double eps,
                            double weight_decay, bool adamw_mode, double bias_correction1, double bias_correction2,
                            double grad_scale, bool stochastic_rounding, int64_t seed, int64_t step,
                            const std::vector<int64_t>& counter_offsets, const std::vector<Tensor>& state_scales,
                            const std::vector<Tensor>& next_grads, const std::vector<double>& next_scalars,
                            bool next_adamw_mode, int64_t next_step) {
  TORCH_CHECK_VALUE(next_scalars.size() == 8,
                    "cpu_adam: next_scalars are (lr, beta1, beta2, eps, weight_decay, bias_correction1, "
                    "bias_correction2, grad_scale), got ",
                    next_scalars.size(), " values");
  const auto& n = next_scalars;
  const Hyper next =
      adam_hyper(n[0], n[1], n[2], n[3], n[4], next_adamw_mode, n[5], n[6], n[7], stochastic_rounding, next_step);
  Hyper h = adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction1, bias_correction2, grad_scale,
                       stochastic_rounding, step);
  h.next = &next;
  launch({&params, &grads, &exp_avgs, &exp_avg_sqs, &bf16_outs, &state_scales, &next_grads}, h, seed, step,
         counter_offsets, next_step);
}

// Every check of adam_step_, nothing written: callers that step in several calls check them all
// first, so that a step updates every tensor or none.
void check_adam_step(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                     const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                     const std::vector<Tensor>& bf16_outs, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bool adamw_mode, double bias_correction1, double bias_correction2,
                     double grad_scale, bool stochastic_rounding, int64_t seed, int64_t step,
                     const std::vector<int64_t>& counter_offsets, const std::vector<Tensor>& state_scales) {
  adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction1, bias_correction2, grad_scale,
             stochastic_rounding, step);
  check_tensors({&params, &grads, &exp_avgs, &exp_avg_sqs, &bf16_outs, &state_scales, &kNone}, counter_offsets);
}

// The scalars as adam_step_ folds them, for kernels elsewhere (the device's) that must compute with the very
// same floats: step_size, inv_bc2_sqrt, eps, decay, l2, grad_scale, one_minus_beta1, lerp_from_grad (0 or 1),
// one_minus_weight, beta2, one_minus_beta2. Refuses what adam_step_ refuses.
std::vector<double> fold_hyper_scalars(double lr, double beta1, double beta2, double eps, double weight_decay,
                                       bool adamw_mode, double bias_correction1, double bias_correction2,
                                       double grad_scale, int64_t step) {
  const Hyper h = adam_hyper(lr, beta1, beta2, eps, weight_decay, adamw_mode, bias_correction1, bias_correction2,
                             grad_scale, false, step);
  return {h.step_size,
          h.inv_bc2_sqrt,
          h.eps,
          h.decay,
          h.l2,
          h.grad_scale,
          h.one_minus_beta1,
          h.lerp_from_grad ? 1.0 : 0.0,
          h.one_minus_weight,
          h.beta2,
          h.one_minus_beta2};
}

// The key of the random bits of the counters whose high 32 bits are `high`, at (seed, step).
int64_t random_key(int64_t seed, int64_t step, int64_t high) {
  return rng_key(seed, step, static_cast<uint64_t>(high));
}

ProbeVariant probe_variant(const std::string& name) {
  if (name == "plain") return ProbeVariant::plain;
  if (name == "prefetched") return ProbeVariant::prefetched;
  if (name == "streaming") return ProbeVariant::streaming;
  TORCH_CHECK_VALUE(name == "prefetched+streaming", "cpu_adam: the probe variant is one of plain, prefetched, ",
                    "streaming, prefetched+streaming; got '", name, "'");
  return ProbeVariant::prefetched_streaming;
}

void bandwidth_probe(const std::vector<Tensor>& params, const std::vector<Tensor>& grads,
                     const std::vector<Tensor>& exp_avgs, const std::vector<Tensor>& exp_avg_sqs,
                     const std::vector<Tensor>& bf16_outs, const std::vector<Tensor>& state_scales,
                     const std::string& variant) {
  Hyper h{};
  h.probe = probe_variant(variant);
  launch({&params, &grads, &exp_avgs, &exp_avg_sqs, &bf16_outs, &state_scales, &kNone}, h, 0, 0, {});
}

std::vector<std::string> isa_names(bool only_supported) {
  std::vector<std::string> names;
  for (const Isa& isa : compiled_isas()) {
    if (!only_supported || isa.supported()) names.emplace_back(isa.name);
  }
  return names;
}

std::vector<std::string> compiled_isa_names() { return isa_names(false); }
std::vector<std::string> supported_isa_names() { return isa_names(true); }
std::string active_isa_name() { return active_isa().name; }
std::string set_isa(const std::string& name) { return set_active_isa(name); }

}  // namespace

TORCH_LIBRARY(cpu_adam, m) {
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] bf16_outs, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adamw_mode, float bias_correction1, float bias_correction2, float grad_scale, "
      "bool stochastic_rounding, int seed, int step, int[] counter_offsets, Tensor(e!)[] state_scales) -> ()");
  m.def(
      "check_adam_step(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
      "Tensor[] bf16_outs, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adamw_mode, float bias_correction1, float bias_correction2, float grad_scale, "
      "bool stochastic_rounding, int seed, int step, int[] counter_offsets, Tensor[] state_scales) -> ()");
  m.def(
      "adam_preview_(Tensor[] params, Tensor[] grads, Tensor[] exp_avgs, Tensor[] exp_avg_sqs, "
      "Tensor(d!)[] bf16_outs, float lr, float beta1, float beta2, float eps, float weight_decay, "
      "bool adamw_mode, float bias_correction1, float bias_correction2, float grad_scale, "
      "bool stochastic_rounding, int seed, int step, int[] counter_offsets, Tensor[] state_scales) -> ()");
  m.def(
      "adam_step_then_preview_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] bf16_outs, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool adamw_mode, float bias_correction1, float bias_correction2, float grad_scale, "
      "bool stochastic_rounding, int seed, int step, int[] counter_offsets, Tensor(e!)[] state_scales, "
      "Tensor[] next_grads, float[] next_scalars, bool next_adamw_mode, int next_step) -> ()");
  m.def(
      "bandwidth_probe_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] bf16_outs, Tensor(e!)[] state_scales, str variant) -> ()");
  m.def(
      "fold_hyper(float lr, float beta1, float beta2, float eps, float weight_decay, bool adamw_mode, "
      "float bias_correction1, float bias_correction2, float grad_scale, int step) -> float[]",
      &fold_hyper_scalars);
  m.def("random_key(int seed, int step, int high) -> int", &random_key);
  m.def("compiled_isas() -> str[]", &compiled_isa_names);
  m.def("supported_isas() -> str[]", &supported_isa_names);
  m.def("active_isa() -> str", &active_isa_name);
  m.def("set_isa(str name) -> str", &set_isa);
  m.def("threads_for(int numel) -> int", &threads_for);
}

TORCH_LIBRARY_IMPL(cpu_adam, CPU, m) {
  m.impl("adam_step_", &adam_step);
  m.impl("adam_preview_", &adam_preview);
  m.impl("adam_step_then_preview_", &adam_step_then_preview);
  m.impl("check_adam_step", &check_adam_step);
  m.impl("bandwidth_probe_", &bandwidth_probe);
}

// The fallback for every backend without a kernel of its own (see check_dense_cpu).
TORCH_LIBRARY_IMPL(cpu_adam, CompositeExplicitAutograd, m) {
  m.impl("adam_step_", &adam_step);
  m.impl("adam_preview_", &adam_preview);
  m.impl("adam_step_then_preview_", &adam_step_then_preview);
  m.impl("check_adam_step", &check_adam_step);
  m.impl("bandwidth_probe_", &bandwidth_probe);
}

}  // namespace cpu_adam

// Lets the ahead-of-time build be imported as the Python module cpu_adam._C;
// importing it runs the registrations above.
extern "C" PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module);
}
