// A torch-free driver of the kernels, built for x86-64 (natively under AddressSanitizer and
// UndefinedBehaviorSanitizer by run.sh here) and for AArch64 (run under qemu-aarch64 by
// tests/arm/run.sh):
// - every ISA this CPU supports against the scalar kernel, bit for bit (NaNs
//   compared as NaNs), with flushed denormals as a step runs them, and on every
//   array past its end (guard zones: predicated tails must not write there; under
//   ASan they are poisoned while a kernel runs, so a read there is caught too);
// - steps flush denormals, and the caller's mode comes back after them;
// - the scalar kernel's results written to a file (one architecture) or checked
//   against one (the other), with and without flushing;
// - --write-steps: a few steps, their inputs, the scalars the kernel received and its results, for
//   the device kernel's tests (the format below, at write_steps; tests/arm/aarch64_steps.bin is
//   AArch64's).
//
//   driver [--write-reference FILE | --check-reference FILE | --write-steps FILE]
//          [--expect-isas LIST] [--expect-active NAME] [--expect-sve-bits N]
//
// Inputs come from a seeded integer generator, so both architectures see the
// same bits; hyper-parameters are folded in double as ops.cpp folds them, with
// powers taken by repeated multiplication rather than from libm.
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#if defined(__aarch64__) && defined(__linux__)
#include <sys/prctl.h>
#endif

#include "cases.h"
#include "dispatch.h"
#include "hyper.h"

namespace {

using cpu_adam::Isa;
using namespace kernel_tests;

#if defined(__aarch64__)
constexpr const char* kArch = "aarch64";
#elif defined(__x86_64__) || defined(_M_X64)
constexpr const char* kArch = "x86_64";
#else
constexpr const char* kArch = "other";
#endif

int checks_passed = 0;

// ---- inputs ----

// Each case's data; write_steps records it by this order.
enum class Data { random, tiny, edge, edge_l2, special };
const char* data_name(Data d) {
  const char* names[] = {"random", "tiny", "edge", "edge_l2", "special"};
  return names[static_cast<int>(d)];
}

// A scale c and a bf16-exact value x = 2^-126 * (1 + a/128) whose exact product lies in
// 2^-126 * (1 - 2^-25, 1): it rounds up to 2^-126, which x86-64 keeps (tiny after rounding) and
// AArch64 flushes (tiny before). Random inputs almost never land there. As grad * grad_scale it
// tests the kernel's products; as param * weight_decay + 0 (L2) its fused multiply-add. (A quotient
// of floats cannot land there: the kernel's one division makes no such case.)
struct Edge {
  float grad_scale;
  uint32_t grad;
};

Edge find_edge() {
  for (uint32_t a = 1; a < 128; ++a) {
    const double x = 1.0 + a / 128.0;
    const float c = static_cast<float>(1.0 / x);
    for (const float scale : {std::nextafter(c, 0.0f), c, std::nextafter(c, 2.0f)}) {
      const double product = static_cast<double>(scale) * x;  // exact: 24 bits times 8
      if (product > 1.0 - std::ldexp(1.0, -25) && product < 1.0) return {scale, 0x00800000u | a << 16};
    }
  }
  fail("no grad scale rounds a bf16 grad up to 2^-126");
  return {1.0f, 0x00800000u};
}

const Edge kEdge = find_edge();

struct Values {
  uint32_t param, grad, exp_avg, exp_avg_sq;
};

// "random": magnitudes over many binades, as tests/test_kernel.py makes them;
// "tiny": grads near 1e-19, where (1 - beta2) * g * g is denormal or just above;
// "special": any bit pattern in any array.
Values make_values(Data data, Rng& r) {
  switch (data) {
    case Data::random: {
      const int scale = r.range(-20, 3);
      return {float_with_exponent(r, -2, 1), float_with_exponent(r, scale - 1, scale),
              float_with_exponent(r, scale - 5, scale - 3), float_with_exponent(r, 2 * scale - 2, 2 * scale, true)};
    }
    case Data::tiny: {
      const uint32_t v = r.range(0, 3) == 0 ? 0u : float_with_exponent(r, -126, -112, true);
      return {float_with_exponent(r, -2, 1), float_with_exponent(r, -66, -58), float_with_exponent(r, -70, -62), v};
    }
    case Data::edge: {
      // Tiny data; in about half the elements a grad that kEdge's scale rounds up to +-2^-126 and a
      // param small enough for that grad's update to show in it.
      Values v = make_values(Data::tiny, r);
      if (r.range(0, 1) == 0) {
        v.grad = kEdge.grad | (r.u32() & 0x80000000u);
        v.param = float_with_exponent(r, -112, -106);
      }
      return v;
    }
    case Data::edge_l2: {
      // Tiny data; in about half the elements a zero grad and a param that kEdge's scale, as the L2
      // weight decay, rounds up to +-2^-126.
      Values v = make_values(Data::tiny, r);
      if (r.range(0, 1) == 0) {
        v.param = kEdge.grad | (r.u32() & 0x80000000u);
        v.grad = r.u32() & 0x80000000u;
      }
      return v;
    }
    default:
      return {special_float(r), special_float(r), special_float(r), special_float(r)};
  }
}

// ---- cases ----

struct Variant {
  const char* name;
  int step;
  double lr, beta1, beta2, eps, weight_decay;
  bool adamw, bias_correction;
  double grad_scale;
  bool out, out_is_grad, stochastic;
  ProbeVariant probe;
};

const Variant kVariants[] = {
    {"plain", 1, 1e-2, 0.9, 0.999, 1e-8, 0.0, true, true, 1.0, false, false, false, ProbeVariant::none},
    {"adamw+grad_scale+out", 3, 1e-2, 0.9, 0.999, 1e-8, 0.1, true, true, 0.37, true, false, false, ProbeVariant::none},
    {"l2+no_bias_correction+out", 7, 1e-2, 0.9, 0.999, 1e-8, 0.1, false, false, 1.0, true, false, false,
     ProbeVariant::none},
    {"stochastic+out", 2, 1e-3, 0.9, 0.999, 1e-8, 0.01, true, true, 1.0, true, false, true, ProbeVariant::none},
    {"stochastic+out=grad", 5, 1e-3, 0.8, 0.99, 1e-6, 0.0, true, true, 2.0, true, true, true, ProbeVariant::none},
    {"probe+out", 1, 0.0, 0.0, 0.0, 0.0, 0.0, true, true, 1.0, true, false, false, ProbeVariant::prefetched_streaming},
    {"probe plain", 1, 0.0, 0.0, 0.0, 0.0, 0.0, true, true, 1.0, false, false, false, ProbeVariant::plain},
};

// Around every vector width (4 to 64 lanes) and its tails, one or two line
// groups (16 elements, or one vector when wider) and what follows them.
const int64_t kSizes[] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  11, 12, 13, 15,  16,  17,  20,  24,
                          31, 32, 33, 47, 48, 49, 63, 64, 65, 80, 95, 96, 97, 100, 127, 128, 129, 130};
// Longer runs, on the random inputs only.
const int64_t kLongSizes[] = {255, 256, 257, 1000, 4097};

const DType kTypes[] = {DType::f32, DType::bf16};
const DType kStateTypes[] = {DType::f32, DType::bf16, DType::q8};

struct Case {
  Data data;
  const Variant* variant;
  uint64_t seed;
  Call call;
};

// Counters start even. Float-state segments never wrap the 32-bit counter (ops.cpp splits them); an
// 8-bit state's segment runs on to the end of the block holding the wrap, and changes keys there.
// `index` picks the counter: 0, 2, any, or the last before the wrap (8-bit states: a wrap inside).
void set_counters(Call& k, size_t index, Rng& r) {
  const int64_t n = k.n;
  const uint32_t top = static_cast<uint32_t>((uint64_t{1} << 32) - static_cast<uint64_t>(n)) & ~1u;
  const int64_t last_block = n > 0 ? (n - 1) / kQ8Block * kQ8Block : 0;
  const int64_t wrap = (last_block + (n - last_block) / 2) & ~int64_t{1};
  const uint32_t choices[] = {0u, 2u, 0x12345678u, top};
  k.first_counter = choices[index % 4];
  k.key = r.u32();
  k.key_after_wrap = r.u32();
  if (k.layout.state == DType::q8 && wrap > 0 && index % 4 == 3) {
    k.first_counter = static_cast<uint32_t>((uint64_t{1} << 32) - static_cast<uint64_t>(wrap));
    k.counter_wrap = wrap;
  }
}

std::string describe(const Case& c) {
  const Call& k = c.call;
  char text[256];
  std::snprintf(text, sizeof text, "%s %s/%s/%s %s n=%" PRId64 " offset=%d counter=%" PRIu32 " wrap=%" PRId64,
                data_name(c.data), dtype_name(k.layout.param), dtype_name(k.layout.grad), dtype_name(k.layout.state),
                c.variant->name, k.n, k.offset, k.first_counter, k.counter_wrap);
  return text;
}

// Folded as ops.cpp folds them (hyper.h), the bias corrections with powers taken by repeated
// multiplication rather than from libm.
Hyper make_hyper(const Variant& v) {
  Hyper h{};
  if (v.probe != ProbeVariant::none) {
    h.probe = v.probe;
    return h;
  }
  double beta1_t = 1.0, beta2_t = 1.0;
  for (int i = 0; i < v.step; ++i) {
    beta1_t *= v.beta1;
    beta2_t *= v.beta2;
  }
  const double bc1 = v.bias_correction ? 1.0 - beta1_t : 1.0;
  const double bc2 = v.bias_correction ? 1.0 - beta2_t : 1.0;
  const std::string error = cpu_adam::fold_hyper(
      {v.lr, v.beta1, v.beta2, v.eps, v.weight_decay, v.adamw, bc1, bc2, v.grad_scale, v.stochastic, v.step}, h);
  if (!error.empty()) fail(std::string(v.name) + ": " + error);
  return h;
}

// Case number `index`: its data's seed drawn from `r`, then its counters and keys if it draws random bits.
Case make_case(Data data, const Variant& v, Layout layout, int64_t n, size_t index, bool random_bits, Rng& r) {
  Case c{data, &v, r.next(), {}};
  Call& k = c.call;
  k.layout = layout;
  k.hyper = make_hyper(v);
  k.out = v.out;
  k.out_is_grad = v.out_is_grad;
  k.n = k.counter_wrap = n;
  k.offset = static_cast<int>(index % 3);
  if (random_bits) set_counters(k, index, r);
  return c;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  Rng r{12345};
  for (const Data data : {Data::random, Data::tiny, Data::special}) {
    for (const DType p : kTypes) {
      for (const DType g : kTypes) {
        for (const DType s : kStateTypes) {
          for (const Variant& v : kVariants) {
            std::vector<int64_t> sizes(std::begin(kSizes), std::end(kSizes));
            if (data == Data::random) sizes.insert(sizes.end(), std::begin(kLongSizes), std::end(kLongSizes));
            for (const int64_t n : sizes)
              cases.push_back(make_case(data, v, {p, g, s}, n, cases.size(), v.stochastic, r));
          }
        }
      }
    }
  }
  return cases;
}

Tuple make_inputs(const Case& c) {
  Tuple t = make_arrays(c.call);
  Rng r{c.seed};
  for (int64_t i = 0; i < c.call.n; ++i) {
    const Values v = make_values(c.data, r);
    t.a[0].set_float(i, v.param);
    t.a[1].set_float(i, v.grad);
    t.a[2].set_float(i, v.exp_avg);
    t.a[3].set_float(i, v.exp_avg_sq);
  }
  // Any scale decodes the same on every ISA; random data gets powers of two, special data any bits.
  for (int64_t i = 0; i < t.a[5].n; ++i) {
    const uint32_t bits = c.data == Data::special ? special_float(r) : float_with_exponent(r, -40, 10) & 0x7F800000u;
    t.a[5].set_float(i, bits);
  }
  return t;
}

Tuple run_case(KernelFn kernel, const Case& c, const Tuple& inputs, Mode mode) {
  return run_call(kernel, c.call, inputs, mode);
}

// ---- steps for the device kernel (--write-steps) ----

// The fixture of tests/test_device_kernel_arm.py, which reads it; little-endian. "ADAMSTEP", u32
// version (1), u32 number of cases, then each case:
//   u8 x 4: param, grad and state dtypes (0 f32, 1 bf16, 2 8-bit codes), data (enum Data);
//   u8 x 4: flags (1 a bf16 output, 2 that output is the bf16 grad itself, 4 Hyper::stochastic_rounding,
//           8 Hyper::lerp_from_grad), the variant (0 to 4: kVariants', 5 edge, 6 edge_l2), 0, 0;
//   u32 x 5: n, first_counter, key, key_after_wrap, counter_wrap (the Segment's);
//   u32 x 10: the bits of the Hyper's floats as the kernel received them: step_size, inv_bc2_sqrt,
//             eps, decay, l2, grad_scale, one_minus_beta1, one_minus_weight, beta2, one_minus_beta2;
//   the inputs: param, grad, exp_avg, exp_avg_sq (n elements each, in its dtype), then for 8-bit
//   states their block scales (f32, exp_avg's blocks then exp_avg_sq's);
//   the scalar kernel's results with denormals flushed as a step runs it: the same arrays, the bf16
//   output (n elements) after exp_avg_sq where it is its own array.

// Every param/grad/state layout; random and tiny data under the kernel tests' variants but the
// probes; tiny data with kEdge's grads under a variant with its grad scale, and with its params
// under one with it as L2 weight decay. Sizes from 1 to 300, ending inside a vector and inside an
// 8-bit block.
std::vector<Case> step_cases() {
  // beta1 = 0: the first moment is the grad, so that a grad flushed or not shows in exp_avg.
  static const Variant edge = {
      "edge", 2, 1e-3, 0.0, 0.999, 1e-8, 0.01, true, true, kEdge.grad_scale, true, false, false, ProbeVariant::none};
  static const Variant edge_l2 = {"edge_l2", 4,    1e-3, 0.0,  0.999, 1e-8,  kEdge.grad_scale,  // as weight decay
                                  false,     true, 1.0,  true, false, false, ProbeVariant::none};
  const int64_t sizes[] = {1, 37, 100, 300};
  std::vector<Case> cases;
  Rng r{20261128};
  int layout = 0;
  for (const DType p : kTypes) {
    for (const DType g : kTypes) {
      for (const DType s : kStateTypes) {
        auto add = [&](Data data, const Variant& v, int64_t n) {
          // 8-bit codes draw random bits whether or not params round stochastically.
          cases.push_back(make_case(data, v, {p, g, s}, n, cases.size(), v.stochastic || s == DType::q8, r));
        };
        for (const Data data : {Data::random, Data::tiny}) {
          for (int v = 0; v < 5; ++v) add(data, kVariants[v], sizes[(layout + v + 2 * (data == Data::tiny)) % 4]);
        }
        add(Data::edge, edge, 37);
        add(Data::edge, edge, 300);
        add(Data::edge_l2, edge_l2, layout % 2 ? 37 : 300);
        ++layout;
      }
    }
  }
  return cases;
}

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

uint32_t to_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

void put_u32(std::vector<unsigned char>& out, uint32_t u) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<unsigned char>(u >> 8 * i));
}

void put_elements(std::vector<unsigned char>& out, const Array& a) {
  out.insert(out.end(), a.bytes.begin() + a.start * a.size, a.bytes.begin() + (a.start + a.n) * a.size);
}

// The step cases through the scalar kernel, written to `path`; every other ISA must agree.
void write_steps(const char* path, const std::vector<const Isa*>& isas) {
  const std::vector<Case> cases = step_cases();
  std::vector<unsigned char> out = {'A', 'D', 'A', 'M', 'S', 'T', 'E', 'P'};
  put_u32(out, 1);
  put_u32(out, static_cast<uint32_t>(cases.size()));
  std::vector<long> agreeing(isas.size(), 0);
  for (const Case& c : cases) {
    const Call& k = c.call;
    const Hyper& h = k.hyper;
    const Tuple inputs = make_inputs(c);
    const Tuple result = run_case(isas.back()->kernel, c, inputs, Mode::flushed);
    guards_untouched(result, inputs, "scalar " + describe(c));
    for (size_t i = 0; i + 1 < isas.size(); ++i) {
      const Tuple t = run_case(isas[i]->kernel, c, inputs, Mode::flushed);
      const std::string what = std::string(isas[i]->name) + " " + describe(c);
      if (guards_untouched(t, inputs, what) && same_results(t, result, what)) ++agreeing[i];
    }
    const auto code = [](DType d) {
      return static_cast<unsigned char>(d == DType::f32 ? 0 : d == DType::bf16 ? 1 : 2);
    };
    const bool own_out = !inputs.a[4].bytes.empty();
    const int flags =
        (k.out ? 1 : 0) | (k.out && !own_out ? 2 : 0) | (h.stochastic_rounding ? 4 : 0) | (h.lerp_from_grad ? 8 : 0);
    int variant = 0;
    while (variant < 5 && c.variant != &kVariants[variant]) ++variant;
    if (variant == 5 && c.data == Data::edge_l2) variant = 6;
    out.insert(out.end(),
               {code(k.layout.param), code(k.layout.grad), code(k.layout.state), static_cast<unsigned char>(c.data),
                static_cast<unsigned char>(flags), static_cast<unsigned char>(variant), 0, 0});
    for (const uint32_t u : {static_cast<uint32_t>(k.n), k.first_counter, k.key, k.key_after_wrap,
                             static_cast<uint32_t>(k.counter_wrap)}) {
      put_u32(out, u);
    }
    for (const float x : {h.step_size, h.inv_bc2_sqrt, h.eps, h.decay, h.l2, h.grad_scale, h.one_minus_beta1,
                          h.one_minus_weight, h.beta2, h.one_minus_beta2}) {
      put_u32(out, to_bits(x));
    }
    for (const int a : {0, 1, 2, 3, 5}) put_elements(out, inputs.a[a]);
    for (const int a : {0, 1, 2, 3, 4, 5}) put_elements(out, result.a[a]);
  }
  for (size_t i = 0; i + 1 < isas.size(); ++i) {
    std::printf("%s: %ld of %zu step cases bitwise equal to scalar\n", isas[i]->name, agreeing[i], cases.size());
    if (agreeing[i] == static_cast<long>(cases.size())) ++checks_passed;
  }
  FILE* f = std::fopen(path, "wb");
  const bool ok = f != nullptr && std::fwrite(out.data(), 1, out.size(), f) == out.size();
  if (f) std::fclose(f);
  if (!ok) {
    fail(std::string("cannot write ") + path);
    return;
  }
  ++checks_passed;
  std::printf("wrote %zu steps of the scalar kernel (%zu bytes) to %s\n", cases.size(), out.size(), path);
}

// ---- the scalar kernel's results across architectures ----

// Every element of every written array, NaNs made one NaN.
void append_canonical(const Tuple& t, std::vector<unsigned char>& out) {
  for (int k = 0; k < kArrays; ++k) {
    const Array& a = t.a[k];
    if (a.bytes.empty()) continue;
    const size_t at = out.size();
    out.insert(out.end(), a.bytes.begin() + a.start * a.size, a.bytes.begin() + (a.start + a.n) * a.size);
    for (int64_t i = 0; i < a.n; ++i) {
      if (!a.is_nan(i)) continue;
      const uint32_t nan = a.size == 2 ? 0x7FC0u : 0x7FC00000u;
      std::memcpy(out.data() + at + static_cast<size_t>(i * a.size), &nan, static_cast<size_t>(a.size));
    }
  }
}

bool read_file(const char* path, std::vector<unsigned char>& bytes) {
  FILE* f = std::fopen(path, "rb");
  if (!f) return false;
  unsigned char chunk[1 << 16];
  size_t got;
  while ((got = std::fread(chunk, 1, sizeof chunk, f)) > 0) bytes.insert(bytes.end(), chunk, chunk + got);
  std::fclose(f);
  return true;
}

// ---- flush-to-zero ----

// Not inlined, its product stored through a volatile: the compiler may not move
// the multiplication out of the flushing scope of its caller.
__attribute__((noinline)) float multiply(float a, float b) {
  volatile float x = a, y = b;
  volatile float product = x * y;
  return product;
}

void check_flushing(const std::vector<const Isa*>& isas) {
  // (1 - beta2) * g * g = 1e-3 * 3e-19 * 3e-19 = 9e-41: denormal, not zero.
  const Variant& plain = kVariants[0];
  Case c{Data::random, &plain, 0, {}};
  c.call.layout = {DType::f32, DType::f32, DType::f32};
  c.call.hyper = make_hyper(plain);
  c.call.n = c.call.counter_wrap = 100;
  Tuple inputs = make_inputs(c);
  for (int64_t i = 0; i < c.call.n; ++i) {
    inputs.a[0].set_float(i, to_bits(1.0f));
    inputs.a[1].set_float(i, to_bits(3e-19f));
    inputs.a[2].set_float(i, 0);
    inputs.a[3].set_float(i, 0);
  }
  const Isa& scalar = *isas.back();
  const float unflushed = from_bits(run_case(scalar.kernel, c, inputs, Mode::unflushed).a[3].get(0));
  if (!(unflushed > 0 && unflushed < std::numeric_limits<float>::min())) {
    fail("flush test input: exp_avg_sq is not denormal without flushing");
  }
  for (const Isa* isa : isas) {
    const Tuple t = run_case(isa->kernel, c, inputs, Mode::flushed);
    bool flushed = true;
    for (int64_t i = 0; i < c.call.n; ++i) flushed &= t.a[3].get(i) == 0 && from_bits(t.a[2].get(i)) > 0;
    if (!flushed) fail(std::string(isa->name) + ": a denormal exp_avg_sq was stored while flushing");
  }
  // A denormal input counts as zero while flushing: 1e-39 * 2^100 would be normal.
  {
    const cpu_adam::ScopedFlushDenormals flush;
    if (multiply(1e-39f, 1.2676506e30f) != 0) fail("a denormal input was not read as zero while flushing");
    if (multiply(1e-20f, 1e-20f) != 0) fail("a denormal product was kept while flushing");
  }
  // The caller's mode is back: its own float math keeps denormals.
  if (!(multiply(1e-20f, 1e-20f) > 0)) fail("the caller's denormals mode was not restored");
  // A product just below 2^-126 that rounds up to it: x86 decides tininess after
  // rounding and keeps 2^-126, ARM before rounding and flushes it.
  const float a = from_bits(0x20000001u);  // (1 + 2^-23) * 2^-63
  const float b = from_bits(0x1FFFFFFEu);  // (1 - 2^-23) * 2^-63 (product: 2^-126 * (1 - 2^-46))
  float edge;
  {
    const cpu_adam::ScopedFlushDenormals flush;
    edge = multiply(a, b);
  }
  const bool arm = std::strcmp(kArch, "aarch64") == 0;
  std::printf("flush edge: 2^-126 * (1 - 2^-46), flushed, gives 0x%08" PRIx32 " on %s\n", to_bits(edge), kArch);
  if (to_bits(edge) != to_bits(arm ? 0.0f : std::numeric_limits<float>::min())) {
    fail("the flush edge did not give this architecture's result");
  }
  if (multiply(a, b) != std::numeric_limits<float>::min()) fail("the flush edge without flushing is not 2^-126");
  if (failures == 0) ++checks_passed;
}

long sve_vector_bits() {
#if defined(__aarch64__) && defined(__linux__) && defined(PR_SVE_GET_VL)
  const int vl = prctl(PR_SVE_GET_VL);
  return vl < 0 ? 0 : (vl & PR_SVE_VL_LEN_MASK) * 8L;
#else
  return 0;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const char* write_path = nullptr;
  const char* check_path = nullptr;
  const char* steps_path = nullptr;
  const char* expect_isas = nullptr;
  const char* expect_active = nullptr;
  const char* only = nullptr;
  bool run_cases = true;
  long expect_sve_bits = -1;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--detect-only") {
      run_cases = false;
      continue;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr,
                   "usage: %s [--write-reference F | --check-reference F | --write-steps F] [--expect-isas LIST] "
                   "[--expect-active NAME] [--expect-sve-bits N]\n",
                   argv[0]);
      return 2;
    }
    const char* value = argv[++i];
    if (arg == "--write-reference")
      write_path = value;
    else if (arg == "--check-reference")
      check_path = value;
    else if (arg == "--write-steps")
      steps_path = value;
    else if (arg == "--expect-isas")
      expect_isas = value;
    else if (arg == "--expect-active")
      expect_active = value;
    else if (arg == "--isas")
      only = value;
    else if (arg == "--expect-sve-bits")
      expect_sve_bits = std::strtol(value, nullptr, 10);
    else {
      std::fprintf(stderr, "unknown argument %s\n", arg.c_str());
      return 2;
    }
  }

  // Supported ISAs, best first; the scalar kernel last.
  std::vector<const Isa*> isas;
  std::string names;
  for (const Isa& isa : cpu_adam::compiled_isas()) {
    if (!isa.supported()) continue;
    isas.push_back(&isa);
    names += (names.empty() ? "" : ",") + std::string(isa.name);
  }
  std::string active;
  try {
    active = cpu_adam::active_isa().name;
  } catch (const std::exception& e) {
    active = "error";
    std::printf("%s\n", e.what());
  }
  const long sve_bits = sve_vector_bits();
  std::printf("%s: supported ISAs %s; active %s; SVE vector %ld bits\n", kArch, names.c_str(), active.c_str(),
              sve_bits);
  if (expect_isas) {
    if (names != expect_isas)
      fail("supported ISAs " + names + ", expected " + expect_isas);
    else
      ++checks_passed;
  }
  if (expect_active) {
    if (active != expect_active) {
      fail("active ISA " + active + ", expected " + expect_active);
    } else {
      ++checks_passed;
    }
  }
  if (expect_sve_bits >= 0) {
    if (sve_bits != expect_sve_bits)
      fail("SVE vector of " + std::to_string(sve_bits) + " bits");
    else
      ++checks_passed;
  }
  if (isas.empty() || std::string(isas.back()->name) != "scalar") {
    fail("the scalar kernel is not last in the table");
    return 1;
  }

  if (!run_cases) {
    std::printf("driver %s: %d passed, %d failed\n", kArch, checks_passed, failures);
    return failures ? 1 : 0;
  }
  check_flushing(isas);
  if (steps_path) {
    write_steps(steps_path, isas);
    std::printf("driver %s: %d passed, %d failed\n", kArch, checks_passed, failures);
    return failures ? 1 : 0;
  }

  // --isas LIST: compare only these (the SVE kernels at each further vector length).
  auto selected = [&](const char* name) {
    return !only || ("," + std::string(only) + ",").find("," + std::string(name) + ",") != std::string::npos;
  };
  const std::vector<Case> cases = all_cases();
  const KernelFn scalar = isas.back()->kernel;
  // The scalar results, canonical, flushed [0] and not [1]; where each case's begin.
  std::vector<unsigned char> reference[2];
  std::vector<size_t> case_begin[2];
  std::vector<long> compared(isas.size(), 0);
  for (const Case& c : cases) {
    const Tuple inputs = make_inputs(c);
    const Tuple expected = run_case(scalar, c, inputs, Mode::flushed);
    guards_untouched(expected, inputs, "scalar " + describe(c));
    for (size_t k = 0; k + 1 < isas.size(); ++k) {
      if (!selected(isas[k]->name)) continue;
      const Tuple actual = run_case(isas[k]->kernel, c, inputs, Mode::flushed);
      const std::string what = std::string(isas[k]->name) + " " + describe(c);
      if (guards_untouched(actual, inputs, what) && same_results(actual, expected, what)) ++compared[k];
    }
    for (int m = 0; m < 2; ++m) case_begin[m].push_back(reference[m].size());
    append_canonical(expected, reference[0]);
    append_canonical(run_case(scalar, c, inputs, Mode::unflushed), reference[1]);
  }
  for (size_t k = 0; k + 1 < isas.size(); ++k) {
    if (!selected(isas[k]->name)) continue;
    std::printf("%s: %ld of %zu cases bitwise equal to scalar\n", isas[k]->name, compared[k], cases.size());
    if (compared[k] == static_cast<long>(cases.size())) ++checks_passed;
  }

  if (write_path) {
    FILE* f = std::fopen(write_path, "wb");
    bool ok = f != nullptr;
    for (int m = 0; ok && m < 2; ++m) {
      ok = std::fwrite(reference[m].data(), 1, reference[m].size(), f) == reference[m].size();
    }
    if (f) std::fclose(f);
    if (!ok) fail(std::string("cannot write ") + write_path);
    std::printf("wrote the scalar results of %zu cases, flushed and not, to %s\n", cases.size(), write_path);
  }
  if (check_path) {
    std::vector<unsigned char> theirs;
    if (!read_file(check_path, theirs) || theirs.size() != reference[0].size() + reference[1].size()) {
      fail(std::string("cannot read ") + check_path + " or it holds other cases");
    } else {
      const char* mode_names[] = {"flushed", "unflushed"};
      for (int m = 0; m < 2; ++m) {
        const unsigned char* other = theirs.data() + (m == 0 ? 0 : reference[0].size());
        long differing = 0;
        for (size_t i = 0; i < cases.size(); ++i) {
          const size_t begin = case_begin[m][i];
          const size_t end = i + 1 < cases.size() ? case_begin[m][i + 1] : reference[m].size();
          if (std::memcmp(reference[m].data() + begin, other + begin, end - begin) == 0) continue;
          if (++differing <= 5) std::printf("  differs (%s): %s\n", mode_names[m], describe(cases[i]).c_str());
        }
        std::printf("scalar %s vs %s: %ld of %zu cases differ (%s)\n", kArch, check_path, differing, cases.size(),
                    mode_names[m]);
        // Flushed, the architectures may differ only on a result that rounds up to
        // 2^-126 (see check_flushing); these inputs make none.
        if (differing)
          fail(std::string("scalar results differ across architectures, ") + mode_names[m]);
        else
          ++checks_passed;
      }
    }
  }

  std::printf("driver %s: %d passed, %d failed\n", kArch, checks_passed, failures);
  return failures ? 1 : 0;
}
