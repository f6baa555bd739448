// Where the 8-bit step's time goes: each part of the kernel's 8-bit path over 2^24 elements, one thread,
// AVX-512 (with BF16), bf16 params and grads, against the same step with bf16 moments. Torch-free: it
// includes the kernel's own headers. From the repository root:
//
//   g++ -std=c++17 -O3 -ffp-contract=off -fno-math-errno -Icsrc benchmarks/q8_parts.cpp -o /tmp/q8_parts
//   /tmp/q8_parts          # bf16 params rounded to nearest
//   /tmp/q8_parts sr       # stochastic rounding
//
// Each figure is the best of 9 passes, in ns per element; the parts overlap their memory traffic when
// they run together, so they add up to more than the whole step.
#include "kernels/isa_prelude.h"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/avx512_ops.h"

using namespace cpu_adam;

namespace {

struct Ops : Avx512Ops {  // the avx512_bf16 kernel's ops (csrc/kernels/avx512_bf16.cpp)
  using H = __m256i;
  static void store16(uint16_t* p, H bits) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits); }
  static H bf16_nearest(F x) { return (__m256i)_mm512_cvtneps_pbh(x); }  // NOLINT
  static H bf16_stochastic(F x, U random16) {
    const U u = _mm512_castps_si512(x);
    const __mmask16 not_nan = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
    const U truncated = _mm512_and_si512(_mm512_mask_add_epi32(u, not_nan, u, random16), splat(0xFFFF0000u));
    return (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(truncated));  // NOLINT
  }
};

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

uint16_t bf16_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

int main(int argc, char** argv) {
  _mm_setcsr(_mm_getcsr() | 0x8040);  // flush denormals, as the kernel runs
  const int64_t n = int64_t{1} << 24, blocks = n / kQ8Block;
  std::vector<uint16_t> param(n), grad(n), mb(n), vb(n);
  std::vector<float> values(n), scales(2 * blocks, 1.0f);
  std::vector<uint8_t> mc(n), uc(n);
  for (int64_t i = 0; i < n; ++i) {
    values[i] = 0.01f * static_cast<float>((i * 2654435761u) % 1000) - 4.995f;
    param[i] = bf16_of(values[i]);
    grad[i] = bf16_of(1e-3f * static_cast<float>((i * 40503u) % 997) - 0.5e-3f);
  }
  Hyper h{};
  h.step_size = 1e-3f, h.inv_bc2_sqrt = 1.2f, h.eps = 1e-8f, h.decay = 0.9999f, h.grad_scale = 0.5f;
  h.one_minus_beta1 = 0.1f, h.one_minus_weight = 0.9f, h.beta2 = 0.95f, h.one_minus_beta2 = 0.05f;
  h.stochastic_rounding = argc > 1, h.probe = ProbeVariant::none;
  Segment s{};
  s.param = param.data(), s.grad = grad.data(), s.exp_avg = mc.data(), s.exp_avg_sq = uc.data(), s.n = n;
  s.rng_key = 12345, s.exp_avg_scale = scales.data(), s.exp_avg_sq_scale = scales.data() + blocks, s.counter_wrap = n;
  const Layout q8{DType::bf16, DType::bf16, DType::q8}, bf16{DType::bf16, DType::bf16, DType::bf16};
  for (int r = 0; r < 3; ++r) run<Ops>(s, q8, h);  // codes of a run in progress
  const auto best = [](auto&& fn) {
    double b = 1e9;
    for (int r = 0; r < 9; ++r) {
      const double t = now();
      fn();
      b = std::min(b, now() - t);
    }
    return b / static_cast<double>(int64_t{1} << 24) * 1e9;
  };
  Segment sb = s;
  sb.exp_avg = mb.data(), sb.exp_avg_sq = vb.data();
  alignas(64) float m[kQ8Block], u[kQ8Block];
  float sink = 0;
  const auto decode = [&](int64_t b) {
    decode_avg_block(mc.data() + b * kQ8Block, kQ8Block, scales[b], m);
    decode_root_block(uc.data() + b * kQ8Block, kQ8Block, scales[blocks + b], u);
  };
  const auto fill = [&](int64_t b) {  // new moments of a normal block, as the step leaves them
    for (int i = 0; i < kQ8Block; ++i) {
      m[i] = (values[b * kQ8Block + i] + 7.5f) * 1e-3f;
      u[i] = std::fabs(values[b * kQ8Block + i]) * 1e-2f + 1e-2f;
    }
  };
  const double whole = best([&] { run<Ops>(s, q8, h); });
  const double bf16_step = best([&] { run<Ops>(sb, bf16, h); });
  const double decoded = best([&] {
    for (int64_t b = 0; b < blocks; ++b) decode(b), sink += m[b & 255] + u[(b * 7) & 255];
  });
  const double stepped = best([&] {
    for (int64_t b = 0; b < blocks; ++b) {
      decode(b);
      Segment part = s;
      part.param = param.data() + b * kQ8Block, part.grad = grad.data() + b * kQ8Block, part.exp_avg = m;
      part.exp_avg_sq = u, part.n = kQ8Block, part.first_counter = static_cast<uint32_t>(b * kQ8Block);
      run_segment<Ops, uint16_t, uint16_t, float, true>(part, h);
    }
  });
  const double filled = best([&] {
    for (int64_t b = 0; b < blocks; ++b) fill(b), sink += m[3] + u[5];
  });
  const double encoded = best([&] {
    for (int64_t b = 0; b < blocks; ++b) {
      fill(b);
      float m_scale, u_scale;
      encode_block({m, u, kQ8Block, mc.data() + b * kQ8Block, uc.data() + b * kQ8Block},
                   static_cast<uint32_t>(b * kQ8Block), 77, kQ8Block, 0, &m_scale, &u_scale);
    }
  });
  std::printf("%s bf16 params, ns per element, one thread:\n", argc > 1 ? "stochastically rounded" : "nearest");
  std::printf("  the 8-bit step              %.2f\n  the bf16-moment step        %.2f\n", whole, bf16_step);
  std::printf("  decode (both moments)       %.2f\n  Adam on the decoded block   %.2f\n", decoded, stepped - decoded);
  std::printf("  encode (block max, codes)   %.2f\n  (%g)\n", encoded - filled, sink);
}
