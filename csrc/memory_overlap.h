// Whether two strided tensors share a byte of memory, decided on their layouts (never element
// by element). Torch-free: checks.cpp describes each tensor as an Extent.
#pragma once

#include <cstdint>
#include <vector>

namespace cpu_adam {

struct Dim {
  int64_t stride;  // bytes between neighbours (> 0 in an Extent)
  int64_t size;    // (> 1 in an Extent)
};

// The bytes of a tensor: `item` bytes at every base + sum(i_d * dims[d].stride), 0 <= i_d < dims[d].size.
struct Extent {
  int64_t base;
  int64_t item;
  std::vector<Dim> dims;  // smallest stride first

  int64_t end() const;  // one past the last byte
};

// Dims sorted by stride, without those that add no address (size 1, stride 0), and merged where
// one continues another: a contiguous block of any shape becomes one dim.
Extent make_extent(int64_t base, int64_t item, const std::vector<Dim>& dims);

enum class Overlap { none, some, unknown };

// Exact for every pair of one-dim extents and for extents whose outer dims share strides (slices,
// interleaved and column-block views of one buffer); other layouts are split dim by dim within
// a fixed budget, past which the answer is `unknown`.
Overlap overlap(const Extent& a, const Extent& b);

}  // namespace cpu_adam
