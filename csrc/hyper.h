// The step's scalars, checked and folded into the kernel's Hyper. Torch-free: ops.cpp raises the
// error this returns, and the tests' drivers (tests/kernels/) feed the kernels only what it accepts.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>

#include "kernels/adam_kernel.h"

namespace cpu_adam {

// The scalars of adam_step_, as its schema takes them.
struct AdamScalars {
  double lr, beta1, beta2, eps, weight_decay;
  bool adamw_mode;
  double bias_correction1, bias_correction2, grad_scale;
  bool stochastic_rounding;
  int64_t step;
};

// Doubles as Python prints them, in the fewest digits that read back the same value
// (std::to_string's six fixed decimals print 1e-8 as 0.000000).
inline std::string double_text(double value) {
  char digits[32];
  for (int precision = 1;; ++precision) {
    std::snprintf(digits, sizeof digits, "%.*g", precision, value);
    if (precision == 17 || std::strtod(digits, nullptr) == value) return digits;
  }
}

// A scalar out of range would write NaN, or a plausible wrong number, into every tensor: each is
// refused by name, with the range it must be in. Returns "" and sets `h` when the scalars are
// accepted, else the error message (a ValueError in Python) and leaves `h` unspecified.
inline std::string fold_hyper(const AdamScalars& a, Hyper& h) {
  const auto text = double_text;
  if (!(std::isfinite(a.lr) && a.lr >= 0)) return "cpu_adam: lr must be finite and >= 0, got " + text(a.lr);
  if (!(a.beta1 >= 0 && a.beta1 < 1)) return "cpu_adam: beta1 must be in [0, 1), got " + text(a.beta1);
  if (!(a.beta2 >= 0 && a.beta2 < 1)) return "cpu_adam: beta2 must be in [0, 1), got " + text(a.beta2);
  if (!(std::isfinite(a.eps) && a.eps >= 0)) return "cpu_adam: eps must be finite and >= 0, got " + text(a.eps);
  if (!(std::isfinite(a.weight_decay) && a.weight_decay >= 0)) {
    return "cpu_adam: weight_decay must be finite and >= 0, got " + text(a.weight_decay);
  }
  if (!std::isfinite(a.grad_scale)) return "cpu_adam: grad_scale must be finite, got " + text(a.grad_scale);
  if (a.step < 1) {
    return "cpu_adam: step counts from 1 (the step being taken), got " + std::to_string(a.step);
  }
  for (const auto& [name, value] : {std::pair<const char*, double>{"bias_correction1", a.bias_correction1},
                                    std::pair<const char*, double>{"bias_correction2", a.bias_correction2}}) {
    if (!(std::isfinite(value) && value > 0)) {
      return std::string("cpu_adam: ") + name + " must be finite and > 0, got " + text(value) +
             "; compute it as 1 - beta**step with step >= 1 (1 without bias correction)";
    }
  }
  // Folded in double, as torch folds them in Python, then rounded once to float. The kernel
  // computes in float32: a folded scalar past its range would make every update inf or NaN.
  std::string error;
  const auto narrow = [&](double value, const char* what) {
    const auto narrowed = static_cast<float>(value);
    if (!std::isfinite(narrowed) && error.empty()) {
      error = std::string("cpu_adam: ") + what + " is " + text(value) +
              ", beyond float32's range (+-3.4e38), in which the kernel computes";
    }
    return narrowed;
  };
  h.step_size = narrow(a.lr / a.bias_correction1, "lr / bias_correction1");
  h.inv_bc2_sqrt = narrow(1.0 / std::sqrt(a.bias_correction2), "1 / sqrt(bias_correction2)");
  // The step flushes denormals, which would turn an eps below 2^-126 into 0 and a zero grad's
  // update into 0/0: the smallest normal float keeps eps what it is for, a floor.
  const float eps = narrow(a.eps, "eps");
  h.eps = a.eps > 0 ? std::max(eps, std::numeric_limits<float>::min()) : eps;
  h.decay = narrow(a.adamw_mode ? 1.0 - a.lr * a.weight_decay : 1.0, "1 - lr * weight_decay");
  h.l2 = narrow(a.adamw_mode ? 0.0 : a.weight_decay, "weight_decay");
  h.grad_scale = narrow(a.grad_scale, "grad_scale");
  h.one_minus_beta1 = static_cast<float>(1.0 - a.beta1);
  h.lerp_from_grad = h.one_minus_beta1 >= 0.5f;
  h.one_minus_weight = 1.0f - h.one_minus_beta1;
  h.beta2 = static_cast<float>(a.beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  h.stochastic_rounding = a.stochastic_rounding;
  h.preview = false;
  h.probe = ProbeVariant::none;
  h.next = nullptr;
  return error;
}

}  // namespace cpu_adam
