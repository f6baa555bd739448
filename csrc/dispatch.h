// The kernel table: every ISA compiled into this binary, best first. The
// default is chosen once, from the CPU (cpuid on x86-64, the auxiliary vector on
// Linux/AArch64) or from CPU_ADAM_ISA.
#pragma once

#include <string>
#include <vector>

#include "kernels/adam_kernel.h"

namespace cpu_adam {

struct Isa {
  const char* name;
  KernelFn kernel;
  bool (*supported)();
  SquaresFn squares;  // the widest vectors the ISA's CPUs have for it (the bf16 converts do not matter there)
};

const std::vector<Isa>& compiled_isas();
const Isa& active_isa();
// Makes `name` the active ISA (tests, benchmarks); returns the previous one's
// name. Throws if it is unknown, not compiled or not supported by this CPU.
std::string set_active_isa(const std::string& name);

}  // namespace cpu_adam
