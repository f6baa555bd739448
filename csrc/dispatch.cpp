#include "dispatch.h"

#include <atomic>
#include <cstdlib>
#include <stdexcept>

#include "cpu_features.h"

namespace cpu_adam {
namespace {

bool always() { return true; }
#if defined(__x86_64__) || defined(_M_X64)
bool has_avx2() { return cpu_features().avx2; }
bool has_avx512() { return cpu_features().avx512; }
bool has_avx512_bf16() { return cpu_features().avx512_bf16; }
#endif
#if defined(CPU_ADAM_HAS_NEON_BF16)
bool has_neon_bf16() { return cpu_features().neon_bf16; }
#endif
#if defined(CPU_ADAM_HAS_SVE)
bool has_sve() { return cpu_features().sve; }
bool has_sve_bf16() { return cpu_features().sve_bf16; }
#endif

const Isa& find_supported(const std::string& name) {
  std::string known;
  for (const Isa& isa : compiled_isas()) {
    if (name == isa.name) {
      if (!isa.supported()) {
        throw std::runtime_error("cpu_adam: ISA '" + name +
                                 "' is compiled in but this CPU does not support it; unset CPU_ADAM_ISA or "
                                 "pick one listed by `python -m cpu_adam.info`");
      }
      return isa;
    }
    known += known.empty() ? isa.name : std::string(", ") + isa.name;
  }
  throw std::runtime_error("cpu_adam: unknown ISA '" + name + "'; this build has: " + known);
}

const Isa& choose_default() {
  if (const char* forced = std::getenv("CPU_ADAM_ISA"); forced && *forced) return find_supported(forced);
  for (const Isa& isa : compiled_isas()) {
    if (isa.supported()) return isa;
  }
  return compiled_isas().back();
}

std::atomic<const Isa*>& active_slot() {
  static std::atomic<const Isa*> slot{&choose_default()};
  return slot;
}

}  // namespace

const std::vector<Isa>& compiled_isas() {
  static const std::vector<Isa> table = {
#if defined(CPU_ADAM_HAS_AVX512_BF16)
      {"avx512_bf16", adam_avx512_bf16, has_avx512_bf16, squares_avx512},
#endif
#if defined(__x86_64__) || defined(_M_X64)
      {"avx512", adam_avx512, has_avx512, squares_avx512},
      {"avx2", adam_avx2, has_avx2, squares_avx2},
#endif
// AArch64: not yet timed on hardware. SVE first, as it is never narrower than NEON.
#if defined(CPU_ADAM_HAS_SVE)
      {"sve_bf16", adam_sve_bf16, has_sve_bf16, squares_neon},
      {"sve", adam_sve, has_sve, squares_neon},
#endif
#if defined(CPU_ADAM_HAS_NEON_BF16)
      {"neon_bf16", adam_neon_bf16, has_neon_bf16, squares_neon},
#endif
#if defined(__aarch64__)
      {"neon", adam_neon, always, squares_neon},
#endif
      {"scalar", adam_scalar, always, squares_scalar},
  };
  return table;
}

const Isa& active_isa() { return *active_slot().load(); }

std::string set_active_isa(const std::string& name) {
  const Isa* previous = active_slot().exchange(&find_supported(name));
  return previous->name;
}

}  // namespace cpu_adam
