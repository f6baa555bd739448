// Portable kernel: the reference every vector ISA must match bit for bit.
#include "adam_body.h"

namespace cpu_adam {

void adam_scalar(const Segment& s, Layout l, const Hyper& h) { run<ScalarOps>(s, l, h); }

}  // namespace cpu_adam
