// AVX2 Adam kernel (built with -mavx2 -mfma -mf16c; chosen only when CPUID and XGETBV say the CPU and the
// OS support all three). 8 floats per vector, two vectors per loop iteration; the tail (< 8 elements) is
// copied into zero-padded stack buffers and run through the same vector code, so it is bit-identical too.
// Same operations in the same order as adam_avx512.cpp.
//
// Everything here sits in an anonymous namespace and uses only intrinsics: no inline function or template
// with external linkage is emitted from this file, so none can replace a baseline copy at link time.
#if SWAPIO_HAVE_X86_KERNELS

#include <immintrin.h>
#include <stdint.h>

#include "adam/adam_kernel.h"
#include "adam/adam_variants.h"

namespace swapio {
namespace adam {
namespace {

#define SWAPIO_ROUNDED(x) __asm__("" : "+x"(x))

struct Vc {
  __m256 decay, wd, w, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size, w_small;
  __m256i grad_sign;
};

inline Vc make_vc(const AdamConsts& c) {
  Vc v;
  v.decay = _mm256_set1_ps(c.decay);
  v.wd = _mm256_set1_ps(c.wd);
  v.w = _mm256_set1_ps(c.w_small ? c.w : c.w_minus_1);
  v.beta2 = _mm256_set1_ps(c.beta2);
  v.one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  v.bc2_sqrt = _mm256_set1_ps(c.bc2_sqrt);
  v.eps = _mm256_set1_ps(c.eps);
  v.neg_step_size = _mm256_set1_ps(c.neg_step_size);
  v.w_small = _mm256_castsi256_ps(_mm256_set1_epi32(c.w_small ? -1 : 0));
  v.grad_sign = _mm256_set1_epi32(static_cast<int>(c.grad_sign));
  return v;
}

// The pointers of one block of 8 elements (into the tensors, or into stack buffers for the tail).
struct Ptrs {
  float* p;
  const void* g;
  float* m;
  float* v;
  float* vmax;
  void* out;
};

template <DType G>
inline __m256 load_grad(const void* g) {
  if constexpr (G == DType::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(g));
  } else {
    __m128i h = _mm_loadu_si128(static_cast<const __m128i*>(g));
    if constexpr (G == DType::kBF16) {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(h);
    }
  }
}

// Round to nearest even; NaN -> 0xFFFF (as ATen's x86 conversion does).
inline __m128i f32_to_bf16(__m256 x) {
  __m256i u = _mm256_castps_si256(x);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  __m256i ordered = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q));
  r = _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), r, ordered);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <DType O>
inline void store_out(void* out, __m256 p) {
  if constexpr (O == DType::kF32) {
    _mm256_storeu_ps(static_cast<float*>(out), p);
  } else if constexpr (O == DType::kBF16) {
    _mm_storeu_si128(static_cast<__m128i*>(out), f32_to_bf16(p));
  } else if constexpr (O == DType::kF16) {
    _mm_storeu_si128(static_cast<__m128i*>(out), _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
}

// torch.maximum: max, with all bits set where either operand is NaN (ATen's vector maximum).
inline __m256 maximum(__m256 a, __m256 b) {
  return _mm256_or_ps(_mm256_max_ps(a, b), _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

template <DType G, DType O, bool L2, bool AMS>
inline void step8(const Ptrs& q, const Vc& c) {
  __m256 p = _mm256_loadu_ps(q.p);
  __m256 g = load_grad<G>(q.g);
  g = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(g), c.grad_sign));  // maximize: -grad
  if constexpr (L2) {
    g = _mm256_fmadd_ps(p, c.wd, g);  // grad.add(param, alpha=wd)
  } else {
    p = _mm256_mul_ps(p, c.decay);  // param.mul_(1 - lr*wd)
    SWAPIO_ROUNDED(p);
  }
  __m256 m = _mm256_loadu_ps(q.m);
  __m256 d = _mm256_sub_ps(g, m);  // exp_avg.lerp_(grad, 1 - beta1)
  m = _mm256_fmadd_ps(c.w, d, _mm256_blendv_ps(g, m, c.w_small));
  __m256 vb = _mm256_mul_ps(_mm256_loadu_ps(q.v), c.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1-beta2)
  SWAPIO_ROUNDED(vb);
  __m256 gs = _mm256_mul_ps(c.one_minus_beta2, g);
  SWAPIO_ROUNDED(gs);
  __m256 v = _mm256_fmadd_ps(gs, g, vb);
  __m256 vv = v;
  if constexpr (AMS) {
    vv = maximum(_mm256_loadu_ps(q.vmax), v);
    _mm256_storeu_ps(q.vmax, vv);
  }
  __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vv), c.bc2_sqrt), c.eps);
  __m256 num = _mm256_mul_ps(c.neg_step_size, m);
  SWAPIO_ROUNDED(num);
  p = _mm256_add_ps(p, _mm256_div_ps(num, denom));  // param.addcdiv_(exp_avg, denom, value=-step_size)
  _mm256_storeu_ps(q.p, p);
  _mm256_storeu_ps(q.m, m);
  _mm256_storeu_ps(q.v, v);
  store_out<O>(q.out, p);
}

constexpr int64_t elem_size(DType t) { return t == DType::kF32 ? 4 : (t == DType::kNone ? 0 : 2); }

template <DType G, DType O, bool L2, bool AMS>
void run(const AdamArgs& a, int64_t begin, int64_t end) {
  const Vc c = make_vc(a.c);
  constexpr int64_t gs = elem_size(G), os = elem_size(O);
  const char* gbase = static_cast<const char*>(a.grad);
  char* obase = static_cast<char*>(a.param_out);
  auto at = [&](int64_t i) {
    Ptrs q;
    q.p = a.param + i;
    q.g = gbase + i * gs;
    q.m = a.exp_avg + i;
    q.v = a.exp_avg_sq + i;
    q.vmax = AMS ? a.max_exp_avg_sq + i : nullptr;
    q.out = os ? obase + i * os : nullptr;
    return q;
  };
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    step8<G, O, L2, AMS>(at(i), c);
    step8<G, O, L2, AMS>(at(i + 8), c);
  }
  for (; i + 8 <= end; i += 8) step8<G, O, L2, AMS>(at(i), c);
  if (i < end) {
    const int64_t r = end - i;
    alignas(32) float p[8] = {0}, m[8] = {0}, v[8] = {0}, vmax[8] = {0}, out[8] = {0};
    alignas(32) float g[8] = {0};
    const Ptrs src = at(i);
    __builtin_memcpy(p, src.p, r * 4);
    __builtin_memcpy(g, src.g, r * gs);
    __builtin_memcpy(m, src.m, r * 4);
    __builtin_memcpy(v, src.v, r * 4);
    if (AMS) __builtin_memcpy(vmax, src.vmax, r * 4);
    Ptrs q{p, g, m, v, vmax, out};
    step8<G, O, L2, AMS>(q, c);
    __builtin_memcpy(src.p, p, r * 4);
    __builtin_memcpy(src.m, m, r * 4);
    __builtin_memcpy(src.v, v, r * 4);
    if (AMS) __builtin_memcpy(src.vmax, vmax, r * 4);
    if (os) __builtin_memcpy(src.out, out, r * os);
  }
}

struct Kernel {
  template <DType G, DType O, bool L2, bool AMS>
  static void run(const AdamArgs& a, int64_t begin, int64_t end) { adam::run<G, O, L2, AMS>(a, begin, end); }
};

#undef SWAPIO_ROUNDED

}  // namespace

void adam_kernel_avx2(const AdamArgs& a, int64_t begin, int64_t end) {
  run_variant<Kernel>(a, begin, end);
}

}  // namespace adam
}  // namespace swapio

#endif  // SWAPIO_HAVE_X86_KERNELS
