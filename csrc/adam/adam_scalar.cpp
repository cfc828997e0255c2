// Portable scalar Adam kernel: builds anywhere, serves CPUs without AVX2 and SWAPIO_CPU_CAPABILITY=scalar.
// The operations and their order are those of the SIMD kernels (see adam_avx512.cpp), so the results are
// bit-identical: true fused multiply-adds (std::fma) where ATen fuses, correctly rounded sqrt and division.
#include <cfloat>
#include <cmath>
#include <cstdint>

#include "adam/adam_kernel.h"
#include "adam/adam_variants.h"
#include "adam/adam_scalar_ops.h"
#include "adam/adafactor_loops.h"
#include "adam/lowp_loops.h"
#include "adam/quant_search.h"

namespace swapio {
namespace adam {
namespace {

using namespace scalar_ops;

template <DType G>
inline float load_grad(const void* grad, int64_t i) {
  if constexpr (G == DType::kF32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == DType::kBF16) {
    return bf16_to_f32(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(grad)[i]);
  }
}

template <DType O>
inline void store_out(void* out, int64_t i, float p) {
  if constexpr (O == DType::kF32) {
    static_cast<float*>(out)[i] = p;
  } else if constexpr (O == DType::kBF16) {
    static_cast<uint16_t*>(out)[i] = f32_to_bf16(p);
  } else if constexpr (O == DType::kF16) {
    static_cast<uint16_t*>(out)[i] = f32_to_f16(p);
  }
}

// torch.maximum on CPU: the larger value (the second operand when equal or unordered), and NaN (all bits
// set, as ATen's vector code makes it) when either operand is NaN.
inline float maximum(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) return f32_from_bits(0xFFFFFFFFu);
  return a > b ? a : b;
}

template <DType G, DType O, bool L2, bool AMS>
void run(const AdamArgs& a, int64_t begin, int64_t end) {
  const AdamConsts c = a.c;
  float* __restrict param = a.param;
  float* __restrict exp_avg = a.exp_avg;
  float* __restrict exp_avg_sq = a.exp_avg_sq;
  float* __restrict vmax = a.max_exp_avg_sq;
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float g = f32_from_bits(f32_bits(load_grad<G>(a.grad, i)) ^ c.grad_sign);
    if constexpr (L2) {
      g = std::fma(p, c.wd, g);  // grad.add(param, alpha=wd)
    } else {
      p = rounded(p * c.decay);  // param.mul_(1 - lr*wd)
    }
    float m = exp_avg[i];
    float d = g - m;  // exp_avg.lerp_(grad, 1 - beta1)
    m = c.w_small ? std::fma(c.w, d, m) : std::fma(c.w_minus_1, d, g);
    // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    float v = std::fma(rounded(c.one_minus_beta2 * g), g, rounded(exp_avg_sq[i] * c.beta2));
    float vv = v;
    if constexpr (AMS) {
      vv = maximum(vmax[i], v);
      vmax[i] = vv;
    }
    float denom = std::sqrt(vv) / c.bc2_sqrt + c.eps;
    p = p + rounded(c.neg_step_size * m) / denom;  // param.addcdiv_(exp_avg, denom, value=-step_size)
    param[i] = p;
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    store_out<O>(a.param_out, i, p);
  }
}

struct Kernel {
  template <DType G, DType O, bool L2, bool AMS>
  static void run(const AdamArgs& a, int64_t begin, int64_t end) { adam::run<G, O, L2, AMS>(a, begin, end); }
};

// One lane of lowp_loops.h: the same operations as the vector levels, one element at a time.
struct V {
  using F = float;
  using U = uint32_t;
  static constexpr int W = 1;
  static SWAPIO_INLINE F set1(float x) { return x; }
  static SWAPIO_INLINE F load(const float* p) { return *p; }
  static SWAPIO_INLINE void store(float* p, F x) { *p = x; }
  template <DType G>
  static SWAPIO_INLINE F load_grad(const void* g) { return adam::load_grad<G>(g, 0); }
  template <DType O>
  static SWAPIO_INLINE void store_out(void* out, F p) { adam::store_out<O>(out, 0, p); }
  static SWAPIO_INLINE F add(F a, F b) { return a + b; }
  static SWAPIO_INLINE F sub(F a, F b) { return a - b; }
  static SWAPIO_INLINE F mul(F a, F b) { return rounded(a * b); }
  static SWAPIO_INLINE F div(F a, F b) { return a / b; }
  static SWAPIO_INLINE F sqrt(F a) { return std::sqrt(a); }
  static SWAPIO_INLINE F fma(F a, F b, F c) { return std::fma(a, b, c); }
  static SWAPIO_INLINE F clamp_min(F x, F lo) { return lo > x ? lo : x; }  // maxps(lo, x): NaN x stays
  static SWAPIO_INLINE F flip(F x, uint32_t sign) { return f32_from_bits(f32_bits(x) ^ sign); }
  static SWAPIO_INLINE F sign(F x) { return static_cast<float>(x > 0.0f) - static_cast<float>(x < 0.0f); }
  static SWAPIO_INLINE F load_bf16(const uint16_t* p) { return bf16_to_f32(*p); }
  static SWAPIO_INLINE void store_bf16_sr(uint16_t* p, F x, U r) { *p = f32_to_bf16_sr(x, r); }
  static SWAPIO_INLINE U hash(uint32_t key, uint32_t index) { return sr_bits(key, index); }
  static SWAPIO_INLINE U lo16(U r) { return r & 0xFFFFu; }
  static SWAPIO_INLINE U hi16(U r) { return r >> 16; }
  template <bool kSigned>
  static SWAPIO_INLINE F decode(const uint8_t* code, const QuantMap& q, F scale) {
    return rounded(q.code[*code] * scale);
  }
  template <bool kSigned>
  static SWAPIO_INLINE void encode(uint8_t* out, F x, F inv, const QuantMap& q) {
    const float ax = std::fabs(x);
    float y = ax <= FLT_MAX ? rounded(ax * inv) : 0.0f;  // (x is finite here; kept for any other caller)
    y = y < 1.0f ? y : 1.0f;
    const int k = exact_k(q, y);
    if (q.is_signed && x < 0.0f) *out = static_cast<uint8_t>(q.zero - (k < q.max_neg_k ? k : q.max_neg_k));
    else *out = static_cast<uint8_t>(q.zero + k);
  }
  template <bool kSigned0, bool kSigned1>
  static SWAPIO_INLINE void encode2(uint8_t* out0, F x0, F inv0, const QuantMap& q0, uint8_t* out1, F x1, F inv1,
                                    const QuantMap& q1) {
    encode<kSigned0>(out0, x0, inv0, q0);
    encode<kSigned1>(out1, x1, inv1, q1);
  }
  static SWAPIO_INLINE F max_pos(F acc, F x) { return x > acc ? x : acc; }
  static SWAPIO_INLINE F max_abs(F acc, F x) {
    const float ax = std::fabs(x);
    return ax > acc ? ax : acc;
  }
  static SWAPIO_INLINE float hmax(F a) { return a; }
  static SWAPIO_INLINE U drop_nonfinite(U n, F& m, F& v) {
    if (std::fabs(m) <= FLT_MAX && std::fabs(v) <= FLT_MAX) return n;
    m = v = 0.0f;
    return n + 1;
  }
  static SWAPIO_INLINE int64_t count_sum(U n) { return n; }
};

}  // namespace

void adam_kernel_scalar(const AdamArgs& a, int64_t begin, int64_t end) {
  run_variant<Kernel>(a, begin, end);
}

int64_t lowp_kernel_scalar(const LowpArgs& a, int64_t begin, int64_t end) {
  return lowp::run_lowp<V>(a, begin, end);
}

void adafactor_kernel_scalar(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end) {
  afactor::run<V>(a, pass, begin, end);
}

}  // namespace adam
}  // namespace swapio
