#include "memory_overlap.h"

#include <algorithm>
#include <numeric>
#include <utility>

namespace cpu_adam {
namespace {

using Wide = __int128;  // a Bezout coefficient times an address difference needs up to ~90 bits

// Extents visited per pair: a few milliseconds at most, far more than any slicing of a buffer needs.
constexpr int64_t kVisitBudget = 1 << 14;

template <class T>
T floor_div(T a, T b) {  // b > 0
  const T q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}

template <class T>
T ceil_div(T a, T b) {  // b > 0
  return -floor_div<T>(-a, b);
}

struct Bezout {
  int64_t g, x, y;  // g = gcd(a, b) = a*x + b*y
};

Bezout bezout(int64_t a, int64_t b) {
  if (b == 0) return {a, 1, 0};
  const Bezout r = bezout(b, a % b);
  return {r.g, r.y, r.x - (a / b) * r.y};
}

// Whether i*s - j*t == c for some 0 <= i < n, 0 <= j < m (s, t > 0).
bool lattice_hits(int64_t s, int64_t n, int64_t t, int64_t m, int64_t c) {
  const Bezout e = bezout(s, t);
  if (c % e.g != 0) return false;
  // Every solution is i = i0 + k*t/g, j = j0 + k*s/g: is there a k that keeps both in range?
  const Wide i0 = Wide{e.x} * (c / e.g), j0 = -Wide{e.y} * (c / e.g);
  const Wide di = t / e.g, dj = s / e.g;
  const Wide lowest = std::max(ceil_div(-i0, di), ceil_div(-j0, dj));
  const Wide highest = std::min(floor_div(Wide{n - 1} - i0, di), floor_div(Wide{m - 1} - j0, dj));
  return lowest <= highest;
}

Dim only_dim(const Extent& e) { return e.dims.empty() ? Dim{1, 1} : e.dims[0]; }

// Extents of at most one dim: byte x of a's element i is byte y of b's element j when
// i*s - j*t == (b.base - a.base) + y - x.
bool progressions_meet(const Extent& a, const Extent& b) {
  const Dim da = only_dim(a), db = only_dim(b);
  const int64_t distance = b.base - a.base;
  for (int64_t c = distance - (a.item - 1); c <= distance + b.item - 1; ++c) {
    if (lattice_hits(da.stride, da.size, db.stride, db.size, c)) return true;
  }
  return false;
}

// Two addresses of a and b differ by (b.base - a.base) + (y - x) plus a multiple of the gcd of
// all strides: where no such difference can be 0, no byte is shared (interleaved views).
bool residues_meet(const Extent& a, const Extent& b) {
  int64_t g = 0;
  for (const Extent* e : {&a, &b}) {
    for (const Dim& d : e->dims) g = std::gcd(g, d.stride);
  }
  if (g == 0) return true;
  const int64_t distance = b.base - a.base;
  return floor_div(distance + b.item - 1, g) * g >= distance - (a.item - 1);
}

Extent without_outer_dim(const Extent& e) { return {e.base, e.item, {e.dims.begin(), e.dims.end() - 1}}; }

// The i in [0, n) for which [start + i*stride, start + i*stride + length) meets [lo, hi).
std::pair<int64_t, int64_t> touching(int64_t start, int64_t stride, int64_t n, int64_t length, int64_t lo, int64_t hi) {
  return {std::max<int64_t>(0, floor_div(lo - length - start, stride) + 1),
          std::min(n - 1, floor_div(hi - 1 - start, stride))};
}

Overlap overlap_within(const Extent& a, const Extent& b, int64_t& budget);

// Copies of `piece` at start + k*stride, 0 <= k < count, each tested against `fixed`.
Overlap any_copy_overlaps(Extent piece, int64_t start, int64_t stride, int64_t count, const Extent& fixed,
                          int64_t& budget) {
  const auto [first, last] = touching(start, stride, count, piece.end() - piece.base, fixed.base, fixed.end());
  for (int64_t k = first; k <= last; ++k) {
    piece.base = start + k * stride;
    const Overlap o = overlap_within(piece, fixed, budget);
    if (o != Overlap::none) return o;
  }
  return Overlap::none;
}

Overlap overlap_within(const Extent& a, const Extent& b, int64_t& budget) {
  if (--budget < 0) return Overlap::unknown;
  if (a.end() <= b.base || b.end() <= a.base || !residues_meet(a, b)) return Overlap::none;
  if (a.dims.size() <= 1 && b.dims.size() <= 1) return progressions_meet(a, b) ? Overlap::some : Overlap::none;
  const int64_t outer_a = a.dims.empty() ? 0 : a.dims.back().stride;
  const int64_t outer_b = b.dims.empty() ? 0 : b.dims.back().stride;
  if (outer_a < outer_b) return overlap_within(b, a, budget);
  const Dim outer = a.dims.back();
  if (outer_a == outer_b) {
    // Row i of a meets row j of b only as row 0 of a meets row j - i of b: one test per
    // difference j - i in [-(rows of a - 1), rows of b - 1], instead of one per pair of rows.
    const int64_t rows_b = b.dims.back().size;
    return any_copy_overlaps(without_outer_dim(b), b.base - (outer.size - 1) * outer.stride, outer.stride,
                             outer.size + rows_b - 1, without_outer_dim(a), budget);
  }
  return any_copy_overlaps(without_outer_dim(a), a.base, outer.stride, outer.size, b, budget);
}

}  // namespace

int64_t Extent::end() const {
  int64_t last = base;
  for (const Dim& d : dims) last += (d.size - 1) * d.stride;
  return last + item;
}

Extent make_extent(int64_t base, int64_t item, const std::vector<Dim>& dims) {
  std::vector<Dim> kept;
  for (const Dim& d : dims) {
    if (d.size > 1 && d.stride != 0) kept.push_back(d);
  }
  std::sort(kept.begin(), kept.end(), [](const Dim& x, const Dim& y) { return x.stride < y.stride; });
  Extent e{base, item, {}};
  for (const Dim& d : kept) {
    if (!e.dims.empty() && e.dims.back().stride * e.dims.back().size == d.stride) {
      e.dims.back().size *= d.size;
    } else {
      e.dims.push_back(d);
    }
  }
  return e;
}

Overlap overlap(const Extent& a, const Extent& b) {
  int64_t budget = kVisitBudget;
  return overlap_within(a, b, budget);
}

}  // namespace cpu_adam
