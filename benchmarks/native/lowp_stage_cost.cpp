// The low-precision-state kernel of one SIMD level on cache-resident buffers, one thread, thread CPU time:
// ns per element of int8 Adam or Lion (best of 25). Built and run by benchmarks/lowp_stage_cost.sh, which also
// builds variants of the kernel with a stage taken out, to see what each stage costs.
// Usage: lowp_stage_cost [elements=16384] [avx2|avx512|scalar] [adam|lion]
#include <chrono>
#include <time.h>
static double cpu_now(){timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <random>
#include <algorithm>
#include "adam/adam_kernel.h"
#include "adam/quant.h"
using namespace swapio::adam;
int main(int argc, char** argv) {
  const int64_t n = argc > 1 ? atoll(argv[1]) : 16384;
  const char* which = argc > 2 ? argv[2] : "avx2";
  const char* algo = argc > 3 ? argv[3] : "adam";
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> p(n), g(n), ms((n + kQuantBlock - 1) / kQuantBlock), vs(ms.size());
  std::vector<uint8_t> m(n), v(n);
  for (auto& x : p) x = nd(rng);
  for (auto& x : g) x = nd(rng) * 1e-2f;
  const QuantMap& sm = signed_map(); const QuantMap& um = unsigned_map();
  for (int64_t i = 0; i < n; ++i) { m[i] = 100 + rng() % 50; v[i] = 50 + rng() % 150; }
  for (auto& s : ms) s = 1e-3f;
  for (auto& s : vs) s = 1e-5f;
  LowpArgs a{};
  a.param = p.data(); a.grad = g.data(); a.param_out = nullptr; a.grad_dtype = DType::kF32; a.out_dtype = DType::kNone;
  a.algo = strcmp(algo, "lion") == 0 ? Algo::kLion : Algo::kAdam; a.state = StateType::kInt8;
  a.m = {m.data(), ms.data(), &sm}; a.v = {v.data(), vs.data(), &um};
  a.adam.decay = 1 - 1e-5f; a.adam.w = 0.1f; a.adam.w_minus_1 = -0.9f; a.adam.beta2 = 0.999f; a.adam.one_minus_beta2 = 0.001f;
  a.adam.bc2_sqrt = 0.5f; a.adam.eps = 1e-8f; a.adam.neg_step_size = -1e-3f; a.adam.w_small = true;
  a.lion.decay = 1; a.lion.beta1 = 0.9f; a.lion.one_minus_beta1 = 0.1f; a.lion.beta2 = 0.99f; a.lion.one_minus_beta2 = 0.01f; a.lion.neg_lr = -1e-4f;
  auto k = strcmp(which, "avx512") == 0 ? lowp_kernel_avx512 : (strcmp(which, "scalar") == 0 ? lowp_kernel_scalar : lowp_kernel_avx2);
  double best = 1e9;
  for (int r = 0; r < 25; ++r) {
    int reps = std::max<int64_t>(1, 20000000 / n);
    double t0 = cpu_now();
    for (int i = 0; i < reps; ++i) k(a, 0, n);
    double dt = (cpu_now() - t0) / reps / n * 1e9;
    best = std::min(best, dt);
  }
  printf("%s %s n=%lld: %.3f ns/elem  %.2f Gp/s\n", which, algo, (long long)n, best, 1 / best);
}
