// AVX2 Adam kernel (built with -mavx2 -mfma -mf16c; chosen only when CPUID and XGETBV say the CPU and the
// OS support all three). 8 floats per vector, two vectors per loop iteration; the tail (< 8 elements) is
// copied into zero-padded stack buffers and run through the same vector code, so it is bit-identical too.
// Same operations in the same order as adam_avx512.cpp.
//
// Everything here sits in an anonymous namespace and uses only intrinsics: no inline function or template
// with external linkage is emitted from this file, so none can replace a baseline copy at link time.
#if SWAPIO_HAVE_X86_KERNELS

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

// 8 lanes of lowp_loops.h.
struct V {
  using F = __m256;
  using U = __m256i;
  static constexpr int W = 8;
  static SWAPIO_INLINE F set1(float x) { return _mm256_set1_ps(x); }
  static SWAPIO_INLINE F load(const float* p) { return _mm256_loadu_ps(p); }
  static SWAPIO_INLINE void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  template <DType G>
  static SWAPIO_INLINE F load_grad(const void* g) { return adam::load_grad<G>(g); }
  template <DType O>
  static SWAPIO_INLINE void store_out(void* out, F p) { adam::store_out<O>(out, p); }
  static SWAPIO_INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }
  static SWAPIO_INLINE F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static SWAPIO_INLINE F mul(F a, F b) {
    F r = _mm256_mul_ps(a, b);
    SWAPIO_ROUNDED(r);
    return r;
  }
  static SWAPIO_INLINE F div(F a, F b) { return _mm256_div_ps(a, b); }
  static SWAPIO_INLINE F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static SWAPIO_INLINE F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static SWAPIO_INLINE F clamp_min(F x, F lo) { return _mm256_max_ps(lo, x); }  // NaN x stays
  static SWAPIO_INLINE F flip(F x, uint32_t sign) {
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), _mm256_set1_epi32(static_cast<int>(sign))));
  }
  // +-1.0 with x's sign bit where x is nonzero and not NaN, +0 elsewhere
  static SWAPIO_INLINE F sign(F x) {
    const F one = _mm256_set1_ps(1.0f), sign_bit = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
    return _mm256_and_ps(_mm256_or_ps(_mm256_and_ps(x, sign_bit), one),
                         _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_NEQ_OQ));
  }
  static SWAPIO_INLINE F load_bf16(const uint16_t* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static SWAPIO_INLINE void store_bf16_sr(uint16_t* p, F x, U r) {
    __m256i s = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    s = _mm256_blendv_epi8(_mm256_set1_epi32(0xFFFF), s, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_ORD_Q)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                     _mm_packus_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1)));
  }
  static SWAPIO_INLINE U mix(U x) {  // fmix32
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0x85EBCA6Bu)));
    x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 13));
    x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int>(0xC2B2AE35u)));
    return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  }
  static SWAPIO_INLINE U hash(uint32_t key, uint32_t index) {
    const U lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    U idx = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(index)), lanes);
    return mix(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(key)),
                                _mm256_mullo_epi32(idx, _mm256_set1_epi32(static_cast<int>(0x9E3779B9u)))));
  }
  static SWAPIO_INLINE U lo16(U r) { return _mm256_and_si256(r, _mm256_set1_epi32(0xFFFF)); }
  static SWAPIO_INLINE U hi16(U r) { return _mm256_srli_epi32(r, 16); }
  // code value * scale, by arithmetic (quant.h, quant_search.h's decode8): the magnitude is one FMA on the rank,
  // with the line of the rank's binade (two vpermps on its exponent field's low 3 bits). The signed map is
  // symmetric: r = 4 (code - zero) as a float (exact), whose sign bit vpermps ignores; r * B + (C with r's sign) is
  // -(|r| B + C) where r < 0, rounded alike; the zero code's r = +0 has the line through 0.
  template <bool kSigned>
  static SWAPIO_INLINE F decode(const uint8_t* code, const QuantMap& q, F scale) {
    const __m256i idx = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(code)));
    if constexpr (kSigned) {
      const F r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idx), _mm256_set1_ps(4.0f), _mm256_set1_ps(-4.0f * kSignedZero));
      const __m256i slot = _mm256_srli_epi32(_mm256_castps_si256(r), 23);
      const F c = _mm256_xor_ps(_mm256_permutevar8x32_ps(_mm256_load_ps(q.rank_offset8), slot),
                                _mm256_and_ps(r, _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN))));
      return mul(_mm256_fmadd_ps(r, _mm256_permutevar8x32_ps(_mm256_load_ps(q.rank_scale8), slot), c), scale);
    } else {
      const F rf = _mm256_cvtepi32_ps(_mm256_add_epi32(idx, _mm256_set1_epi32(1)));
      const __m256i slot = _mm256_srli_epi32(_mm256_castps_si256(rf), 23);
      return mul(_mm256_fmadd_ps(rf, _mm256_permutevar8x32_ps(_mm256_load_ps(q.rank_scale8), slot),
                                 _mm256_permutevar8x32_ps(_mm256_load_ps(q.rank_offset8), slot)),
                 scale);
    }
  }
  // |x| * inv (x is finite: lowp_loops.h). Not clamped to 1 (as AVX-512): y < 2 lies in region 8, as 1 does.
  // The unsigned map's x (second moments) are >= +0: no abs (a -0 would give y = -0: region 0's line, code 0).
  // ax: |x| where the caller has it (encode2a), else x.
  template <bool kSigned, bool kHaveAbs = false>
  static SWAPIO_INLINE F unit(F ax, F inv) {
    if constexpr (!kSigned || kHaveAbs) return _mm256_mul_ps(ax, inv);
    return _mm256_mul_ps(abs(ax), inv);
  }
  static SWAPIO_INLINE F abs(F x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }
  // quant.h's arithmetic search of the code of +y, y in [0, 2), with the 8-entry tables (quant_search.h's
  // quick_code8, lane by lane), before the clamp: returns rint(P8) (in kPos8Unit steps), whose lanes within kPos8Window
  // above a multiple of kPos8Unit defer to the bucket lookup (lower16()), and the region r in `r` (dwords 0 .. 16: the unsigned map's pair_below carries + 8, quant.h).
  static SWAPIO_INLINE __m256i unclamped_code(F y, const QuantMap& q, __m256i& r) {
    const __m256i bits = _mm256_castps_si256(y);
    // the pair of binades, 0 below the table: y >= 0, so exponent / 2 fits the low 16 bits of each lane and an
    // unsigned saturating 16-bit subtraction clamps it; the other three bytes of each lane are 0 and read entry 0
    const __m256i pair = _mm256_subs_epu16(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(kPairBase));
    const __m256i below = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(q.pair_below))), pair);
    const F mid = _mm256_permutevar8x32_ps(_mm256_load_ps(q.mid8), below);
    r = _mm256_sub_epi32(below, _mm256_castps_si256(_mm256_cmp_ps(y, mid, _CMP_GT_OQ)));
    const F pos = _mm256_fmsub_ps(y, _mm256_permutevar8x32_ps(_mm256_load_ps(q.pos_scale8), r),
                                  _mm256_permutevar8x32_ps(_mm256_load_ps(q.pos_offset8), r));
    return _mm256_cvtps_epi32(pos);  // round to nearest even (MXCSR's default, as nearbyint)
  }
  // unclamped_code, clamped lane by lane: the lanes' codes in `c`
  static SWAPIO_INLINE __m256i quick_code(F y, const QuantMap& q, __m256i& c) {
    __m256i r;
    const __m256i u = unclamped_code(y, q, r);
    const __m256i code_max = _mm256_load_si256(reinterpret_cast<const __m256i*>(q.code_max8));
    c = _mm256_min_epi32(_mm256_srli_epi32(u, kPos8Bits), _mm256_permutevar8x32_epi32(code_max, r));
    return u;
  }
  // All lanes from the bucket lookup (rare: kPos8Window + 1 rounded P8 in kPos8Unit; out of line). Where quick_code does not
  // defer it gives the same code (state_levels.cpp checks it), so the lanes need no mask.
  static __attribute__((noinline, cold)) __m256i exact_codes(F y, const QuantMap& q) {
    alignas(32) float ys[8];
    alignas(32) int32_t cs[8];
    _mm256_store_ps(ys, y);
    for (int i = 0; i < 8; ++i) cs[i] = q.zero + exact_k(q, ys[i] < 1.0f ? ys[i] : 1.0f);
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(cs));
  }
  // Whether any lane of rint(P8) vectors defers (its low 16 bits at most kPos8Window): least is their unsigned 16-bit
  // minimum (vpminuw; one operation per vector, where masking the low bits of each took two), whose high halves
  // the mask drops.
  static SWAPIO_INLINE bool lower16(__m256i least) {
    const __m256i in_window = _mm256_cmpeq_epi16(_mm256_subs_epu16(least, _mm256_set1_epi16(kPos8Window)),
                                                 _mm256_setzero_si256());
    return (_mm256_movemask_epi8(in_window) & 0x33333333) != 0;
  }
  // lower16 of one vector: for the cold paths, which take the bucket lookup only for the vectors that need it
  static SWAPIO_INLINE bool defers(__m256i u) { return lower16(u); }
  // c: the code of +|x| (zero + k); a negative x takes zero - min(k, max_neg_k) = max(2 zero - c, 0), the max by
  // the packs' unsigned saturation (c <= zero + max_neg_k + 1). zero + sign(x) (c - zero), by vpsignd on x's bits
  // as an integer: negative where x's sign bit is set, so also for -0, whose k = 0 (as for +0, where vpsignd gives
  // 0). Three single-uop operations: vblendvps is 3 uops (p015) on this machine's cores.
  template <bool kSigned>
  static SWAPIO_INLINE __m256i signed_codes(F x, __m256i c) {
    static_assert(kSignedZero + kSignedMaxNegK + 1 == 255, "2 zero - c >= -1");
    if constexpr (!kSigned) return c;
    const __m256i zero = _mm256_set1_epi32(kSignedZero);
    return _mm256_add_epi32(_mm256_sign_epi32(_mm256_sub_epi32(c, zero), _mm256_castps_si256(x)), zero);
  }
  // Two vectors at once (two moments of the same elements, or the same moment of adjacent elements): the codes
  // of both packed to bytes together, 8 for out0 then 8 for out1.
  template <bool kSigned0, bool kSigned1>
  static SWAPIO_INLINE void encode2(uint8_t* out0, F x0, F inv0, const QuantMap& q0, uint8_t* out1, F x1, F inv1,
                                    const QuantMap& q1) {
    encode2a<kSigned0, kSigned1, false>(out0, x0, x0, inv0, q0, out1, x1, x1, inv1, q1);
  }
  // encode2 given ax = |x| as well (lowp_loops.h's kSticky), or (kHaveAbs false) ax = x
  template <bool kSigned0, bool kSigned1, bool kHaveAbs = true>
  static SWAPIO_INLINE void encode2a(uint8_t* out0, F x0, F ax0, F inv0, const QuantMap& q0, uint8_t* out1, F x1,
                                     F ax1, F inv1, const QuantMap& q1) {
    const F y0 = unit<kSigned0, kHaveAbs>(ax0, inv0), y1 = unit<kSigned1, kHaveAbs>(ax1, inv1);
    __m256i c0, c1;
    const __m256i u0 = quick_code(y0, q0, c0), u1 = quick_code(y1, q1, c1);
    if (__builtin_expect(lower16(_mm256_min_epu16(u0, u1)), 0)) {
      if (defers(u0)) c0 = exact_codes(y0, q0);
      if (defers(u1)) c1 = exact_codes(y1, q1);
    }
    c0 = signed_codes<kSigned0>(x0, c0);
    c1 = signed_codes<kSigned1>(x1, c1);
    // per 128-bit lane: the 16-bit codes of c0's 4, then c1's 4; bytes; dwords 0 and 4 (c0), then 1 and 5 (c1)
    const __m256i w = _mm256_packus_epi32(c0, c1);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(w, w), _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
    const __m128i both = _mm256_castsi256_si128(b);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out0), both);
    _mm_storeh_pi(reinterpret_cast<__m64*>(out1), _mm_castsi128_ps(both));  // vmovhps: a store, no shuffle
  }
  // lowp_loops.h's int8 Adam with kAdamVectors 2: the codes of first moments m0, m1 (m, am: m0 and |m0| at [0, 8), m1
  // and |m1| at [8, 16)) to mout[0, 16) and of second moments v0, v1 (at v) to vout[0, 16), by the arithmetic search
  // alone. Returns the running unsigned 16-bit minimum of the lanes' rint(P8) (`least`, from least_init()): the caller
  // tests it once per block (lower16) and, if a lane deferred, encodes the block again with encode4a_exact (fewer
  // than 1 block in 500 once the moments are under way; a test per 32 lanes cost 1.4 % of the step,
  // benchmarks/RESULTS.md).
  static SWAPIO_INLINE __m256i least_init() { return _mm256_set1_epi16(-1); }
  static SWAPIO_INLINE __m256i encode4a(uint8_t* mout, const float* m, const float* am, F minv, const QuantMap& qm,
                                        uint8_t* vout, const float* v, F vinv, const QuantMap& qv, __m256i least) {
    __m256i u[4], r[4];
    search4(am, minv, qm, v, vinv, qv, u, r);
    least = _mm256_min_epu16(least, _mm256_min_epu16(_mm256_min_epu16(u[0], u[1]), _mm256_min_epu16(u[2], u[3])));
    for (__m256i& c : u) c = _mm256_srli_epi32(c, kPos8Bits);
    pack4(mout, vout, _mm256_loadu_ps(m), _mm256_loadu_ps(m + 8), u, r, qm);
    return least;
  }
  // encode4a with the bucket lookup for the vectors with a deferring lane (out of line: rare)
  static __attribute__((noinline, cold)) void encode4a_exact(uint8_t* mout, const float* m, const float* am, F minv,
                                                             const QuantMap& qm, uint8_t* vout, const float* v, F vinv,
                                                             const QuantMap& qv) {
    __m256i u[4], r[4];
    search4(am, minv, qm, v, vinv, qv, u, r);
    const float* x[4] = {am, am + 8, v, v + 8};
    for (int i = 0; i < 4; ++i) {  // the exact codes lie within their region's clamp: pack4's clamp keeps them
      const bool of_m = i < 2;
      u[i] = defers(u[i]) ? exact_codes(_mm256_mul_ps(_mm256_loadu_ps(x[i]), of_m ? minv : vinv), of_m ? qm : qv)
                          : _mm256_srli_epi32(u[i], kPos8Bits);
    }
    pack4(mout, vout, _mm256_loadu_ps(m), _mm256_loadu_ps(m + 8), u, r, qm);
  }
  // encode4a's search: rint(P8) of the 32 lanes in u (m0, m1, v0, v1), their regions in r
  static SWAPIO_INLINE void search4(const float* am, F minv, const QuantMap& qm, const float* v, F vinv,
                                    const QuantMap& qv, __m256i (&u)[4], __m256i (&r)[4]) {
    u[0] = unclamped_code(_mm256_mul_ps(_mm256_loadu_ps(am), minv), qm, r[0]);
    u[1] = unclamped_code(_mm256_mul_ps(_mm256_loadu_ps(am + 8), minv), qm, r[1]);
    u[2] = unclamped_code(_mm256_mul_ps(_mm256_loadu_ps(v), vinv), qv, r[2]);
    u[3] = unclamped_code(_mm256_mul_ps(_mm256_loadu_ps(v + 8), vinv), qv, r[3]);
  }
  // encode4a's packing of the 32 codes of +y (unclamped, < 2^11) c and their regions r. The codes and regions are
  // packed to bytes at once, in the same order; one vpshufb looks up the clamps of both maps by region (code_max16) and
  // one vpminub applies them. A negative m takes 2 zero - c, saturated at 0 (no -1.0), picked by its sign byte: signed
  // saturation keeps the sign of m's bits (-0 is negative too, and its c = zero gives zero), and v's bytes are 0.
  // Then one vpermd orders 16 bytes of m and 16 of v.
  static SWAPIO_INLINE void pack4(uint8_t* mout, uint8_t* vout, F m0, F m1, const __m256i (&c)[4],
                                  const __m256i (&r)[4], const QuantMap& qm) {
    static_assert(2 * kSignedZero == 254, "2 zero fits a byte");
    // per 128-bit lane: bytes of c0's 4, c1's 4 (m), c2's 4, c3's 4 (v); dwords 0 4 1 5 (m), 2 6 3 7 (v)
    const __m256i codes = _mm256_packus_epi16(_mm256_packus_epi32(c[0], c[1]), _mm256_packus_epi32(c[2], c[3]));
    const __m256i regions = _mm256_packus_epi16(_mm256_packus_epi32(r[0], r[1]), _mm256_packus_epi32(r[2], r[3]));
    const __m256i code_max = _mm256_shuffle_epi8(
        _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(qm.code_max16))), regions);
    const __m256i clamped = _mm256_min_epu8(codes, code_max);
    const __m256i sign = _mm256_packs_epi16(_mm256_packs_epi32(_mm256_castps_si256(m0), _mm256_castps_si256(m1)),
                                            _mm256_setzero_si256());
    const __m256i negative = _mm256_subs_epu8(_mm256_set1_epi8(static_cast<char>(2 * kSignedZero)), clamped);
    const __m256i b = _mm256_permutevar8x32_epi32(_mm256_blendv_epi8(clamped, negative, sign),
                                                  _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(mout), _mm256_castsi256_si128(b));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(vout), _mm256_extracti128_si256(b, 1));
  }
  template <bool kSigned>
  static SWAPIO_INLINE void encode(uint8_t* out, F x, F inv, const QuantMap& q) {
    alignas(16) uint8_t unused[8];
    encode2<kSigned, kSigned>(out, x, inv, q, unused, _mm256_setzero_ps(), inv, q);
  }
  static SWAPIO_INLINE F max_pos(F acc, F x) { return _mm256_max_ps(acc, x); }
  // lowp_loops.h's kSticky: the running maxima as unsigned integers of the bits (NaN and inf stay in them)
  static constexpr bool kSticky = true;
  static constexpr int kAdamVectors = 2;  // lowp_loops.h: the int8 Adam loop's scalar overhead halved
  static constexpr bool kEncodeApart = true;  // lowp_loops.h: 16 registers do not hold the three stages at once
  static SWAPIO_INLINE F smax(F acc, F x) {
    return _mm256_castsi256_ps(_mm256_max_epu32(_mm256_castps_si256(acc), _mm256_castps_si256(x)));
  }
  static SWAPIO_INLINE uint32_t hmax_bits(F a) {
    const __m256i u = _mm256_castps_si256(a);
    __m128i m = _mm_max_epu32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    m = _mm_max_epu32(m, _mm_unpackhi_epi64(m, m));
    m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 1));
    return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
  }
  static SWAPIO_INLINE F max_abs(F acc, F x) {
    return _mm256_max_ps(acc, _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))));
  }
  static SWAPIO_INLINE float hmax(F a) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
  }
  // x - x is 0 for a finite x and NaN otherwise: one ordered compare of both differences finds the lanes to keep
  static SWAPIO_INLINE U drop_nonfinite(U n, F& m, F& v) {
    const F fin = _mm256_cmp_ps(_mm256_sub_ps(m, m), _mm256_sub_ps(v, v), _CMP_ORD_Q);
    m = _mm256_and_ps(m, fin);
    v = _mm256_and_ps(v, fin);
    return _mm256_sub_epi32(n, _mm256_xor_si256(_mm256_castps_si256(fin), _mm256_set1_epi32(-1)));  // +1 where not
  }
  static SWAPIO_INLINE int64_t count_sum(U n) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(n), _mm256_extracti128_si256(n, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
  }
};

#undef SWAPIO_ROUNDED

}  // namespace

void adam_kernel_avx2(const AdamArgs& a, int64_t begin, int64_t end) {
  run_variant<Kernel>(a, begin, end);
}

int64_t lowp_kernel_avx2(const LowpArgs& a, int64_t begin, int64_t end) {
  return lowp::run_lowp<V>(a, begin, end);
}

void adafactor_kernel_avx2(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end) {
  afactor::run<V>(a, pass, begin, end);
}

}  // namespace adam
}  // namespace swapio

#endif  // SWAPIO_HAVE_X86_KERNELS
