// Adam entry point and run-time dispatch (built for baseline x86-64 / the target's default ISA).
//
// The level is chosen once (first call, thread-safe static) from CPUID and XGETBV, like ATen's
// DispatchStub: AVX-512 needs avx512f/bw/vl/dq + fma + f16c and OS-saved opmask/ZMM state; AVX2 needs
// avx2 + fma + f16c + avx and OS-saved YMM state. SWAPIO_CPU_CAPABILITY forces a lower level; naming one the
// CPU lacks (or an unknown name) falls back to the best available and is reported by
// adam_capability_info() (the Python layer warns).
#include "adam/adam.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>

#include "adam/adam_host.h"

#if SWAPIO_HAVE_X86_KERNELS && defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <cpuid.h>
#include <immintrin.h>  // _xgetbv, only inside a target("xsave") function
#define SWAPIO_X86_CPUID 1
#endif

namespace swapio {
namespace adam {
namespace {

// Elements per tile handed to one thread: 32K elements = 128 KiB per fp32 stream (896 KiB for a
// whole fp32 step), a multiple of 64 so tiles start on cache-line boundaries for every dtype.
constexpr int64_t kTile = 32 * 1024;
// Below this many elements the step runs on the calling thread: waking a worker (tens of microseconds)
// costs more than it saves (measured: 64K elements ran slower on 2 threads than on 1, 128K faster).
constexpr int64_t kMinParallel = 4 * kTile;
static_assert(kTile % kQuantBlock == 0, "tiles must start on int8 block boundaries");

#ifdef SWAPIO_X86_CPUID
__attribute__((target("xsave"))) uint64_t read_xcr0() { return _xgetbv(0); }

Capability detect_best() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(1, 0, &a, &b, &c, &d)) return Capability::kScalar;
  const bool fma = c & (1u << 12), osxsave = c & (1u << 27), avx = c & (1u << 28), f16c = c & (1u << 29);
  if (!(osxsave && avx && fma && f16c)) return Capability::kScalar;
  const uint64_t xcr0 = read_xcr0();
  const bool os_ymm = (xcr0 & 0x6) == 0x6;     // SSE and AVX state
  const bool os_zmm = (xcr0 & 0xE6) == 0xE6;   // + opmask, ZMM_Hi256, Hi16_ZMM
  if (!os_ymm) return Capability::kScalar;
  unsigned max_leaf = __get_cpuid_max(0, nullptr);
  if (max_leaf < 7 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) return Capability::kScalar;
  const bool avx2 = b & (1u << 5);
  const bool avx512f = b & (1u << 16), avx512dq = b & (1u << 17), avx512bw = b & (1u << 30),
             avx512vl = b & (1u << 31);
  if (avx2 && os_zmm && avx512f && avx512dq && avx512bw && avx512vl) return Capability::kAVX512;
  if (avx2) return Capability::kAVX2;
  return Capability::kScalar;
}
#else
Capability detect_best() { return Capability::kScalar; }
#endif

KernelSet kernel_set(Capability c) {
  switch (c) {
#if SWAPIO_HAVE_X86_KERNELS
    case Capability::kAVX512: return {adam_kernel_avx512, lowp_kernel_avx512, adafactor_kernel_avx512};
    case Capability::kAVX2: return {adam_kernel_avx2, lowp_kernel_avx2, adafactor_kernel_avx2};
#endif
    default: return {adam_kernel_scalar, lowp_kernel_scalar, adafactor_kernel_scalar};
  }
}

struct Dispatch {
  CapabilityInfo info;
  KernelSet kernels;
};

const Dispatch& dispatch() {
  static const Dispatch d = [] {
    Dispatch r;
    r.info.best = detect_best();
    for (int c = 0; c <= static_cast<int>(r.info.best); ++c) r.info.supported.push_back(static_cast<Capability>(c));
    const char* env = std::getenv("SWAPIO_CPU_CAPABILITY");
    r.info.requested = env ? env : "";
    r.info.active = r.info.best;
    r.info.request_honored = true;
    Capability want;
    if (!parse_capability(r.info.requested, &want)) {
      r.info.request_honored = false;
    } else if (want != Capability::kAuto) {
      if (static_cast<int>(want) <= static_cast<int>(r.info.best)) r.info.active = want;
      else r.info.request_honored = false;
    }
    r.kernels = kernel_set(r.info.active);
    return r;
  }();
  return d;
}

struct Task {
  AdamKernel kernel;
  const AdamArgs* args;
};

void run_tile(const void* ctx, int64_t begin, int64_t end) {
  const Task* t = static_cast<const Task*>(ctx);
  t->kernel(*t->args, begin, end);
}

[[noreturn]] void bad(const std::string& msg) { bad_argument("adam_step", msg); }

bool valid_in(DType t) { return t == DType::kF32 || t == DType::kBF16 || t == DType::kF16; }

}  // namespace

const char* capability_name(Capability c) {
  switch (c) {
    case Capability::kAVX512: return "avx512";
    case Capability::kAVX2: return "avx2";
    case Capability::kScalar: return "scalar";
    default: return "auto";
  }
}

bool parse_capability(const std::string& s, Capability* out) {
  std::string l;
  for (char ch : s) {
    if (!std::isspace(static_cast<unsigned char>(ch))) l += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  if (l.empty() || l == "auto" || l == "default") *out = Capability::kAuto;
  else if (l == "scalar" || l == "default_scalar" || l == "none") *out = Capability::kScalar;
  else if (l == "avx2") *out = Capability::kAVX2;
  else if (l == "avx512") *out = Capability::kAVX512;
  else return false;
  return true;
}

bool capability_supported(Capability c) {
  if (c == Capability::kAuto || c == Capability::kScalar) return true;
  return static_cast<int>(c) <= static_cast<int>(dispatch().info.best);
}

const char* adam_capability() { return capability_name(dispatch().info.active); }

CapabilityInfo adam_capability_info() { return dispatch().info; }

int adam_pool_workers() { return pool_workers(); }

[[noreturn]] void bad_argument(const char* who, const std::string& msg) {
  throw std::invalid_argument(std::string(who) + ": " + msg);
}

KernelSet kernels_for(Capability cap, const char* who) {
  if (cap == Capability::kAuto) return dispatch().kernels;
  if (static_cast<int>(cap) < 0 || static_cast<int>(cap) > static_cast<int>(Capability::kAVX512)) {
    bad_argument(who, "unknown capability");
  }
  if (!capability_supported(cap)) bad_argument(who, std::string("this CPU does not support ") + capability_name(cap));
  return kernel_set(cap);
}

void check_adam_hyper(const AdamHyper& h, const char* who) {
  if (h.step < 1) bad_argument(who, "step must be >= 1");
  if (!(h.lr >= 0.0) || !std::isfinite(h.lr)) bad_argument(who, "lr must be finite and >= 0");
  if (!(h.eps >= 0.0) || !std::isfinite(h.eps)) bad_argument(who, "eps must be finite and >= 0");
  if (!(h.beta1 >= 0.0 && h.beta1 < 1.0)) bad_argument(who, "beta1 must be in [0, 1)");
  if (!(h.beta2 >= 0.0 && h.beta2 < 1.0)) bad_argument(who, "beta2 must be in [0, 1)");
  if (!(h.weight_decay >= 0.0) || !std::isfinite(h.weight_decay)) {
    bad_argument(who, "weight_decay must be finite and >= 0");
  }
}

AdamConsts adam_consts(const AdamHyper& h) {
  AdamConsts c;
  const double step = static_cast<double>(h.step);
  const double bc1 = 1.0 - std::pow(h.beta1, step);
  const double bc2 = 1.0 - std::pow(h.beta2, step);
  const double step_size = h.lr / bc1;
  const bool decay = h.weight_decay != 0.0;
  c.decay = (decay && h.adamw) ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.l2 = decay && !h.adamw;
  c.wd = static_cast<float>(h.weight_decay);
  c.w = static_cast<float>(1.0 - h.beta1);
  c.w_minus_1 = c.w - 1.0f;
  c.w_small = std::fabs(c.w) < 0.5f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.bc2_sqrt = static_cast<float>(std::pow(bc2, 0.5));
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-step_size);
  c.grad_sign = h.maximize ? 0x80000000u : 0u;
  c.amsgrad = h.amsgrad;
  return c;
}

void run_tiled(int64_t n, int threads, TileFn fn, const void* ctx, bool long_tiles) {
  if (threads == 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (n < kMinParallel || threads <= 1) {
    fn(ctx, 0, n);
    return;
  }
  const int64_t per_thread = n / (4 * static_cast<int64_t>(threads));
  const int64_t tile = long_tiles ? std::clamp<int64_t>(per_thread / kTile * kTile, kTile, 4 * kTile) : kTile;
  parallel_for(n, tile, threads, fn, ctx);
}

void adam_step(float* param, const void* grad, DType grad_dtype, float* exp_avg, float* exp_avg_sq,
               float* max_exp_avg_sq, int64_t n, const AdamHyper& h, void* param_out, DType out_dtype,
               int threads, Capability cap) {
  if (n < 0) bad("n must be >= 0");
  if (!valid_in(grad_dtype)) bad("grad dtype must be float32, bfloat16 or float16");
  if (!(out_dtype == DType::kNone || valid_in(out_dtype))) bad("param_out dtype must be float32, bfloat16 or float16");
  check_adam_hyper(h, "adam_step");
  if (threads < 0) bad("threads must be >= 0");
  const AdamKernel kernel = kernels_for(cap, "adam_step").adam;
  if (n == 0) return;
  if (!param || !grad || !exp_avg || !exp_avg_sq) bad("null buffer");
  if (h.amsgrad && !max_exp_avg_sq) bad("amsgrad needs max_exp_avg_sq");
  if (out_dtype != DType::kNone && !param_out) bad("null param_out");

  AdamArgs a;
  a.param = param;
  a.grad = grad;
  a.exp_avg = exp_avg;
  a.exp_avg_sq = exp_avg_sq;
  a.max_exp_avg_sq = h.amsgrad ? max_exp_avg_sq : nullptr;
  a.param_out = out_dtype == DType::kNone ? nullptr : param_out;
  a.grad_dtype = grad_dtype;
  a.out_dtype = out_dtype;
  a.c = adam_consts(h);
  Task t{kernel, &a};
  run_tiled(n, threads, run_tile, &t);
}

}  // namespace adam
}  // namespace swapio
