#pragma once
// CPU Adafactor step (torch.optim.Adafactor's algorithm: Shazeer & Stern 2018 with torch's lr and eps1 rules):
// the public C++ API of the factored step, beside adam.h's.
//
// A parameter of two or more dimensions is viewed as [batches, rows, cols] (its last two dimensions factored,
// as torch does) and keeps row_var [batches * rows] and col_var [batches * cols]; one of fewer dimensions
// keeps variance [n]. Three passes over the parameter (the global norms come before the update):
//   1. factored: per row sum g^2 and p^2, per column sum g^2 (vector: folded into pass 2);
//   -  the factors (O(rows + cols), host): lerp towards the means; square roots of row_var / max(mean, eps1)
//      and of col_var;
//   2. u = g / max(sqrt(row) * sqrt(col), eps1) (vector: g / sqrt(max(variance, eps1^2)), the variance updated
//      here), sum u^2;
//   3. p = p * (1 - lr*wd) - alpha / max(1, rms(u) / d) * u, u recomputed (never stored).
// Every sum runs over a fixed split of the parameter (rows, blocks of 64 rows or 4096 elements, 16 lanes each)
// added in a fixed order, so the result is bit-identical at every SIMD level and thread count.
#include <cstdint>

#include "adam/adam_types.h"

namespace swapio {
namespace adam {

struct AdafactorHyper {
  int64_t step = 1;          // the step being taken, counting from 1
  double lr = 1e-2;
  double beta2_decay = -0.8;
  double eps1 = 1.1920928955078125e-07;  // the caller resolves torch's None (finfo(float32).eps)
  double eps2 = 1e-3;
  double d = 1.0;
  double weight_decay = 0.0;
  bool maximize = false;
};

// factored: batches, rows, cols > 0 with batches * rows * cols == n, row_var and col_var set; else variance.
// grad: grad_dtype (kF32, kBF16, kF16); param_out: nullptr with kNone, or n out_dtype elements.
void adafactor_step(float* param, const void* grad, DType grad_dtype, float* row_var, float* col_var,
                    float* variance, int64_t n, bool factored, int64_t batches, int64_t rows, int64_t cols,
                    const AdafactorHyper& h, void* param_out, DType out_dtype, int threads,
                    Capability cap = Capability::kAuto);

}  // namespace adam
}  // namespace swapio
