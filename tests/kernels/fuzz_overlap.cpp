// libFuzzer target: csrc/memory_overlap.cpp against a brute-force enumeration of addresses.
// Two tensors' layouts (base, item size, up to four dims of any non-negative byte stride) are
// decoded from the input, kept small enough to enumerate (at most 4096 elements each); then
// - make_extent describes the same bytes as the dims it was given, and end() is one past the last;
// - overlap() says `some` exactly when a byte is shared and `none` exactly when none is, in either
//   order; `unknown` is allowed only where the header allows it (past one dim per tensor).
//
// Input, little-endian, bytes past the end read as 0; per tensor:
//   0      bits 0-1 item size (1, 2, 4, 8), bits 2-4 dims (% 5), bits 5-7 base shift (0 to 14 bits,
//          so that bases stay below 2^46, as addresses do)
//   1-4    base (shifted left by the base shift)
//   then per dim: 2 bytes stride, 1 byte stride shift (% 25), 1 byte size (% 17 + 1, or % 65 + 1
//   for the first dim when bit 7 of the shift byte is set)
#include <algorithm>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iterator>
#include <vector>

#include "fuzz_input.h"
#include "memory_overlap.h"

namespace {

using cpu_adam::Dim;
using cpu_adam::Extent;
using cpu_adam::Overlap;
using kernel_tests::Reader;

struct Layout {
  int64_t base, item;
  std::vector<Dim> dims;
};

constexpr int64_t kMaxElements = 4096;

Layout read_layout(Reader& r) {
  const auto head = static_cast<uint8_t>(r.bytes(1));
  Layout l;
  l.item = int64_t{1} << (head & 3);
  const int dims = ((head >> 2) & 7) % 5;
  l.base = static_cast<int64_t>(r.bytes(4) << (2 * (head >> 5)));
  int64_t elements = 1;
  for (int d = 0; d < dims; ++d) {
    const auto stride = static_cast<int64_t>(r.bytes(2));
    const auto shift = static_cast<uint8_t>(r.bytes(1));
    const auto size_byte = static_cast<int64_t>(r.bytes(1));
    int64_t size = (d == 0 && (shift & 0x80)) ? size_byte % 65 + 1 : size_byte % 17 + 1;
    size = std::min(size, kMaxElements / elements);
    elements *= size;
    l.dims.push_back({stride << ((shift & 0x7F) % 25), size});
  }
  return l;
}

// Every byte address of the layout, sorted, without repeats.
std::vector<int64_t> addresses(int64_t base, int64_t item, const std::vector<Dim>& dims) {
  std::vector<int64_t> starts{base};
  for (const Dim& d : dims) {
    std::vector<int64_t> next;
    for (const int64_t s : starts) {
      for (int64_t i = 0; i < d.size; ++i) next.push_back(s + i * d.stride);
    }
    starts.swap(next);
  }
  std::vector<int64_t> all;
  for (const int64_t s : starts) {
    for (int64_t b = 0; b < item; ++b) all.push_back(s + b);
  }
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  return all;
}

void print_layout(const char* name, const Layout& l) {
  std::printf("%s: base %" PRId64 " item %" PRId64 " dims", name, l.base, l.item);
  for (const Dim& d : l.dims) std::printf(" (stride %" PRId64 ", size %" PRId64 ")", d.stride, d.size);
  std::printf("\n");
}

[[noreturn]] void fail(const char* what, const Layout& a, const Layout& b) {
  std::printf("FAIL %s\n", what);
  print_layout("a", a);
  print_layout("b", b);
  std::fflush(stdout);
  std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader r{data, size};
  const Layout a = read_layout(r), b = read_layout(r);
  const std::vector<int64_t> bytes_a = addresses(a.base, a.item, a.dims);
  const std::vector<int64_t> bytes_b = addresses(b.base, b.item, b.dims);
  const Extent ea = cpu_adam::make_extent(a.base, a.item, a.dims);
  const Extent eb = cpu_adam::make_extent(b.base, b.item, b.dims);
  for (const Extent* extent : {&ea, &eb}) {
    const std::vector<int64_t>& bytes = extent == &ea ? bytes_a : bytes_b;
    if (addresses(extent->base, extent->item, extent->dims) != bytes) fail("make_extent changed the bytes", a, b);
    if (extent->end() != bytes.back() + 1) fail("end() is not one past the last byte", a, b);
    for (const Dim& d : extent->dims) {
      if (d.stride <= 0 || d.size <= 1) fail("make_extent kept a dim that adds no address", a, b);
    }
  }
  std::vector<int64_t> shared;
  std::set_intersection(bytes_a.begin(), bytes_a.end(), bytes_b.begin(), bytes_b.end(), std::back_inserter(shared));
  const bool exact = ea.dims.size() <= 1 && eb.dims.size() <= 1;
  for (const Overlap o : {cpu_adam::overlap(ea, eb), cpu_adam::overlap(eb, ea)}) {
    if (o == Overlap::some && shared.empty()) fail("overlap() says some, but no byte is shared", a, b);
    if (o == Overlap::none && !shared.empty()) fail("overlap() says none, but a byte is shared", a, b);
    if (o == Overlap::unknown && exact) fail("overlap() says unknown for two one-dim extents", a, b);
  }
  return 0;
}
