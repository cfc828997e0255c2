#pragma once
// Internal interface between the dispatcher (adam.cpp, built for baseline) and the per-ISA kernels.
//
// This header is included by translation units built with different -m flags, so it holds only plain
// declarations and a POD struct: no inline functions or templates that the linker could merge across
// instruction sets (an AVX-512 copy of an inline function chosen for baseline code would be a SIGILL).
#include <cstdint>

#include "adam/adam_types.h"

namespace swapio {
namespace adam {

// Scalars of one step, already rounded to float the way torch rounds its Python scalars.
struct AdamConsts {
  float decay;          // float(1 - lr*wd) for decoupled decay, else 1
  float wd;             // float(wd) for L2 decay
  float w;              // lerp weight float(1 - beta1)
  float w_minus_1;      // w - 1 (in float), lerp's coefficient when the weight is not small
  float beta2;          // float(beta2)
  float one_minus_beta2;  // float(1 - beta2)
  float bc2_sqrt;       // float((1 - beta2**step) ** 0.5)
  float eps;            // float(eps)
  float neg_step_size;  // float(-(lr / (1 - beta1**step)))
  uint32_t grad_sign;   // 0x80000000 when maximize (flips the grad's sign bit), else 0
  bool w_small;         // |w| < 0.5: lerp = m + w*(g-m), else g + (w-1)*(g-m) (ATen's lerp)
  bool l2;              // L2 weight decay: g = g + wd*p (fused multiply-add, like ATen's add with alpha)
  bool amsgrad;
};

struct AdamArgs {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // only read when c.amsgrad
  void* param_out;        // only written when out_dtype != kNone
  DType grad_dtype;
  DType out_dtype;
  AdamConsts c;
};

// Each kernel updates elements [begin, end) of the buffers in `a`.
using AdamKernel = void (*)(const AdamArgs& a, int64_t begin, int64_t end);

void adam_kernel_scalar(const AdamArgs& a, int64_t begin, int64_t end);
#if SWAPIO_HAVE_X86_KERNELS
void adam_kernel_avx2(const AdamArgs& a, int64_t begin, int64_t end);
void adam_kernel_avx512(const AdamArgs& a, int64_t begin, int64_t end);
#endif

}  // namespace adam
}  // namespace swapio
