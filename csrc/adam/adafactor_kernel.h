#pragma once
// Internal interface between the Adafactor entry point (adafactor.cpp, baseline) and its per-ISA loops
// (adafactor_loops.h, instantiated in adam_scalar.cpp / adam_avx2.cpp / adam_avx512.cpp). Plain declarations
// and a POD struct only, as in adam_kernel.h.
#include <cstdint>

#include "adam/adam_types.h"

namespace swapio {
namespace adam {

// Rows of one task of the factored reduce pass: its column sums are kept apart (col_part) and added in task
// order afterwards, so the sums do not depend on the thread count.
constexpr int64_t kFactorRowBlock = 64;
// Elements of one task of a vector (1-D) parameter's passes: the unit whose sums are kept apart.
constexpr int64_t kVectorBlock = 4096;

enum class AdafactorPass : int {
  kFactorReduce = 0,  // tasks: row blocks; row_sumsq[r] = sum g^2, param_sumsq[r] = sum p^2, col_part
  kFactorNorm = 1,    // tasks: rows; row_sumsq[r] = sum u^2
  kFactorApply = 2,   // tasks: rows; p = p*decay + neg_scale*u
  kVectorNorm = 3,    // tasks: blocks; variance = lerp(variance, g^2, w); row_sumsq[k] = sum u^2, param_sumsq[k]
  kVectorApply = 4,   // tasks: blocks; p = p*decay + neg_scale*u
};

struct AdafactorArgs {
  float* param;
  const void* grad;
  void* param_out;          // only written when out_dtype != kNone
  DType grad_dtype;
  DType out_dtype;
  int64_t n;                // elements
  int64_t rows_per_batch;   // factored: R (the parameter is [B, R, C])
  int64_t cols;             // factored: C
  int64_t blocks_per_batch; // factored: ceil(R / kFactorRowBlock)
  const float* row_scale;   // factored: per row, sqrt(row_var / max(mean of the batch's row_var, eps1))
  const float* col_var;     // factored: [B, C], sqrt(col_var)
  float* variance;          // vector: [n]
  float* row_sumsq;         // per task (rows, or vector blocks)
  float* param_sumsq;       // per task
  float* col_part;          // factored reduce: [B * blocks_per_batch, C]
  uint32_t grad_sign;       // 0x80000000 when maximize
  float w;                  // vector: lerp weight float(step ** beta2_decay)
  float w_minus_1;
  bool w_small;             // |w| < 0.5 (ATen's lerp)
  float eps1;               // sqrt(eps1_sq): factored, u = g / max(row_scale * col_var, eps1)
  float eps1_sq;            // float(eps1 * eps1): vector, u = g / sqrt(max(variance, eps1^2))
  float decay;              // float(1 - lr * weight_decay)
  bool decayed;             // weight_decay != 0
  float neg_scale;          // float(-alpha / denom)
};

// Runs `pass` over tasks [begin, end).
using AdafactorKernel = void (*)(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end);

void adafactor_kernel_scalar(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end);
#if SWAPIO_HAVE_X86_KERNELS
void adafactor_kernel_avx2(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end);
void adafactor_kernel_avx512(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end);
#endif

}  // namespace adam
}  // namespace swapio
