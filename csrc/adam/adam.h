#pragma once
// CPU Adam / AdamW step over flat fp32 buffers: the public C++ API of csrc/adam.
//
// One pass per element reads param, grad (fp32, bf16 or fp16, widened in registers), exp_avg, exp_avg_sq
// (and max_exp_avg_sq with amsgrad), writes param, exp_avg, exp_avg_sq and, optionally, a low-precision
// copy of the updated param (param_out, rounded to nearest even like tensor.to(dtype)).
//
// The formula and its float32 operation order follow torch.optim.Adam/AdamW with foreach=False,
// fused=False (torch/optim/adam.py, _single_tensor_adam), including where ATen's CPU kernels fuse a
// multiply-add (lerp, add with alpha, addcmul). The bias corrections and the other scalars are computed in
// double on the host and rounded to float once, as torch does with Python scalars.
//
// Kernels: one translation unit per instruction set (adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp),
// chosen once at run time from CPUID + XGETBV; SWAPIO_CPU_CAPABILITY=scalar|avx2|avx512 forces a level
// (a level the CPU lacks falls back to the best one it has; adam_capability_info() reports it).
// Every level gives bit-identical results (same operations, same order, correctly rounded sqrt and
// division, the same fused multiply-adds).
//
// No torch and no Python here. Errors are std::invalid_argument (the binding raises ValueError).
#include <cstdint>
#include <string>
#include <vector>

#include "adam/adam_types.h"

namespace swapio {
namespace adam {

struct AdamHyper {
  int64_t step = 1;  // the step being taken, counting from 1 (torch's state["step"] after its increment)
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  bool adamw = true;     // true: decoupled decay (param *= 1 - lr*wd); false: L2 (grad += wd*param)
  bool maximize = false;
  bool amsgrad = false;  // needs max_exp_avg_sq
};

// Updates n elements in place. param, exp_avg, exp_avg_sq (and max_exp_avg_sq when h.amsgrad) are fp32;
// grad is grad_dtype (kF32, kBF16 or kF16); param_out is nullptr with out_dtype kNone, or a buffer of n
// out_dtype elements (kF32, kBF16 or kF16). threads: total threads including the caller; 0 = the machine's
// hardware concurrency. Work below a threshold runs on the calling thread only.
// cap: kAuto uses the active level; an explicit level the CPU lacks throws std::invalid_argument.
void adam_step(float* param, const void* grad, DType grad_dtype, float* exp_avg, float* exp_avg_sq,
               float* max_exp_avg_sq, int64_t n, const AdamHyper& h, void* param_out, DType out_dtype,
               int threads, Capability cap = Capability::kAuto);

// ---- smaller optimizer state (bf16 or int8 moments) and Lion -------------------------------------------------
// One fused pass per element: decode the moments, step in fp32 (the same float32 operations as above), encode.
//   bf16: widened exactly, stored with stochastic rounding (round up with probability equal to the dropped
//     fraction, so the expected stored value is the fp32 one and updates smaller than half a bf16 ulp, like
//     exp_avg_sq's (1 - beta2) * (g^2 - v) with beta2 = 0.999, do not vanish). The random bits of element i are
//     a hash of (seed, step, index_base + i): identical at every SIMD level, thread count and chunking, and
//     on resume.
//   int8: block-wise dynamic-tree codes (quant.h); the first moment with the signed map, the second with the
//     unsigned one. A non-finite new moment is stored as 0 and kept out of its block's scale, so one NaN or
//     inf gradient cannot wipe the other 255 elements of its block; the step returns how many there were (the
//     parameter itself takes the NaN/inf update, as with fp32 state).
// The param update uses the new fp32 moments, before they are rounded or quantised.

// data: float*, uint16_t* (bf16 bits) or uint8_t* codes; scale: int8 only, one float per block of kQuantBlock
// elements (ceil(n / kQuantBlock) of them), read then rewritten by the step.
struct MomentBuf {
  void* data = nullptr;
  float* scale = nullptr;
};

struct StateOptions {
  StateType state = StateType::kF32;
  uint64_t seed = 0;       // bf16 stochastic rounding
  int64_t index_base = 0;  // index of element 0 within its tensor, so chunks of one tensor round alike
};

// Adam/AdamW (no amsgrad) with moments stored as o.state. Returns the count of non-finite moments stored as 0.
int64_t adam_step_state(float* param, const void* grad, DType grad_dtype, MomentBuf exp_avg, MomentBuf exp_avg_sq,
                        int64_t n, const AdamHyper& h, void* param_out, DType out_dtype, const StateOptions& o,
                        int threads, Capability cap = Capability::kAuto);

struct LionHyper {
  int64_t step = 1;  // only seeds bf16 rounding (Lion has no bias correction)
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.99;
  double weight_decay = 0.0;  // decoupled: param *= 1 - lr*wd
  bool maximize = false;
};

// Lion with its one moment stored as o.state. Returns the count of non-finite moments stored as 0 (int8).
int64_t lion_step(float* param, const void* grad, DType grad_dtype, MomentBuf exp_avg, int64_t n, const LionHyper& h,
                  void* param_out, DType out_dtype, const StateOptions& o, int threads,
                  Capability cap = Capability::kAuto);

// The active level's name: "avx512", "avx2" or "scalar".
const char* adam_capability();

struct CapabilityInfo {
  Capability active;
  Capability best;               // best level this CPU and OS support
  std::string requested;         // SWAPIO_CPU_CAPABILITY as given ("" when unset)
  bool request_honored;          // false when the request named an unknown or unsupported level
  std::vector<Capability> supported;
};
CapabilityInfo adam_capability_info();

const char* capability_name(Capability c);
// Parses "scalar" / "avx2" / "avx512" (case-insensitive; "" and "auto" give kAuto). Returns false if unknown.
bool parse_capability(const std::string& s, Capability* out);
bool capability_supported(Capability c);

// Worker threads the Adam pool has started so far (for tests and diagnostics).
int adam_pool_workers();

}  // namespace adam
}  // namespace swapio
