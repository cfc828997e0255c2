#pragma once
// Internal interface between the dispatcher (adam.cpp, built for baseline) and the per-ISA kernels.
//
// This header is included by translation units built with different -m flags, so it holds only plain
// declarations and a POD struct: no inline functions or templates that the linker could merge across
// instruction sets (an AVX-512 copy of an inline function chosen for baseline code would be a SIGILL).
#include <cstdint>

#include "adam/adam_types.h"
#include "adam/quant.h"

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

// ---- low-precision state (bf16 / int8 moments) and Lion: one fused pass (decode, step, encode) ----

enum class Algo : int { kAdam = 0, kLion = 1 };

// Scalars of one Lion step (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"):
//   p *= 1 - lr*wd;  p += -lr * sign(beta1*m + (1-beta1)*g);  m = beta2*m + (1-beta2)*g
// in the float32 operation order of the plain-torch reference (swapio.ops.lion_step_reference_).
struct LionConsts {
  float decay;            // float(1 - lr*wd), 1 without decay
  float beta1, one_minus_beta1, beta2, one_minus_beta2;
  float neg_lr;           // float(-lr)
  uint32_t grad_sign;     // 0x80000000 when maximize
};

// One moment's buffer: float*, uint16_t* (bf16 bits) or uint8_t* codes plus one fp32 scale per block of
// kQuantBlock elements, counted from element 0 of the buffers.
struct MomentPtr {
  void* data;
  float* scale;           // kInt8 only
  const QuantMap* map;    // kInt8 only: signed_map() for first moments, unsigned_map() for second moments
};

struct LowpArgs {
  float* param;
  const void* grad;
  void* param_out;        // only written when out_dtype != kNone
  DType grad_dtype;
  DType out_dtype;
  Algo algo;
  StateType state;
  MomentPtr m;            // exp_avg
  MomentPtr v;            // exp_avg_sq (Adam only)
  AdamConsts adam;        // Algo::kAdam (no amsgrad)
  LionConsts lion;        // Algo::kLion
  uint32_t sr_key;        // bf16 stochastic rounding: bits of element i come from hash(sr_key, index_base + i)
  int64_t index_base;
};

// Each kernel updates elements [begin, end) (begin a multiple of kQuantBlock) and returns how many elements
// had a non-finite new moment that the int8 state stored as zero (0 for the other states).
using LowpKernel = int64_t (*)(const LowpArgs& a, int64_t begin, int64_t end);

int64_t lowp_kernel_scalar(const LowpArgs& a, int64_t begin, int64_t end);
#if SWAPIO_HAVE_X86_KERNELS
int64_t lowp_kernel_avx2(const LowpArgs& a, int64_t begin, int64_t end);
int64_t lowp_kernel_avx512(const LowpArgs& a, int64_t begin, int64_t end);
#endif

}  // namespace adam
}  // namespace swapio
