// libFuzzer target: every vector ISA this CPU supports against the scalar kernel, bit for bit,
// on a call decoded from the fuzz input. Built by run.sh with
// clang++ -fsanitize=fuzzer,address,undefined; any difference, write outside an array (guard
// zones, poisoned while a kernel runs), or sanitizer report aborts with the case.
//
// Only calls the op could make are run (the others are rejected, and kept out of the corpus):
// scalars that fold_hyper (hyper.h, the op's own check) accepts, even counters, float-state
// segments that never wrap the 32-bit counter, and 8-bit state segments that wrap it only in their
// last block (ops.cpp splits segments so).
//
// Input, little-endian, bytes past the end read as 0 (seeds.py writes seeds in this format):
//   0      flags: bit 0 param bf16, 1 grad bf16, 2-3 state (0 f32, 1 bf16, else q8),
//          4 bf16 output, 5 the output is the bf16 grad, 6 stochastic rounding, 7 bandwidth probe
//   1      vector ISAs to compare, bit k for the k-th supported one (0: all)
//   2-3    size: bit 15 clear, n = bits 0-14 % 161; set, n = bits 0-14 % 4200
//   4      offset of every array from an aligned start, in elements (% 16)
//   5-8    first counter (made even); 9: bit 0, an 8-bit state's segment wraps the counter at
//          the element bits 1-7 choose in its last block
//   10-13  key, 14-17 key after the wrap
//   18     bit 0 AdamW (else L2)
//   19-90  lr, beta1, beta2, eps, weight_decay, grad_scale, bias_correction1, bias_correction2:
//          nine bytes each, a selector then a double; selector < 0x80 picks a listed value,
//          else the double's bits are used
//   91-98  seed of the generated values; 99-103 how each array is generated (param, grad,
//          exp_avg, exp_avg_sq, state scales): bits 0-1 kind (special bit patterns, a binade range,
//          one edge value, tiny), bits 2-7 its parameter; the scales keep only their exponent
//          bits (powers of two, as the kernel writes them) when bit 7 is set
//   104-   raw 32-bit values, written over the generated ones in turn: param[0], grad[0],
//          exp_avg[0], exp_avg_sq[0], param[1], ...
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "cases.h"
#include "dispatch.h"
#include "fuzz_input.h"
#include "hyper.h"

namespace {

using namespace kernel_tests;

constexpr double kMaxFloat = 3.4028234663852886e38;
constexpr double kTinyFloat = 1.1754943508222875e-38;
const double kLr[] = {1e-3, 0.0, 1e-2, 1.0, 1e30, kTinyFloat, 1e-45, 3e38};
const double kBeta[] = {0.9, 0.0, 0.999, 0.5, 0.99999999, 1.0 - 1e-16, 1e-300, 0.1};
const double kEps[] = {1e-8, 0.0, 1e-45, kTinyFloat, 1e-30, 1.0, 1e30, kMaxFloat};
const double kWeightDecay[] = {0.0, 0.01, 0.1, 1.0, 1e3, 1e-40, 1e30, 3e38};
const double kGradScale[] = {1.0, 0.5, -1.0, 0.0, 65536.0, 1e-30, -3e38, 1e-42};
const double kBiasCorrection[] = {1.0, 0.1, 1e-3, 1e-8, 0.999, 1e-300, 1e-40, 2.0};

double scalar(Reader& r, const double (&listed)[8]) {
  const uint8_t selector = r.u8();
  const uint64_t bits = r.bytes(8);
  if (selector < 0x80) return listed[selector % 8];
  double x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// The supported ISAs, best first, scalar last.
const std::vector<const cpu_adam::Isa*>& isas() {
  static const std::vector<const cpu_adam::Isa*> found = [] {
    std::vector<const cpu_adam::Isa*> v;
    for (const cpu_adam::Isa& isa : cpu_adam::compiled_isas()) {
      if (isa.supported()) v.push_back(&isa);
    }
    if (v.empty() || std::string(v.back()->name) != "scalar") std::abort();
    return v;
  }();
  return found;
}

// One array's generated values.
uint32_t generated(uint8_t how, Rng& r) {
  const int parameter = how >> 2;  // 0..63
  switch (how & 3) {
    case 0:
      return special_float(r);
    case 1: {  // magnitudes in eight binades from 2^(parameter - 40)
      const int lo = parameter - 40;
      return float_with_exponent(r, lo, lo + 7);
    }
    case 2:
      return kEdgeFloats[parameter % kEdgeCount];
    default:
      return float_with_exponent(r, -126, -100);
  }
}

std::string describe(const Call& c, const char* isa) {
  const Hyper& h = c.hyper;
  char text[512];
  std::snprintf(text, sizeof text,
                "%s %s/%s/%s n=%" PRId64 " offset=%d out=%d out_is_grad=%d stochastic=%d probe=%d counter=%" PRIu32
                " wrap=%" PRId64
                " step_size=%a inv_bc2_sqrt=%a eps=%a decay=%a l2=%a grad_scale=%a "
                "one_minus_beta1=%a beta2=%a one_minus_beta2=%a",
                isa, dtype_name(c.layout.param), dtype_name(c.layout.grad), dtype_name(c.layout.state), c.n, c.offset,
                c.out, c.out_is_grad, h.stochastic_rounding, static_cast<int>(h.probe), c.first_counter, c.counter_wrap,
                h.step_size, h.inv_bc2_sqrt, h.eps, h.decay, h.l2, h.grad_scale, h.one_minus_beta1, h.beta2,
                h.one_minus_beta2);
  return text;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r{data, size};
  const uint8_t flags = r.u8();
  const uint8_t isa_mask = r.u8();
  const auto size_bits = static_cast<uint32_t>(r.bytes(2));
  const int offset = r.u8() % 16;
  uint32_t first_counter = r.u32() & ~1u;
  const uint8_t wrap_bits = r.u8();
  const uint32_t key = r.u32(), key_after_wrap = r.u32();
  const bool adamw = r.u8() & 1;
  const double lr = scalar(r, kLr), beta1 = scalar(r, kBeta), beta2 = scalar(r, kBeta), eps = scalar(r, kEps);
  const double weight_decay = scalar(r, kWeightDecay), grad_scale = scalar(r, kGradScale);
  const double bc1 = scalar(r, kBiasCorrection), bc2 = scalar(r, kBiasCorrection);
  const uint64_t seed = r.bytes(8);
  uint8_t how[5];
  for (uint8_t& h : how) h = r.u8();

  Call c{};
  const int state = (flags >> 2) & 3;
  c.layout = {flags & 1 ? DType::bf16 : DType::f32, flags & 2 ? DType::bf16 : DType::f32,
              state == 0   ? DType::f32
              : state == 1 ? DType::bf16
                           : DType::q8};
  c.out = flags & 16;
  c.out_is_grad = flags & 32;
  c.n = size_bits & 0x8000u ? (size_bits & 0x7FFFu) % 4200 : (size_bits & 0x7FFFu) % 161;
  c.offset = offset;
  const bool stochastic = flags & 64;
  if (flags & 128) {
    c.hyper = Hyper{};  // bandwidth_probe_: no scalars, no rounding mode, counters unused; the variant from them
    c.hyper.probe = static_cast<ProbeVariant>(static_cast<int>(ProbeVariant::plain) + (first_counter & 3));
    first_counter = 0;
  } else if (!cpu_adam::fold_hyper({lr, beta1, beta2, eps, weight_decay, adamw, bc1, bc2, grad_scale, stochastic, 1},
                                   c.hyper)
                  .empty()) {
    return -1;  // the op refuses these scalars
  }
  // Where the counter wraps: float-state segments never cross it; an 8-bit state's segment may,
  // in its last block.
  const uint64_t to_wrap = (uint64_t{1} << 32) - first_counter;
  // A wrap that rounds down to element 0 is no wrap: such a segment must not cross it either.
  c.counter_wrap = c.n;
  int64_t wrap = 0;
  if (c.layout.state == DType::q8 && (wrap_bits & 1) && c.n > 0) {
    const int64_t last_block = (c.n - 1) / kQ8Block * kQ8Block;
    wrap = (last_block + 1 + (wrap_bits >> 1) % (c.n - last_block)) & ~int64_t{1};
  }
  if (wrap > 0) {
    first_counter = static_cast<uint32_t>((uint64_t{1} << 32) - static_cast<uint64_t>(wrap));
    c.counter_wrap = wrap;
  } else if (to_wrap < static_cast<uint64_t>(c.n)) {
    first_counter = static_cast<uint32_t>((uint64_t{1} << 32) - static_cast<uint64_t>(c.n)) & ~1u;
  }
  c.first_counter = first_counter;
  c.key = key;
  c.key_after_wrap = key_after_wrap;

  Tuple inputs = make_arrays(c);
  Rng rng{seed};
  for (int k = 0; k < 4; ++k) {
    for (int64_t i = 0; i < c.n; ++i) inputs.a[k].set_float(i, generated(how[k], rng));
  }
  for (int64_t i = 0; i < inputs.a[5].n; ++i) {
    // State scales: any bits, or the powers of two the kernel writes.
    const uint32_t bits = generated(how[4], rng);
    inputs.a[5].set_float(i, how[4] & 0x80 ? bits & 0x7F800000u : bits);
  }
  for (int64_t word = 0; r.at < size && c.n > 0; ++word) {
    inputs.a[word % 4].set_float(word / 4 % c.n, r.u32());
  }

  const std::vector<const cpu_adam::Isa*>& all = isas();
  const Tuple expected = run_call(all.back()->kernel, c, inputs, Mode::flushed);
  if (!guards_untouched(expected, inputs, describe(c, "scalar"))) std::abort();
  for (size_t k = 0; k + 1 < all.size(); ++k) {
    if (isa_mask != 0 && !(isa_mask >> (k % 8) & 1)) continue;
    const std::string what = describe(c, all[k]->name);
    const Tuple actual = run_call(all[k]->kernel, c, inputs, Mode::flushed);
    if (!guards_untouched(actual, inputs, what) || !same_results(actual, expected, what)) {
      std::fflush(stdout);
      std::abort();
    }
  }
  return 0;
}
