// Included by every x86 ISA file before its target pragma, so that no standard
// or torch-free header is compiled under a foreign target.
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam_kernel.h"
