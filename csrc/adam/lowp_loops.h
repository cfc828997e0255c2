#pragma once
// The loops of the low-precision-state kernels (bf16 / int8 moments) and of Lion, written once over a vector
// type V that each per-ISA file defines in its anonymous namespace (so every instantiation has internal
// linkage and is built with that file's flags only; see adam_variants.h). Every level runs the same
// operations in the same order, element by element, so the levels agree bit for bit:
//   bf16 moments: widened exactly; stored with stochastic rounding from a counter-based hash;
//   int8 moments: a block of kQuantBlock elements is decoded (code value * block scale), stepped in fp32,
//     its new absmax taken over the finite values, then encoded (quant.h) from an L1-resident copy.
// The parameter update uses the new fp32 moments, before they are rounded or quantised (as bitsandbytes does).
//
// V provides (W lanes; all arithmetic correctly rounded, mul() never fused with a later add):
//   F, U, W, set1, load, store, load_grad<G>, store_out<O>, add, sub, mul, div, sqrt, fma (a*b+c, one
//   rounding), flip (xor the sign bit), sign (1, -1, or 0 for zero and NaN), load_bf16, store_bf16_sr,
//   hash (fmix32 of key + index*0x9E3779B9 per lane), decode<is the map signed>, encode<signed> of a finite x,
//   encode2<signed, signed> (two encodes, in any order), max_abs (max(acc, |x|); any value where x is not finite:
//   such a block's absmax is taken again), max_pos (the same for x >= +0), hmax, drop_nonfinite (adds, per lane
//   of a U, 1 where m or v is not finite, and sets both to +0 there), count_sum (the lanes' counts added). The
//   encoders see finite moments only.
#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "adam/adam_kernel.h"

// The step, the codecs and the group loop must melt into one loop body: called out of line, they pass vectors
// through memory and the int8 kernels ran at a third of their speed.
#define SWAPIO_INLINE inline __attribute__((always_inline))

namespace swapio {
namespace adam {
namespace lowp {
namespace {  // one copy per including (per-ISA) file

// A V may declare kSticky = true and provide abs(x) (|x|), smax(acc, x) (the maximum of acc and x as unsigned
// integers of their bits: for x >= +0 the float maximum, and any NaN or inf, also -NaN, stays in it for good),
// hmax_bits (the unsigned maximum of the lanes' bits) and encode2a (encode2 given |x| as well). Its int8 loops then
// keep a block's |m| beside m (encode2a reads it; its encoders skip the abs), and find a block's non-finite moments
// in its two maxima: no running `bad` (one vector operation fewer per W elements, and one abs fewer).
template <class V, class = void>
struct sticky : std::false_type {};
template <class V>
struct sticky<V, std::enable_if_t<V::kSticky>> : std::true_type {};
// V::kAdamVectors (default 1): vectors of each stage per iteration of the int8 Adam loop (Lion's is 2). A kSticky V
// with 2 provides encode4a: both moments of 2 W elements at once, given |m|, by the arithmetic search alone, returning
// the running least of its lanes' positions, which lower16() tests (least_init() starts it); and encode4a_exact, the
// same with the bucket lookup for the lanes that defer.
template <class V, class = void>
struct adam_vectors : std::integral_constant<int, 1> {};
template <class V>
struct adam_vectors<V, std::enable_if_t<(V::kAdamVectors > 0)>> : std::integral_constant<int, V::kAdamVectors> {};

// V::kEncodeApart (default false): blockwise() encodes a block in a loop of its own (below).
template <class V, class = void>
struct encode_apart : std::false_type {};
template <class V>
struct encode_apart<V, std::enable_if_t<V::kEncodeApart>> : std::true_type {};

inline float bits_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
}

constexpr int64_t dtype_size(DType t) { return t == DType::kF32 ? 4 : (t == DType::kNone ? 0 : 2); }
constexpr int64_t state_size(StateType s) { return s == StateType::kF32 ? 4 : (s == StateType::kBF16 ? 2 : 1); }

// Pointers of W consecutive elements (into the tensors, or into zero-padded stack copies for a tail).
struct Lane {
  float* p;
  const void* g;
  void* out;
  void* m;
  void* v;
};

template <class V, bool L2>
struct AdamStep {
  using F = typename V::F;
  static constexpr int kMoments = 2;
  // torch's _single_tensor_adam order, as in the fp32 kernels (adam_scalar.cpp)
  static SWAPIO_INLINE void step(const LowpArgs& a, F& p, F g, F& m, F& v) {
    const AdamConsts& c = a.adam;
    if (c.grad_sign) g = V::flip(g, c.grad_sign);  // a loop-invariant branch: no vector operation unless maximizing
    if constexpr (L2) {
      g = V::fma(p, V::set1(c.wd), g);
    } else {
      p = V::mul(p, V::set1(c.decay));
    }
    F d = V::sub(g, m);
    m = c.w_small ? V::fma(V::set1(c.w), d, m) : V::fma(V::set1(c.w_minus_1), d, g);
    v = V::fma(V::mul(V::set1(c.one_minus_beta2), g), g, V::mul(v, V::set1(c.beta2)));
    F denom = V::add(V::div(V::sqrt(v), V::set1(c.bc2_sqrt)), V::set1(c.eps));
    p = V::add(p, V::div(V::mul(V::set1(c.neg_step_size), m), denom));
  }
};

template <class V>
struct LionStep {
  using F = typename V::F;
  static constexpr int kMoments = 1;
  // p.mul_(1 - lr*wd); p.add_(exp_avg.mul(beta1).add_(g, alpha=1-beta1).sign_(), alpha=-lr);
  // exp_avg.mul_(beta2).add_(g, alpha=1-beta2)   (ATen fuses add-with-alpha: g*alpha + x)
  static SWAPIO_INLINE void step(const LowpArgs& a, F& p, F g, F& m, F&) {
    const LionConsts& c = a.lion;
    g = V::flip(g, c.grad_sign);
    p = V::mul(p, V::set1(c.decay));
    F u = V::fma(g, V::set1(c.one_minus_beta1), V::mul(m, V::set1(c.beta1)));
    p = V::fma(V::sign(u), V::set1(c.neg_lr), p);
    m = V::fma(g, V::set1(c.one_minus_beta2), V::mul(m, V::set1(c.beta2)));
  }
};

template <class V, DType G, DType O, StateType S, class Step>
struct Loops {
  using F = typename V::F;
  using U = typename V::U;
  static constexpr int W = V::W;
  static constexpr int64_t gs = dtype_size(G), os = dtype_size(O), ss = state_size(S);
  static constexpr bool two = Step::kMoments == 2;
  static constexpr bool kSticky = sticky<V>::value;

  static Lane at(const LowpArgs& a, int64_t i) {
    Lane q;
    q.p = a.param + i;
    q.g = static_cast<const char*>(a.grad) + i * gs;
    q.out = os ? static_cast<char*>(a.param_out) + i * os : nullptr;
    q.m = static_cast<char*>(a.m.data) + i * ss;
    q.v = two ? static_cast<char*>(a.v.data) + i * ss : nullptr;
    return q;
  }

  // Runs body(lane, i) on every W elements of [b, e); the last partial group on zero-padded stack copies,
  // copied back after. Body sees global i. (int8 moments do not pass through here: blockwise() keeps them in
  // its block buffers.)
  template <class Body>
  static SWAPIO_INLINE void groups(const LowpArgs& a, int64_t b, int64_t e, Body body) {
    int64_t i = b;
    for (; i + W <= e; i += W) body(at(a, i), i);
    if (i == e) return;
    const int64_t r = e - i;
    alignas(64) float p[W] = {0}, g[W] = {0}, out[W] = {0}, m[W] = {0}, v[W] = {0};
    const Lane src = at(a, i);
    __builtin_memcpy(p, src.p, r * 4);
    __builtin_memcpy(g, src.g, r * gs);
    if (S != StateType::kInt8) {
      __builtin_memcpy(m, src.m, r * ss);
      if (two) __builtin_memcpy(v, src.v, r * ss);
    }
    body(Lane{p, g, out, m, v}, i);
    __builtin_memcpy(src.p, p, r * 4);
    if (os) __builtin_memcpy(src.out, out, r * os);
    if (S != StateType::kInt8) {
      __builtin_memcpy(src.m, m, r * ss);
      if (two) __builtin_memcpy(src.v, v, r * ss);
    }
  }

  static SWAPIO_INLINE F load_state(const void* p) {
    if constexpr (S == StateType::kF32) return V::load(static_cast<const float*>(p));
    else return V::load_bf16(static_cast<const uint16_t*>(p));
  }

  // fp32 and bf16 moments: element by element.
  static int64_t elementwise(const LowpArgs& a, int64_t b, int64_t e) {
    groups(a, b, e, [&](const Lane& q, int64_t i) __attribute__((always_inline)) {
      F p = V::load(q.p);
      F g = V::template load_grad<G>(q.g);
      F m = load_state(q.m), v = two ? load_state(q.v) : p;
      Step::step(a, p, g, m, v);
      V::store(q.p, p);
      V::template store_out<O>(q.out, p);
      if constexpr (S == StateType::kF32) {
        V::store(static_cast<float*>(q.m), m);
        if (two) V::store(static_cast<float*>(q.v), v);
      } else {
        U r = V::hash(a.sr_key, static_cast<uint32_t>(a.index_base + i));
        V::store_bf16_sr(static_cast<uint16_t*>(q.m), m, V::lo16(r));
        if (two) V::store_bf16_sr(static_cast<uint16_t*>(q.v), v, V::hi16(r));
      }
    });
    return 0;
  }

  // A block's scale (stored) and its inverse, which encode multiplies by.
  struct Coded {
    F inv;
  };
  static SWAPIO_INLINE Coded coded(float* scale, float absmax) {
    const float s = absmax >= FLT_MIN ? absmax : 0.0f;  // tinier blocks store zeros
    *scale = s;
    return Coded{V::set1(s > 0.0f ? 1.0f / s : 0.0f)};
  }

  // int8 moments, a block of kQuantBlock elements at a time through an L1-resident fp32 copy of its moments, in
  // three stages: decode, step (+ the new absmax), encode (which needs the whole block's absmax). The stages are
  // software-pipelined over blocks: a loop iteration decodes vectors of block n + 1, steps the same vectors of
  // block n and encodes those of block n - 1. The three are independent chains bound by different units (table
  // permutes, the divider, the code search), which the core then overlaps; run as one pass after another, each
  // was bound by its own unit while the others idled (and fused per vector, one long chain left too few vectors
  // in flight). Blocks at the ends of the range, and a partial last block, run their stages one after another.
  // A V with kEncodeApart (AVX2) encodes a block in a loop of its own after the step and decode of the next: with
  // 16 vector registers the three stages in one loop kept spilling; the step and decode together, and the encode
  // alone, fit (8 % faster on Zen 5, benchmarks/RESULTS.md).
  static constexpr int64_t kEnc = two ? W : 2 * W;  // elements per encode_vectors: Lion encodes two vectors at once
  static constexpr int64_t kStride = two ? adam_vectors<V>::value * W : 2 * W;  // elements per iteration
  static constexpr bool kEncodeApart = encode_apart<V>::value;

  struct Slot {  // one block in flight
    alignas(64) float m[kQuantBlock];
    alignas(64) float v[kQuantBlock];
    alignas(64) float ma[kSticky ? kQuantBlock : 1];  // |m| (kSticky)
    Coded mc, vc;
  };

  static int64_t blockwise(const LowpArgs& args, int64_t b, int64_t e) {
    // A local copy, which no store through the buffers' pointers can alias: its pointers and constants stay in
    // registers instead of being loaded again for every vector.
    const LowpArgs a = args;
    Slot slots[3];
    const int64_t blocks = (e - b + kQuantBlock - 1) / kQuantBlock;
    int64_t total_nonfinite = 0;
    F bad = V::set1(0.0f);  // not finite if a moment of the block being stepped is not (step_lane)
    for (int64_t n = -1; n <= blocks; ++n) {  // n: the block stepped in this iteration
      const bool dec = n + 1 < blocks, stp = n >= 0 && n < blocks, enc = n >= 1;
      const int64_t b_dec = b + (n + 1) * kQuantBlock, b_stp = b_dec - kQuantBlock, b_enc = b_stp - kQuantBlock;
      Slot& sd = slots[(n + 4) % 3];
      Slot& ss = slots[(n + 3) % 3];
      Slot& se = slots[(n + 2) % 3];
      F mmax = V::set1(0.0f), vmax = V::set1(0.0f);
      if (dec && stp && enc && b_dec + kQuantBlock <= e) {  // all three whole blocks
        // the running maxima in copies whose address never escapes (refit takes mmax by reference): a vector type
        // may alias any float, so the escaped ones went through memory at every store of the loop
        F mm = mmax, vm = vmax, bd = bad;
        for (int64_t j = 0; j < kQuantBlock; j += kStride) {
          prefetch(a, b_dec + kPrefetchBlocks * kQuantBlock + j, e);
          // the step first: its chain through the divider is the longest, the other two fill its wait
          step_vectors(a, b_stp, j, ss, mm, vm, bd);
          if constexpr (!kEncodeApart) encode_stride(a, b_enc, j, se);
          decode_vectors(a, b_dec, j, sd);
        }
        mmax = mm;
        vmax = vm;
        bad = bd;
        if constexpr (kEncodeApart) {
          encode_whole(a, b_enc, se);
        }
      } else {
        if (dec) decode_block(a, b_dec, end_of(b_dec, e), sd);
        if (stp) {
          const int64_t b1 = end_of(b_stp, e);
          // the lanes past b1 step the decoded zero code of the padding, as elementwise() steps its zero padding
          groups(a, b_stp, b1, [&](const Lane& q, int64_t i) __attribute__((always_inline)) {
            step_lane(a, q, ss.m + (i - b_stp), ss.v + (i - b_stp), ss.ma + (kSticky ? i - b_stp : 0), mmax, vmax,
                      bad);
          });
        }
        if (enc) encode_block(a, b_enc, end_of(b_enc, e), se);
      }
      if (stp) {
        // the lanes stepped: the block, or its part rounded up to W
        const int64_t stepped = e - b_stp < kQuantBlock ? (e - b_stp + W - 1) / W * W : kQuantBlock;
        const int64_t blk = b_stp / kQuantBlock;
        if constexpr (kSticky) {
          uint32_t mbits = V::hmax_bits(mmax), vbits = two ? V::hmax_bits(vmax) : 0;
          // at or above +inf's bits: a moment is not finite (or a v is -0, which costs only this refit)
          if (__builtin_expect((mbits | vbits) >= 0x7F800000u, 0)) {
            total_nonfinite += refit(ss, stepped, mmax, vmax);
            mbits = V::hmax_bits(mmax);
            vbits = two ? V::hmax_bits(vmax) : 0;
          }
          ss.mc = coded(a.m.scale + blk, bits_f32(mbits));
          if (two) ss.vc = coded(a.v.scale + blk, bits_f32(vbits));
        } else {
          if (!all_finite(bad)) total_nonfinite += refit(ss, stepped, mmax, vmax);
          bad = V::set1(0.0f);
          ss.mc = coded(a.m.scale + blk, V::hmax(mmax));
          if (two) ss.vc = coded(a.v.scale + blk, V::hmax(vmax));
        }
      }
    }
    return total_nonfinite;
  }

  // Software prefetch of the streams, kPrefetchBlocks blocks ahead of the decode: one core alone keeps too few
  // cache misses in flight to feed these kernels, and the hardware prefetcher stops at page boundaries (2 blocks
  // ahead measured faster than 1 or 3 for both int8 kernels).
  static constexpr int64_t kPrefetchBlocks = 2;
  static SWAPIO_INLINE void prefetch(const LowpArgs& a, int64_t i, int64_t e) {
    if (i >= e) return;
    const Lane q = at(a, i);
    for (int64_t off = 0; off < kStride * 4; off += 64) __builtin_prefetch(reinterpret_cast<const char*>(q.p) + off, 1);
    for (int64_t off = 0; off < kStride * gs; off += 64) __builtin_prefetch(static_cast<const char*>(q.g) + off);
    if ((i & 63) < kStride) {  // i >= 0
      __builtin_prefetch(q.m, 1);
      if (two) __builtin_prefetch(q.v, 1);
    }
  }

  static SWAPIO_INLINE int64_t end_of(int64_t b0, int64_t e) { return b0 + kQuantBlock < e ? b0 + kQuantBlock : e; }

  // One vector: the step on fp32 moments m[0, W) (and v), stored back; the running absmax, and `bad`, which a
  // non-finite m or v makes non-finite for good (m * v is inf or NaN then; a finite overflow only costs a refit).
  // kSticky: |m| stored to mab as well, and no `bad`: the maxima of the bits keep any non-finite moment.
  static SWAPIO_INLINE void step_lane(const LowpArgs& a, const Lane& q, float* mb, float* vb, float* mab, F& mmax,
                                      F& vmax, F& bad) {
    F p = V::load(q.p);
    F g = V::template load_grad<G>(q.g);
    F m = V::load(mb);
    F v = two ? V::load(vb) : p;
    Step::step(a, p, g, m, v);
    V::store(q.p, p);
    V::template store_out<O>(q.out, p);
    V::store(mb, m);
    if constexpr (kSticky) {
      const F am = V::abs(m);
      V::store(mab, am);
      mmax = V::smax(mmax, am);
      if (two) {
        V::store(vb, v);
        vmax = V::smax(vmax, v);  // v >= +0 (below): its bits' maximum is the float one unless v is not finite
      }
      return;
    }
    bad = two ? V::fma(m, v, bad) : V::add(bad, m);
    mmax = V::max_abs(mmax, m);
    if (two) {
      V::store(vb, v);
      vmax = V::max_pos(vmax, v);  // v >= +0: a code's value (>= +0) * beta2 + (1 - beta2) g * g
    }
  }

  static SWAPIO_INLINE bool all_finite(F x) {
    F y = x;
    return V::count_sum(V::drop_nonfinite(U{}, x, y)) == 0;
  }

  // A block whose `bad` is not finite (rare), its first `stepped` lanes again: an element whose m or v is not
  // finite keeps neither: int8 cannot hold inf or NaN, and a finite m beside a v stored as 0 (g * g overflowed)
  // would move the parameter by m / eps at the next step, where fp32 state's v stays inf and the update 0. Both
  // start over from 0; the absmax is taken again over what stays. Returns how many were dropped. (Checked per
  // block rather than per vector: the check and the mask cost the int8 loops about 5 % on AVX2.)
  static __attribute__((noinline)) int64_t refit(Slot& s, int64_t stepped, F& mmax, F& vmax) {
    U n{};
    mmax = vmax = V::set1(0.0f);
    for (int64_t k = 0; k < stepped; k += W) {
      F m = V::load(s.m + k), v = two ? V::load(s.v + k) : m;
      n = V::drop_nonfinite(n, m, v);
      V::store(s.m + k, m);
      if constexpr (kSticky) {  // all finite now: the bits' maxima of |m| and |v| are the float ones
        const F am = V::abs(m);
        V::store(s.ma + k, am);
        mmax = V::smax(mmax, am);
        if (two) {
          V::store(s.v + k, v);
          vmax = V::smax(vmax, V::abs(v));
        }
        continue;
      }
      mmax = V::max_abs(mmax, m);
      if (two) {
        V::store(s.v + k, v);
        vmax = V::max_abs(vmax, v);
      }
    }
    return V::count_sum(n);
  }

  // The pipelined stages on vectors [j, j + kStride) of a whole block starting at element b0 (encode_vectors:
  // [j, j + kEnc)).
  static SWAPIO_INLINE void decode_vectors(const LowpArgs& a, int64_t b0, int64_t j, Slot& s) {
    const int64_t blk = b0 / kQuantBlock;
    const uint8_t* mcodes = static_cast<const uint8_t*>(a.m.data) + b0;
    for (int64_t k = j; k < j + kStride; k += W) {
      V::store(s.m + k, V::template decode<true>(mcodes + k, *a.m.map, V::set1(a.m.scale[blk])));
      if (two) {
        V::store(s.v + k, V::template decode<false>(static_cast<const uint8_t*>(a.v.data) + b0 + k, *a.v.map,
                                                    V::set1(a.v.scale[blk])));
      }
    }
  }
  static SWAPIO_INLINE void step_vectors(const LowpArgs& a, int64_t b0, int64_t j, Slot& s, F& mmax, F& vmax,
                                         F& bad) {
    for (int64_t k = j; k < j + kStride; k += W) {
      step_lane(a, at(a, b0 + k), s.m + k, s.v + k, s.ma + (kSticky ? k : 0), mmax, vmax, bad);
    }
  }
  static SWAPIO_INLINE void encode_stride(const LowpArgs& a, int64_t b0, int64_t j, const Slot& s) {
    for (int64_t k = j; k < j + kStride; k += kEnc) encode_vectors(a, b0, k, s);
  }
  // kEncodeApart: a whole block. With encode4a (the V's that provide it encode apart), the deferral test once for the
  // block: if a lane deferred, the block is encoded again with the exact search (the codes are a function of the
  // slot, which stays as it is).
  static SWAPIO_INLINE void encode_whole(const LowpArgs& a, int64_t b0, const Slot& s) {
    if constexpr (kEncode4) {
      auto least = V::least_init();
      for (int64_t j = 0; j < kQuantBlock; j += kStride) least = encode4(a, b0, j, s, least);
      if (__builtin_expect(V::lower16(least), 0)) {
        for (int64_t j = 0; j < kQuantBlock; j += kStride) encode4_exact(a, b0, j, s);
      }
    } else {
      for (int64_t j = 0; j < kQuantBlock; j += kStride) encode_stride(a, b0, j, s);
    }
  }
  // V::encode4a: both moments of 2 W elements at once (kSticky, two moments, kAdamVectors 2)
  static constexpr bool kEncode4 = kSticky && two && kStride == 2 * W;
  template <class Least>
  static SWAPIO_INLINE Least encode4(const LowpArgs& a, int64_t b0, int64_t j, const Slot& s, Least least) {
    return V::encode4a(static_cast<uint8_t*>(a.m.data) + b0 + j, s.m + j, s.ma + j, s.mc.inv, *a.m.map,
                       static_cast<uint8_t*>(a.v.data) + b0 + j, s.v + j, s.vc.inv, *a.v.map, least);
  }
  static SWAPIO_INLINE void encode4_exact(const LowpArgs& a, int64_t b0, int64_t j, const Slot& s) {
    V::encode4a_exact(static_cast<uint8_t*>(a.m.data) + b0 + j, s.m + j, s.ma + j, s.mc.inv, *a.m.map,
                      static_cast<uint8_t*>(a.v.data) + b0 + j, s.v + j, s.vc.inv, *a.v.map);
  }
  static SWAPIO_INLINE void encode_vectors(const LowpArgs& a, int64_t b0, int64_t j, const Slot& s) {
    uint8_t* mcodes = static_cast<uint8_t*>(a.m.data) + b0;
    if constexpr (kSticky && two) {
      const F v = V::load(s.v + j);
      V::template encode2a<true, false>(mcodes + j, V::load(s.m + j), V::load(s.ma + j), s.mc.inv, *a.m.map,
                                        static_cast<uint8_t*>(a.v.data) + b0 + j, v, v, s.vc.inv, *a.v.map);
    } else if constexpr (kSticky) {
      V::template encode2a<true, true>(mcodes + j, V::load(s.m + j), V::load(s.ma + j), s.mc.inv, *a.m.map,
                                       mcodes + j + W, V::load(s.m + j + W), V::load(s.ma + j + W), s.mc.inv,
                                       *a.m.map);
    } else if constexpr (two) {
      V::template encode2<true, false>(mcodes + j, V::load(s.m + j), s.mc.inv, *a.m.map,
                                       static_cast<uint8_t*>(a.v.data) + b0 + j, V::load(s.v + j), s.vc.inv, *a.v.map);
    } else {
      V::template encode2<true, true>(mcodes + j, V::load(s.m + j), s.mc.inv, *a.m.map, mcodes + j + W,
                                      V::load(s.m + j + W), s.mc.inv, *a.m.map);
    }
  }

  static SWAPIO_INLINE void decode_block(const LowpArgs& a, int64_t b0, int64_t b1, Slot& s) {
    const int64_t blk = b0 / kQuantBlock;
    decode_span<true>(static_cast<const uint8_t*>(a.m.data), *a.m.map, a.m.scale[blk], s.m, b0, b1);
    if (two) decode_span<false>(static_cast<const uint8_t*>(a.v.data), *a.v.map, a.v.scale[blk], s.v, b0, b1);
  }

  // buf[0, b1 - b0) = the values of codes [b0, b1) with this block's scale; up to the next W, the zero code's.
  template <bool kSigned>
  static SWAPIO_INLINE void decode_span(const uint8_t* codes, const QuantMap& q, float scale, float* buf, int64_t b0,
                                        int64_t b1) {
    const F s = V::set1(scale);
    int64_t i = b0;
    for (; i + W <= b1; i += W) V::store(buf + (i - b0), V::template decode<kSigned>(codes + i, q, s));
    if (i < b1) {
      alignas(64) uint8_t tail[W];
      __builtin_memset(tail, q.zero, sizeof tail);
      __builtin_memcpy(tail, codes + i, b1 - i);
      V::store(buf + (i - b0), V::template decode<kSigned>(tail, q, s));
    }
  }

  // Encodes [b0, b1) of a block from its slot (a partial block: the last of the range).
  static SWAPIO_INLINE void encode_block(const LowpArgs& a, int64_t b0, int64_t b1, const Slot& s) {
    const int64_t r = b1 - b0;
    uint8_t* mcodes = static_cast<uint8_t*>(a.m.data) + b0;
    int64_t j = 0;
    for (; j + kEnc <= r; j += kEnc) encode_vectors(a, b0, j, s);
    for (; j + W <= r; j += W) V::template encode<true>(mcodes + j, V::load(s.m + j), s.mc.inv, *a.m.map);  // Lion's
    if (j < r) {
      encode_tail<true>(s.m + j, mcodes + j, r - j, s.mc, *a.m.map);
      if (two) encode_tail<false>(s.v + j, static_cast<uint8_t*>(a.v.data) + b0 + j, r - j, s.vc, *a.v.map);
    }
  }

  template <bool kSigned>
  static SWAPIO_INLINE void encode_tail(const float* buf, uint8_t* codes, int64_t r, Coded c, const QuantMap& q) {
    alignas(64) uint8_t tail[W];
    alignas(64) float x[W] = {0};
    __builtin_memcpy(x, buf, r * 4);
    V::template encode<kSigned>(tail, V::load(x), c.inv, q);
    __builtin_memcpy(codes, tail, r);
  }

  static int64_t run(const LowpArgs& a, int64_t b, int64_t e) {
    if constexpr (S == StateType::kInt8) return blockwise(a, b, e);
    else return elementwise(a, b, e);
  }
};

template <class V, DType G, DType O, StateType S>
int64_t run_algo(const LowpArgs& a, int64_t b, int64_t e) {
  if (a.algo == Algo::kLion) return Loops<V, G, O, S, LionStep<V>>::run(a, b, e);
  if (a.adam.l2) return Loops<V, G, O, S, AdamStep<V, true>>::run(a, b, e);
  return Loops<V, G, O, S, AdamStep<V, false>>::run(a, b, e);
}

template <class V, DType G, DType O>
int64_t run_state(const LowpArgs& a, int64_t b, int64_t e) {
  switch (a.state) {
    case StateType::kBF16: return run_algo<V, G, O, StateType::kBF16>(a, b, e);
    case StateType::kInt8: return run_algo<V, G, O, StateType::kInt8>(a, b, e);
    default: return run_algo<V, G, O, StateType::kF32>(a, b, e);
  }
}

template <class V, DType G>
int64_t run_out(const LowpArgs& a, int64_t b, int64_t e) {
  switch (a.out_dtype) {
    case DType::kF32: return run_state<V, G, DType::kF32>(a, b, e);
    case DType::kBF16: return run_state<V, G, DType::kBF16>(a, b, e);
    case DType::kF16: return run_state<V, G, DType::kF16>(a, b, e);
    default: return run_state<V, G, DType::kNone>(a, b, e);
  }
}

// Entry of one ISA: picks the compile-time variant of this step's grad and param_out dtypes, state and algorithm.
template <class V>
int64_t run_lowp(const LowpArgs& a, int64_t b, int64_t e) {
  switch (a.grad_dtype) {
    case DType::kBF16: return run_out<V, DType::kBF16>(a, b, e);
    case DType::kF16: return run_out<V, DType::kF16>(a, b, e);
    default: return run_out<V, DType::kF32>(a, b, e);
  }
}

}  // namespace
}  // namespace lowp
}  // namespace adam
}  // namespace swapio
