// Adafactor entry point: checks, the host scalars and factors between the passes, and the tiled parallel runs
// of the per-ISA passes (adafactor_loops.h). Baseline code.
#include "adam/adafactor.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <vector>

#include "adam/adam_host.h"

namespace swapio {
namespace adam {
namespace {

// Elements of work per tile, and below how many the step stays on the calling thread (as adam.cpp).
constexpr int64_t kTileElems = 32 * 1024;
constexpr int64_t kMinParallel = 4 * kTileElems;

struct Run {
  AdafactorKernel kernel;
  const AdafactorArgs* args;
  AdafactorPass pass;
};

void run_tile(const void* ctx, int64_t begin, int64_t end) {
  const Run* r = static_cast<const Run*>(ctx);
  r->kernel(*r->args, r->pass, begin, end);
}

// Runs `pass` over `tasks` tasks of about `per_task` elements each.
void run_pass(AdafactorKernel kernel, const AdafactorArgs& a, AdafactorPass pass, int64_t tasks, int64_t per_task,
              int threads) {
  Run r{kernel, &a, pass};
  if (a.n < kMinParallel || threads <= 1 || tasks < 2) {
    run_tile(&r, 0, tasks);
    return;
  }
  parallel_for(tasks, std::max<int64_t>(1, kTileElems / std::max<int64_t>(1, per_task)), threads, run_tile, &r);
}

// ATen's lerp with a scalar weight (as the kernels' lerp): start + w*(end-start), or end + (w-1)*(end-start)
float lerp(float start, float end, float w, float w_minus_1, bool w_small) {
  const float d = end - start;
  return w_small ? std::fma(w, d, start) : std::fma(w_minus_1, d, end);
}

double sum(const std::vector<float>& v) {
  double s = 0.0;
  for (float x : v) s += x;
  return s;
}

bool valid_dtype(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

void adafactor_step(float* param, const void* grad, DType grad_dtype, float* row_var, float* col_var,
                    float* variance, int64_t n, bool factored, int64_t batches, int64_t rows, int64_t cols,
                    const AdafactorHyper& h, void* param_out, DType out_dtype, int threads, Capability cap) {
  const char* who = "adafactor_step";
  if (n < 0) bad_argument(who, "n must be >= 0");
  if (!valid_dtype(grad_dtype)) bad_argument(who, "grad dtype must be float32, bfloat16 or float16");
  if (!(out_dtype == DType::kNone || valid_dtype(out_dtype))) {
    bad_argument(who, "param_out dtype must be float32, bfloat16 or float16");
  }
  if (h.step < 1) bad_argument(who, "step must be >= 1");
  if (!(h.lr >= 0.0) || !(h.beta2_decay <= 0.0) || !(h.eps1 >= 0.0) || !(h.eps2 >= 0.0) || !(h.d >= 1.0) ||
      !(h.weight_decay >= 0.0)) {
    bad_argument(who, "needs lr >= 0, beta2_decay <= 0, eps1 >= 0, eps2 >= 0, d >= 1, weight_decay >= 0");
  }
  if (threads < 0) bad_argument(who, "threads must be >= 0");
  if (factored && (batches < 1 || rows < 1 || cols < 1 || batches * rows * cols != n)) {
    bad_argument(who, "a factored parameter needs batches * rows * cols == n, each >= 1");
  }
  const AdafactorKernel kernel = kernels_for(cap, who).adafactor;
  if (n == 0) return;
  if (!param || !grad || (factored ? (!row_var || !col_var) : !variance)) bad_argument(who, "null buffer");
  if (out_dtype != DType::kNone && !param_out) bad_argument(who, "null param_out");
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

  // torch's Python scalars, in double
  const double t = static_cast<double>(h.step);
  const double one_minus_beta2 = std::pow(t, h.beta2_decay);
  const double rho = std::min(h.lr, 1.0 / std::pow(t, 0.5));
  const double sqrt_n = std::pow(static_cast<double>(n), 0.5);

  AdafactorArgs a{};
  a.param = param;
  a.grad = grad;
  a.grad_dtype = grad_dtype;
  a.param_out = out_dtype == DType::kNone ? nullptr : param_out;
  a.out_dtype = out_dtype;
  a.n = n;
  a.grad_sign = h.maximize ? 0x80000000u : 0u;
  a.w = static_cast<float>(one_minus_beta2);
  a.w_minus_1 = a.w - 1.0f;
  a.w_small = std::fabs(a.w) < 0.5f;
  a.eps1_sq = static_cast<float>(h.eps1 * h.eps1);
  // torch clamps the factored estimate with float(eps1 * eps1), whose square root is the bound here: where eps1^2
  // underflows float32 (eps1 < ~2.6e-23, transformers' 1e-30) it is 0 and a zero row gives torch's 0 / 0 = NaN,
  // where it overflows inf and the update 0, and a subnormal keeps its few bits, all as in torch
  a.eps1 = static_cast<float>(std::sqrt(static_cast<double>(a.eps1_sq)));
  a.decayed = h.weight_decay != 0.0;
  a.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);

  double param_sq, update_sq;
  AdafactorPass apply;
  int64_t tasks, per_task;
  std::vector<float> row_sq, param_rows;
  if (factored) {
    const int64_t nb = (rows + kFactorRowBlock - 1) / kFactorRowBlock, all_rows = batches * rows;
    std::vector<float> col_part(static_cast<size_t>(batches * nb * cols)), row_scale(all_rows),
        col_sqrt(static_cast<size_t>(batches * cols));
    row_sq.resize(all_rows);
    param_rows.resize(all_rows);
    a.rows_per_batch = rows;
    a.cols = cols;
    a.blocks_per_batch = nb;
    a.row_sumsq = row_sq.data();
    a.param_sumsq = param_rows.data();
    a.col_part = col_part.data();
    run_pass(kernel, a, AdafactorPass::kFactorReduce, batches * nb, kFactorRowBlock * cols, threads);
    param_sq = sum(param_rows);
    // the factors: means of g^2 over the last dimension (rows) and the one before (columns), lerped in
    const float fr = static_cast<float>(rows), fc = static_cast<float>(cols);
    std::vector<float> col_sum(static_cast<size_t>(cols));
    for (int64_t b = 0; b < batches; ++b) {
      // the blocks' column sums added in block order, a block's row of them at a time (sequential reads)
      std::fill(col_sum.begin(), col_sum.end(), 0.0f);
      for (int64_t k = 0; k < nb; ++k) {
        const float* part = col_part.data() + (b * nb + k) * cols;
        for (int64_t j = 0; j < cols; ++j) col_sum[j] += part[j];
      }
      for (int64_t j = 0; j < cols; ++j) {
        float& c = col_var[b * cols + j];
        c = lerp(c, col_sum[j] / fr, a.w, a.w_minus_1, a.w_small);
        col_sqrt[b * cols + j] = std::sqrt(c);
      }
      double mean = 0.0;
      for (int64_t i = b * rows; i < (b + 1) * rows; ++i) {
        row_var[i] = lerp(row_var[i], row_sq[i] / fc, a.w, a.w_minus_1, a.w_small);
        mean += row_var[i];
      }
      const float m = std::max(static_cast<float>(mean / static_cast<double>(rows)), static_cast<float>(h.eps1));
      for (int64_t i = b * rows; i < (b + 1) * rows; ++i) row_scale[i] = std::sqrt(row_var[i] / m);
    }
    a.row_scale = row_scale.data();
    a.col_var = col_sqrt.data();
    run_pass(kernel, a, AdafactorPass::kFactorNorm, all_rows, cols, threads);
    update_sq = sum(row_sq);
    apply = AdafactorPass::kFactorApply;
    tasks = all_rows;
    per_task = cols;
    const double alpha = std::max(h.eps2, std::sqrt(param_sq) / sqrt_n) * rho;
    const double denom = std::max(1.0, std::sqrt(update_sq) / (sqrt_n * h.d));
    a.neg_scale = static_cast<float>(-alpha / denom);
    run_pass(kernel, a, apply, tasks, per_task, threads);
    return;
  }
  tasks = (n + kVectorBlock - 1) / kVectorBlock;
  per_task = kVectorBlock;
  row_sq.resize(tasks);
  param_rows.resize(tasks);
  a.variance = variance;
  a.row_sumsq = row_sq.data();
  a.param_sumsq = param_rows.data();
  run_pass(kernel, a, AdafactorPass::kVectorNorm, tasks, per_task, threads);
  param_sq = sum(param_rows);
  update_sq = sum(row_sq);
  const double alpha = std::max(h.eps2, std::sqrt(param_sq) / sqrt_n) * rho;
  const double denom = std::max(1.0, std::sqrt(update_sq) / (sqrt_n * h.d));
  a.neg_scale = static_cast<float>(-alpha / denom);
  run_pass(kernel, a, AdafactorPass::kVectorApply, tasks, per_task, threads);
}

}  // namespace adam
}  // namespace swapio
