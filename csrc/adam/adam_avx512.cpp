// AVX-512 Adam kernel (built with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c; chosen only when
// CPUID and XGETBV say the CPU and the OS support all of them). 16 floats per vector, two vectors per loop
// iteration, the tail with masked loads and stores (no scalar code, so the tail is bit-identical too).
// bf16 conversions are integer bit operations (no AVX512_BF16 instructions are used).
//
// Everything here sits in an anonymous namespace and uses only intrinsics: no inline function or template
// with external linkage is emitted from this file, so none can replace a baseline copy at link time.
#if SWAPIO_HAVE_X86_KERNELS

#if defined(__GNUC__) && !defined(__clang__)
// GCC 12 warns about the deliberately undefined pass-through operand inside _mm512_sqrt_ps, the gathers and friends
// (GCC bug 105593, fixed in GCC 13): a false positive.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

#include <float.h>
#include <immintrin.h>
#include <stdint.h>

#include "adam/adam_kernel.h"
#include "adam/adam_variants.h"
#include "adam/adafactor_loops.h"
#include "adam/lowp_loops.h"
#include "adam/quant_search.h"

namespace swapio {
namespace adam {
namespace {

// Keeps the compiler from contracting the multiply that produced `x` with a later add (GCC contracts
// intrinsics too, since they are plain vector arithmetic to it): torch rounds there.
#define SWAPIO_ROUNDED(x) __asm__("" : "+v"(x))

struct Vc {
  __m512 decay, wd, w, w_minus_1, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
  __m512i grad_sign;
  __mmask16 w_small;  // all lanes or none
};

inline Vc make_vc(const AdamConsts& c) {
  Vc v;
  v.decay = _mm512_set1_ps(c.decay);
  v.wd = _mm512_set1_ps(c.wd);
  v.w = _mm512_set1_ps(c.w_small ? c.w : c.w_minus_1);
  v.w_minus_1 = _mm512_set1_ps(c.w_minus_1);
  v.beta2 = _mm512_set1_ps(c.beta2);
  v.one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  v.bc2_sqrt = _mm512_set1_ps(c.bc2_sqrt);
  v.eps = _mm512_set1_ps(c.eps);
  v.neg_step_size = _mm512_set1_ps(c.neg_step_size);
  v.grad_sign = _mm512_set1_epi32(static_cast<int>(c.grad_sign));
  v.w_small = c.w_small ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>(0);
  return v;
}

template <bool M>
inline __m512 load_f32(const float* p, __mmask16 k) {
  if constexpr (M) return _mm512_maskz_loadu_ps(k, p);
  else return _mm512_loadu_ps(p);
}

template <bool M>
inline void store_f32(float* p, __m512 x, __mmask16 k) {
  if constexpr (M) _mm512_mask_storeu_ps(p, k, x);
  else _mm512_storeu_ps(p, x);
}

template <bool M>
inline __m256i load_u16(const uint16_t* p, __mmask16 k) {
  if constexpr (M) return _mm256_maskz_loadu_epi16(k, p);
  else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

template <bool M>
inline void store_u16(uint16_t* p, __m256i x, __mmask16 k) {
  if constexpr (M) _mm256_mask_storeu_epi16(p, k, x);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x);
}

template <DType G, bool M>
inline __m512 load_grad(const void* grad, int64_t i, __mmask16 k) {
  if constexpr (G == DType::kF32) {
    return load_f32<M>(static_cast<const float*>(grad) + i, k);
  } else {
    __m256i h = load_u16<M>(static_cast<const uint16_t*>(grad) + i, k);
    if constexpr (G == DType::kBF16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(h);
    }
  }
}

// Round to nearest even; NaN -> 0xFFFF (as ATen's x86 conversion does).
inline __m256i f32_to_bf16(__m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  __mmask16 ordered = _mm512_cmp_ps_mask(x, x, _CMP_ORD_Q);
  r = _mm512_mask_blend_epi32(ordered, _mm512_set1_epi32(0xFFFF), r);
  return _mm512_cvtepi32_epi16(r);
}

template <DType O, bool M>
inline void store_out(void* out, int64_t i, __m512 p, __mmask16 k) {
  if constexpr (O == DType::kF32) {
    store_f32<M>(static_cast<float*>(out) + i, p, k);
  } else if constexpr (O == DType::kBF16) {
    store_u16<M>(static_cast<uint16_t*>(out) + i, f32_to_bf16(p), k);
  } else if constexpr (O == DType::kF16) {
    store_u16<M>(static_cast<uint16_t*>(out) + i,
                 _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), k);
  }
}

// torch.maximum: max, with all bits set where either operand is NaN (ATen's vector maximum).
inline __m512 maximum(__m512 a, __m512 b) {
  __m512 mx = _mm512_max_ps(a, b);
  __mmask16 unord = _mm512_cmp_ps_mask(a, b, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_blend_epi32(unord, _mm512_castps_si512(mx), _mm512_set1_epi32(-1)));
}

// One vector of 16 elements starting at i (M: only the lanes in k). The order of operations is torch's
// _single_tensor_adam on CPU; see adam.h.
template <DType G, DType O, bool L2, bool AMS, bool M>
inline void step16(const AdamArgs& a, const Vc& c, int64_t i, __mmask16 k = 0xFFFF) {
  __m512 p = load_f32<M>(a.param + i, k);
  __m512 g = load_grad<G, M>(a.grad, i, k);
  g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), c.grad_sign));  // maximize: -grad
  if constexpr (L2) {
    g = _mm512_fmadd_ps(p, c.wd, g);  // grad.add(param, alpha=wd)
  } else {
    p = _mm512_mul_ps(p, c.decay);  // param.mul_(1 - lr*wd)
    SWAPIO_ROUNDED(p);
  }
  __m512 m = load_f32<M>(a.exp_avg + i, k);
  __m512 d = _mm512_sub_ps(g, m);  // exp_avg.lerp_(grad, 1 - beta1)
  m = _mm512_fmadd_ps(c.w, d, _mm512_mask_blend_ps(c.w_small, g, m));
  __m512 v = load_f32<M>(a.exp_avg_sq + i, k);
  __m512 vb = _mm512_mul_ps(v, c.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1-beta2)
  SWAPIO_ROUNDED(vb);
  __m512 gs = _mm512_mul_ps(c.one_minus_beta2, g);
  SWAPIO_ROUNDED(gs);
  v = _mm512_fmadd_ps(gs, g, vb);
  __m512 vv = v;
  if constexpr (AMS) {
    vv = maximum(load_f32<M>(a.max_exp_avg_sq + i, k), v);
    store_f32<M>(a.max_exp_avg_sq + i, vv, k);
  }
  __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vv), c.bc2_sqrt), c.eps);
  __m512 num = _mm512_mul_ps(c.neg_step_size, m);
  SWAPIO_ROUNDED(num);
  p = _mm512_add_ps(p, _mm512_div_ps(num, denom));  // param.addcdiv_(exp_avg, denom, value=-step_size)
  store_f32<M>(a.param + i, p, k);
  store_f32<M>(a.exp_avg + i, m, k);
  store_f32<M>(a.exp_avg_sq + i, v, k);
  store_out<O, M>(a.param_out, i, p, k);
}

template <DType G, DType O, bool L2, bool AMS>
void run(const AdamArgs& a, int64_t begin, int64_t end) {
  const Vc c = make_vc(a.c);
  int64_t i = begin;
  for (; i + 32 <= end; i += 32) {
    step16<G, O, L2, AMS, false>(a, c, i);
    step16<G, O, L2, AMS, false>(a, c, i + 16);
  }
  for (; i + 16 <= end; i += 16) step16<G, O, L2, AMS, false>(a, c, i);
  if (i < end) {
    __mmask16 k = static_cast<__mmask16>((1u << (end - i)) - 1u);
    step16<G, O, L2, AMS, true>(a, c, i, k);
  }
}

struct Kernel {
  template <DType G, DType O, bool L2, bool AMS>
  static void run(const AdamArgs& a, int64_t begin, int64_t end) { adam::run<G, O, L2, AMS>(a, begin, end); }
};

// 16 lanes of lowp_loops.h.
struct V {
  using F = __m512;
  using U = __m512i;
  static constexpr int W = 16;
  static SWAPIO_INLINE F set1(float x) { return _mm512_set1_ps(x); }
  static SWAPIO_INLINE F load(const float* p) { return _mm512_loadu_ps(p); }
  static SWAPIO_INLINE void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  template <DType G>
  static SWAPIO_INLINE F load_grad(const void* g) { return adam::load_grad<G, false>(g, 0, 0); }
  template <DType O>
  static SWAPIO_INLINE void store_out(void* out, F p) { adam::store_out<O, false>(out, 0, p, 0); }
  static SWAPIO_INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static SWAPIO_INLINE F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static SWAPIO_INLINE F mul(F a, F b) {
    F r = _mm512_mul_ps(a, b);
    SWAPIO_ROUNDED(r);
    return r;
  }
  static SWAPIO_INLINE F div(F a, F b) { return _mm512_div_ps(a, b); }
  static SWAPIO_INLINE F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static SWAPIO_INLINE F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static SWAPIO_INLINE F clamp_min(F x, F lo) { return _mm512_max_ps(lo, x); }  // NaN x stays
  static SWAPIO_INLINE F flip(F x, uint32_t sign) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(sign))));
  }
  // +-1.0 with x's sign bit where x is nonzero and not NaN, +0 elsewhere: (x & sign) | 1.0 under a mask
  static SWAPIO_INLINE F sign(F x) {
    const __mmask16 nonzero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    const __m512i one = _mm512_set1_epi32(0x3F800000), sign_bit = _mm512_set1_epi32(INT32_MIN);
    return _mm512_castsi512_ps(_mm512_maskz_ternarylogic_epi32(nonzero, _mm512_castps_si512(x), one, sign_bit, 0xEC));
  }
  static SWAPIO_INLINE F load_bf16(const uint16_t* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static SWAPIO_INLINE void store_bf16_sr(uint16_t* p, F x, U r) {
    __m512i s = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    s = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0xFFFF), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(s));
  }
  static SWAPIO_INLINE U mix(U x) {  // fmix32
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
    x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
    x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0xC2B2AE35u)));
    return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  }
  static SWAPIO_INLINE U hash(uint32_t key, uint32_t index) {
    const U lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    U idx = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(index)), lanes);
    return mix(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(key)),
                                _mm512_mullo_epi32(idx, _mm512_set1_epi32(static_cast<int>(0x9E3779B9u)))));
  }
  static SWAPIO_INLINE U lo16(U r) { return _mm512_and_si512(r, _mm512_set1_epi32(0xFFFF)); }
  static SWAPIO_INLINE U hi16(U r) { return _mm512_srli_epi32(r, 16); }
  // code value * scale, by arithmetic (quant.h): the magnitude is one FMA on the rank, with the line of the rank's
  // binade (two vpermps on its exponent field's low 4 bits). The signed map is symmetric: rank = |code - zero|,
  // the sign bit of code - zero becomes the value's, and the zero code (whose rank 0 has no binade) gives +0.
  template <bool kSigned>
  static SWAPIO_INLINE F decode(const uint8_t* code, const QuantMap& q, F scale) {
    const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(code)));
    const __m512i s = kSigned ? _mm512_sub_epi32(idx, _mm512_set1_epi32(q.zero)) : idx;
    const F rank = _mm512_cvtepi32_ps(kSigned ? _mm512_abs_epi32(s) : _mm512_add_epi32(idx, _mm512_set1_epi32(1)));
    const __m512i slot = _mm512_srli_epi32(_mm512_castps_si512(rank), 23);
    const F mag = _mm512_fmadd_ps(rank, _mm512_permutexvar_ps(slot, _mm512_load_ps(q.rank_scale)),
                                  _mm512_permutexvar_ps(slot, _mm512_load_ps(q.rank_offset)));
    if constexpr (kSigned) {
      const __m512i v = _mm512_maskz_ternarylogic_epi32(_mm512_test_epi32_mask(s, s), _mm512_castps_si512(mag), s,
                                                        _mm512_set1_epi32(INT32_MIN), 0x78);  // mag ^ (s & sign)
      return mul(_mm512_castsi512_ps(v), scale);
    } else {
      return mul(mag, scale);
    }
  }
  // 1 where y > mid, else 0, for y in [0, 1] and mid > 0 (+inf included): non-negative floats order like their
  // bits as integers, so the sign of mid - y as integers says it (integer ops only, no mask register between).
  static SWAPIO_INLINE __m512i above(F y, F mid) {
    return _mm512_srli_epi32(_mm512_sub_epi32(_mm512_castps_si512(mid), _mm512_castps_si512(y)), 31);
  }
  // quant.h's arithmetic search of the code of +y, y in [0, 1] (quant_search.h's quick_code, lane by lane);
  // `deferred`: the lanes whose rounded P is a multiple of kPosUnit, where the bucket lookup must decide instead.
  static SWAPIO_INLINE __m512i quick_code(F y, const QuantMap& q, __mmask16& deferred) {
    const __m512i bits = _mm512_castps_si512(y);
    // the binade index, 0 below the tables: y >= 0, so the exponent field fits the low 16 bits of each lane and an
    // unsigned saturating 16-bit subtraction clamps it (the high 16 bits are 0 - 0)
    const __m512i b = _mm512_subs_epu16(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(kRegionExpBase));
    const __m512i below = _mm512_permutex2var_epi32(_mm512_load_si512(q.region_below), b,
                                                    _mm512_load_si512(q.region_below + 16));
    const F mid = _mm512_permutex2var_ps(_mm512_load_ps(q.region_mid), b, _mm512_load_ps(q.region_mid + 16));
    const __m512i r = _mm512_add_epi32(below, above(y, mid));
    const F pos = _mm512_fmsub_ps(y, _mm512_permutexvar_ps(r, _mm512_load_ps(q.pos_scale)),
                                  _mm512_permutexvar_ps(r, _mm512_load_ps(q.pos_offset)));
    const __m512i u = _mm512_cvt_roundps_epi32(pos, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    deferred = _mm512_testn_epi32_mask(u, _mm512_set1_epi32(kPosUnit - 1));
    return _mm512_min_epi32(_mm512_srli_epi32(u, kPosBits),
                            _mm512_permutexvar_epi32(r, _mm512_load_si512(q.region_code_max)));
  }
  // The lanes in `lanes` of c, from the bucket lookup (rare: one rounded P in kPosUnit; out of line).
  static __attribute__((noinline, cold)) __m512i exact_lanes(F y, __m512i c, __mmask16 lanes, const QuantMap& q) {
    alignas(64) float ys[16];
    alignas(64) int32_t cs[16];
    _mm512_store_ps(ys, y);
    _mm512_store_si512(cs, c);
    for (int i = 0; i < 16; ++i) {
      if (lanes >> i & 1) cs[i] = q.zero + exact_k(q, ys[i] < 1.0f ? ys[i] : 1.0f);  // y < 2 is not clamped
    }
    return _mm512_load_si512(cs);
  }
  // |x| * inv (x is finite: lowp_loops.h). Not clamped to 1 as in the scalar level: |x| is at most the block's
  // absmax A, so y <= A * float(1 / A) < 2, and a y in [1, 2) lies in the binade of region 8 (code max_k), as 1 does.
  static SWAPIO_INLINE F unit(F x, F inv) { return _mm512_mul_ps(_mm512_abs_ps(x), inv); }
  // c: the code of +|x| (zero + k); a negative x takes zero - min(k, max_neg_k) = 2 zero - min(c, zero + max_neg_k)
  static SWAPIO_INLINE void store_codes(uint8_t* out, F x, __m512i c, const QuantMap& q) {
    if (q.is_signed) {
      // the sign bit (vpmovd2m, off the shuffle port): -0 and a negative NaN have k = 0, where both codes agree
      const __mmask16 neg = _mm512_movepi32_mask(_mm512_castps_si512(x));
      const __m512i cn = _mm512_min_epi32(c, _mm512_set1_epi32(q.zero + q.max_neg_k));
      c = _mm512_mask_sub_epi32(c, neg, _mm512_set1_epi32(2 * q.zero), cn);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(c));
  }
  // Two vectors at once (two moments of the same elements, or the same moment of adjacent elements).
  template <bool kSigned0, bool kSigned1>
  static SWAPIO_INLINE void encode2(uint8_t* out0, F x0, F inv0, const QuantMap& q0, uint8_t* out1, F x1, F inv1,
                                    const QuantMap& q1) {
    const F y0 = unit(x0, inv0), y1 = unit(x1, inv1);
    __mmask16 defer0, defer1;
    __m512i c0 = quick_code(y0, q0, defer0), c1 = quick_code(y1, q1, defer1);
    if (__builtin_expect(defer0 | defer1, 0)) {
      c0 = exact_lanes(y0, c0, defer0, q0);
      c1 = exact_lanes(y1, c1, defer1, q1);
    }
    store_codes(out0, x0, c0, q0);
    store_codes(out1, x1, c1, q1);
  }
  template <bool kSigned>
  static SWAPIO_INLINE void encode(uint8_t* out, F x, F inv, const QuantMap& q) {
    alignas(16) uint8_t unused[16];
    encode2<kSigned, kSigned>(out, x, inv, q, unused, _mm512_setzero_ps(), inv, q);
  }
  // QNaN, SNaN, +inf and -inf for vfpclassps
  static constexpr int kNonFinite = 0x01 | 0x80 | 0x08 | 0x10;
  // vrangeps 0x0B: the larger magnitude with its sign cleared, max(acc, |x|) as acc >= 0
  static SWAPIO_INLINE F max_abs(F acc, F x) { return _mm512_range_ps(acc, x, 0x0B); }
  static SWAPIO_INLINE F max_pos(F acc, F x) { return _mm512_max_ps(acc, x); }
  static SWAPIO_INLINE float hmax(F a) { return _mm512_reduce_max_ps(a); }
  static SWAPIO_INLINE U drop_nonfinite(U n, F& m, F& v) {
    const __mmask16 bad = _mm512_fpclass_ps_mask(m, kNonFinite) | _mm512_fpclass_ps_mask(v, kNonFinite);
    m = _mm512_maskz_mov_ps(static_cast<__mmask16>(~bad), m);
    v = _mm512_maskz_mov_ps(static_cast<__mmask16>(~bad), v);
    return _mm512_mask_sub_epi32(n, bad, n, _mm512_set1_epi32(-1));
  }
  static SWAPIO_INLINE int64_t count_sum(U n) { return _mm512_reduce_add_epi32(n); }  // a block's: at most 256
};

#undef SWAPIO_ROUNDED

}  // namespace

void adam_kernel_avx512(const AdamArgs& a, int64_t begin, int64_t end) {
  run_variant<Kernel>(a, begin, end);
}

int64_t lowp_kernel_avx512(const LowpArgs& a, int64_t begin, int64_t end) {
  return lowp::run_lowp<V>(a, begin, end);
}

void adafactor_kernel_avx512(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end) {
  afactor::run<V>(a, pass, begin, end);
}

}  // namespace adam
}  // namespace swapio

#endif  // SWAPIO_HAVE_X86_KERNELS
