// Entry points of the low-precision-state Adam and of Lion (adam.h): checks, float scalars, the stochastic
// rounding key, and the tiled run that sums the kernels' non-finite counts.
#include <atomic>
#include <cmath>
#include <string>

#include "adam/adam_host.h"
#include "adam/adam_scalar_ops.h"

namespace swapio {
namespace adam {
namespace {

using scalar_ops::fmix32;

uint32_t sr_key(uint64_t seed, int64_t step) {
  uint32_t k = fmix32(static_cast<uint32_t>(seed));
  k = fmix32(k ^ static_cast<uint32_t>(seed >> 32));
  return fmix32(k ^ static_cast<uint32_t>(step));
}

bool valid_dtype(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

struct Task {
  LowpKernel kernel;
  const LowpArgs* args;
  std::atomic<int64_t> nonfinite{0};
};

void run_tile(const void* ctx, int64_t begin, int64_t end) {
  Task* t = const_cast<Task*>(static_cast<const Task*>(ctx));
  int64_t k = t->kernel(*t->args, begin, end);
  if (k) t->nonfinite.fetch_add(k, std::memory_order_relaxed);
}

// A block's scale is its largest magnitude: one with its sign bit set (a damaged state) is refused before anything
// changes, since the SIMD levels agree with the scalar one only on valid state. Checked here, on the calling
// thread: the same test as a torch reduction in Python ran on torch's OpenMP threads, which then spin-wait
// (GOMP_SPINCOUNT) through the kernel and took a core from it (benchmarks/RESULTS.md).
void check_scales(const char* who, const char* name, const float* scale, int64_t n) {
  const int64_t blocks = (n + kQuantBlock - 1) / kQuantBlock;
  uint32_t signs = 0;
  for (int64_t b = 0; b < blocks; ++b) signs |= scalar_ops::f32_bits(scale[b]);  // (vectorised by the compiler)
  if (signs & 0x80000000u) {
    bad_argument(who, std::string(name) + " holds a negative value: a block's scale is its largest magnitude, never "
                                           "below 0 (a damaged state?)");
  }
}

// The checks and fields common to Adam and Lion; returns the args with everything but the constants set.
LowpArgs common(const char* who, float* param, const void* grad, DType gdt, MomentBuf m, MomentBuf v, bool two,
                int64_t n, void* param_out, DType odt, const StateOptions& o, int64_t step, int threads) {
  if (n < 0) bad_argument(who, "n must be >= 0");
  if (!valid_dtype(gdt)) bad_argument(who, "grad dtype must be float32, bfloat16 or float16");
  if (!(odt == DType::kNone || valid_dtype(odt))) bad_argument(who, "param_out dtype must be float32, bfloat16 or float16");
  if (!(o.state == StateType::kF32 || o.state == StateType::kBF16 || o.state == StateType::kInt8)) {
    bad_argument(who, "unknown state type");
  }
  if (o.index_base < 0) bad_argument(who, "index_base must be >= 0");
  if (threads < 0) bad_argument(who, "threads must be >= 0");
  if (n > 0) {
    if (!param || !grad || !m.data || (two && !v.data)) bad_argument(who, "null buffer");
    if (o.state == StateType::kInt8) {
      if (!m.scale || (two && !v.scale)) bad_argument(who, "int8 state needs scales");
      check_scales(who, "exp_avg_scale", m.scale, n);
      if (two) check_scales(who, "exp_avg_sq_scale", v.scale, n);
    }
    if (odt != DType::kNone && !param_out) bad_argument(who, "null param_out");
  }
  LowpArgs a{};
  a.param = param;
  a.grad = grad;
  a.param_out = odt == DType::kNone ? nullptr : param_out;
  a.grad_dtype = gdt;
  a.out_dtype = odt;
  a.state = o.state;
  a.m = MomentPtr{m.data, m.scale, &signed_map()};
  a.v = MomentPtr{two ? v.data : nullptr, two ? v.scale : nullptr, &unsigned_map()};
  a.sr_key = sr_key(o.seed, step);
  a.index_base = o.index_base;
  return a;
}

int64_t run(const LowpArgs& a, LowpKernel kernel, int64_t n, int threads) {
  if (n == 0) return 0;
  Task t;
  t.kernel = kernel;
  t.args = &a;
  run_tiled(n, threads, run_tile, &t, a.state == StateType::kInt8);
  return t.nonfinite.load();
}

}  // namespace

int64_t adam_step_state(float* param, const void* grad, DType grad_dtype, MomentBuf exp_avg, MomentBuf exp_avg_sq,
                        int64_t n, const AdamHyper& h, void* param_out, DType out_dtype, const StateOptions& o,
                        int threads, Capability cap) {
  const char* who = "adam_step";
  check_adam_hyper(h, who);
  if (h.amsgrad) bad_argument(who, "amsgrad needs fp32 state (use adam_step)");
  const LowpKernel kernel = kernels_for(cap, who).lowp;
  LowpArgs a = common(who, param, grad, grad_dtype, exp_avg, exp_avg_sq, true, n, param_out, out_dtype, o, h.step,
                      threads);
  a.algo = Algo::kAdam;
  a.adam = adam_consts(h);
  return run(a, kernel, n, threads);
}

int64_t lion_step(float* param, const void* grad, DType grad_dtype, MomentBuf exp_avg, int64_t n, const LionHyper& h,
                  void* param_out, DType out_dtype, const StateOptions& o, int threads, Capability cap) {
  const char* who = "lion_step";
  if (h.step < 1) bad_argument(who, "step must be >= 1");
  if (!(h.lr >= 0.0) || !std::isfinite(h.lr)) bad_argument(who, "lr must be finite and >= 0");
  if (!(h.beta1 >= 0.0 && h.beta1 <= 1.0)) bad_argument(who, "beta1 must be in [0, 1]");
  if (!(h.beta2 >= 0.0 && h.beta2 <= 1.0)) bad_argument(who, "beta2 must be in [0, 1]");
  if (!(h.weight_decay >= 0.0) || !std::isfinite(h.weight_decay)) bad_argument(who, "weight_decay must be finite and >= 0");
  const LowpKernel kernel = kernels_for(cap, who).lowp;
  LowpArgs a = common(who, param, grad, grad_dtype, exp_avg, MomentBuf{}, false, n, param_out, out_dtype, o, h.step,
                      threads);
  a.algo = Algo::kLion;
  LionConsts& c = a.lion;
  c.decay = h.weight_decay != 0.0 ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.neg_lr = static_cast<float>(-h.lr);
  c.grad_sign = h.maximize ? 0x80000000u : 0u;
  return run(a, kernel, n, threads);
}

}  // namespace adam
}  // namespace swapio
