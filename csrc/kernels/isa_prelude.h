// Included by every ISA file before its target pragma, so that no standard
// or torch-free header is compiled under a foreign target.
#pragma once

#include "adam_kernel.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#if defined(CPU_ADAM_HAS_SVE)
#include <arm_sve.h>
#endif
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
