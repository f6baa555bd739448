// The fuzz targets' input, read as little-endian fields; past its end every byte reads 0, so
// any input decodes to some case.
#pragma once

#include <cstddef>
#include <cstdint>

namespace kernel_tests {

struct Reader {
  const uint8_t* data;
  size_t size, at = 0;
  uint64_t bytes(int count) {
    uint64_t v = 0;
    for (int k = 0; k < count; ++k, ++at) v |= uint64_t{at < size ? data[at] : uint8_t{0}} << (8 * k);
    return v;
  }
  uint8_t u8() { return static_cast<uint8_t>(bytes(1)); }
  uint32_t u32() { return static_cast<uint32_t>(bytes(4)); }
};

}  // namespace kernel_tests
