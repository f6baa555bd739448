// Portable kernel: the reference every vector ISA must match bit for bit.
#include "adam_body.h"
#include "squares.h"

namespace cpu_adam {

void adam_scalar(const Segment& s, Layout l, const Hyper& h) { run<ScalarOps>(s, l, h); }
double squares_scalar(const void* x, DType dtype, int64_t n) { return squares_of(x, dtype, n); }

}  // namespace cpu_adam
