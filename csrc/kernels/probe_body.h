// The bandwidth probe: the roofline of a step. It moves exactly the bytes the
// step moves, in the same order of streams and the same split into segments,
// as raw vectors with integer ops: no float math, no conversions, nothing that
// could make it slower than memory allows. How memory is asked for is the
// variant (ProbeVariant): with or without the kernel's software prefetch, with
// plain or non-temporal (streaming) stores. Which one is fastest depends on the
// machine, so a benchmark runs them all and compares the kernel with the best.
//
// Every byte of param, exp_avg and exp_avg_sq (and the block scales of 8-bit
// states) is read and written back plus one (mod 256); the grad is read; the
// bf16 output is filled with kProbeFill. The bytes written do not depend on the
// ISA or the variant.
//
// Each ISA supplies a Bytes struct (its widest vector as raw bytes):
//   T; size() bytes per vector; load, store (unaligned), stream (non-temporal,
//   size()-aligned; a plain store where the ISA has none), fence (after the
//   streaming stores of a segment), plus_one (per byte), fill (a splat), and
//   keep (makes a loaded vector count as used, so the load stays).
#pragma once

#include <cstdint>
#include <cstring>

#include "adam_kernel.h"

namespace cpu_adam {
namespace {

constexpr uint8_t kProbeFill = 0x3F;
constexpr int64_t kProbeLine = 64;
// The kernel's distance (adam_body.h), in elements of every stream.
constexpr int64_t kProbePrefetchElements = 512;

// Portable bytes: eight at a time in a 64-bit integer.
struct ScalarBytes {
  using T = uint64_t;
  static constexpr int64_t size() { return 8; }
  static T load(const uint8_t* p) {
    T x;
    std::memcpy(&x, p, sizeof x);
    return x;
  }
  static void store(uint8_t* p, T x) { std::memcpy(p, &x, sizeof x); }
  static void stream(uint8_t* p, T x) { store(p, x); }
  static void fence() {}
  static T plus_one(T x) {
    constexpr T low7 = 0x7F7F7F7F7F7F7F7Full;
    constexpr T ones = 0x0101010101010101ull;
    return ((x & low7) + ones) ^ (x & ~low7);
  }
  static T fill(uint8_t b) { return 0x0101010101010101ull * b; }
  static void keep(T x) { __asm__ volatile("" : : "r"(x)); }
};

inline int64_t probe_size(DType d) { return d == DType::f32 ? 4 : d == DType::bf16 ? 2 : 1; }

template <class B, bool kPrefetch, bool kStream>
void probe_segment(const Segment& s, Layout l) {
  // Elements per iteration: one vector of bytes per byte of element size, in every stream.
  const int64_t chunk = B::size();
  const int64_t p_size = probe_size(l.param), g_size = probe_size(l.grad), s_size = probe_size(l.state);
  auto* param = static_cast<uint8_t*>(s.param);
  const auto* grad = static_cast<const uint8_t*>(s.grad);
  auto* exp_avg = static_cast<uint8_t*>(s.exp_avg);
  auto* exp_avg_sq = static_cast<uint8_t*>(s.exp_avg_sq);
  auto* out = reinterpret_cast<uint8_t*>(s.bf16_out);
  const auto write = [](uint8_t* p, typename B::T x) {
    if (kStream) {
      B::stream(p, x);
    } else {
      B::store(p, x);
    }
  };
  const auto prefetch_lines = [](const uint8_t* base, int64_t from, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += kProbeLine) __builtin_prefetch(base + from + b, 1);
  };
  const auto bump = [&](uint8_t* base, int64_t from, int64_t vectors) {
    for (int64_t k = 0; k < vectors; ++k) {
      uint8_t* p = base + from + k * B::size();
      write(p, B::plus_one(B::load(p)));
    }
  };
  const typename B::T filled = B::fill(kProbeFill);
  int64_t i = 0;
  for (; i + chunk <= s.n; i += chunk) {
    if (kPrefetch) {
      const int64_t ahead = i + kProbePrefetchElements;
      prefetch_lines(param, ahead * p_size, chunk * p_size);
      prefetch_lines(grad, ahead * g_size, chunk * g_size);
      prefetch_lines(exp_avg, ahead * s_size, chunk * s_size);
      prefetch_lines(exp_avg_sq, ahead * s_size, chunk * s_size);
    }
    for (int64_t k = 0; k < g_size; ++k) B::keep(B::load(grad + i * g_size + k * B::size()));
    bump(param, i * p_size, p_size);
    bump(exp_avg, i * s_size, s_size);
    bump(exp_avg_sq, i * s_size, s_size);
    if (out != nullptr) {
      for (int64_t k = 0; k < 2; ++k) write(out + i * 2 + k * B::size(), filled);
    }
  }
  if (kStream) B::fence();
  // The tail, a byte at a time.
  const auto bump_bytes = [](uint8_t* base, int64_t from, int64_t to) {
    for (int64_t b = from; b < to; ++b) base[b] = static_cast<uint8_t>(base[b] + 1);
  };
  for (int64_t b = i * g_size; b < s.n * g_size; ++b) ScalarBytes::keep(grad[b]);
  bump_bytes(param, i * p_size, s.n * p_size);
  bump_bytes(exp_avg, i * s_size, s.n * s_size);
  bump_bytes(exp_avg_sq, i * s_size, s.n * s_size);
  if (out != nullptr) std::memset(out + i * 2, kProbeFill, static_cast<size_t>((s.n - i) * 2));
  if (l.state == DType::q8) {
    const int64_t blocks = (s.n + kQ8Block - 1) / kQ8Block;
    bump_bytes(reinterpret_cast<uint8_t*>(s.exp_avg_scale), 0, blocks * 4);
    bump_bytes(reinterpret_cast<uint8_t*>(s.exp_avg_sq_scale), 0, blocks * 4);
  }
}

// Streaming stores need aligned addresses; a segment whose streams are not
// aligned to the vector (never the case for freshly allocated tensors) stores
// plainly. Every stream advances by whole vectors, so its start decides.
template <class B>
bool probe_aligned(const Segment& s) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % B::size() == 0; };
  return aligned(s.param) && aligned(s.exp_avg) && aligned(s.exp_avg_sq) &&
         (s.bf16_out == nullptr || aligned(s.bf16_out));
}

template <class B>
void run_probe(const Segment& s, Layout l, ProbeVariant variant) {
  const bool stream = probe_aligned<B>(s);
  switch (variant) {
    case ProbeVariant::plain:
      return probe_segment<B, false, false>(s, l);
    case ProbeVariant::prefetched:
      return probe_segment<B, true, false>(s, l);
    case ProbeVariant::streaming:
      return stream ? probe_segment<B, false, true>(s, l) : probe_segment<B, false, false>(s, l);
    default:
      return stream ? probe_segment<B, true, true>(s, l) : probe_segment<B, true, false>(s, l);
  }
}

}  // namespace
}  // namespace cpu_adam
