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
//   hash (fmix32 of key + index*0x9E3779B9 per lane), decode, encode, abs_finite (|x|, 0 when not finite),
//   encode2 (two encodes, in any order), max, hmax, count_nonfinite.
#include <cfloat>
#include <cstdint>

#include "adam/adam_kernel.h"

// The step, the codecs and the group loop must melt into one loop body: called out of line, they pass vectors
// through memory and the int8 kernels ran at a third of their speed.
#define SWAPIO_INLINE inline __attribute__((always_inline))

namespace swapio {
namespace adam {
namespace lowp {
namespace {  // one copy per including (per-ISA) file

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
    g = V::flip(g, c.grad_sign);
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

  // int8 moments: one block of kQuantBlock at a time, in three passes over an L1-resident fp32 copy of its
  // moments: decode, step + absmax, encode. (Fused in one pass, the decode's lookups and the step's divisions
  // made one long chain per vector, and too few vectors fit in flight to hide it.)
  static int64_t blockwise(const LowpArgs& a, int64_t b, int64_t e) {
    alignas(64) float mbuf[kQuantBlock], vbuf[kQuantBlock];
    const QuantMap& mq = *a.m.map;
    const QuantMap* vq = two ? a.v.map : nullptr;
    int64_t nonfinite = 0;
    for (int64_t b0 = b; b0 < e; b0 += kQuantBlock) {
      const int64_t b1 = b0 + kQuantBlock < e ? b0 + kQuantBlock : e, blk = b0 / kQuantBlock;
      decode_block(static_cast<const uint8_t*>(a.m.data), mq, a.m.scale[blk], mbuf, b0, b1);
      if (two) decode_block(static_cast<const uint8_t*>(a.v.data), *vq, a.v.scale[blk], vbuf, b0, b1);
      F mmax = V::set1(0.0f), vmax = V::set1(0.0f);
      // the lanes past b1 step the decoded zero code of the padding, as elementwise() steps its zero padding
      groups(a, b0, b1, [&](const Lane& q, int64_t i) __attribute__((always_inline)) {
        F p = V::load(q.p);
        F g = V::template load_grad<G>(q.g);
        F m = V::load(mbuf + (i - b0));
        F v = two ? V::load(vbuf + (i - b0)) : p;
        Step::step(a, p, g, m, v);
        V::store(q.p, p);
        V::template store_out<O>(q.out, p);
        V::store(mbuf + (i - b0), m);
        mmax = V::max(mmax, V::abs_finite(m));
        if (two) {
          V::store(vbuf + (i - b0), v);
          vmax = V::max(vmax, V::abs_finite(v));
        }
        nonfinite += V::count_nonfinite(m, two ? v : m);
      });
      const Coded mc = coded(a.m.scale + blk, V::hmax(mmax)), vc = two ? coded(a.v.scale + blk, V::hmax(vmax)) : mc;
      encode_block(mbuf, static_cast<uint8_t*>(a.m.data), mc, mq, vbuf, static_cast<uint8_t*>(a.v.data), vc, vq,
                   b0, b1);
    }
    return nonfinite;
  }

  // buf[0, b1 - b0) = the values of codes [b0, b1) with this block's scale; up to the next W, the zero code's.
  static SWAPIO_INLINE void decode_block(const uint8_t* codes, const QuantMap& q, float scale, float* buf, int64_t b0,
                                         int64_t b1) {
    const F s = V::set1(scale);
    int64_t i = b0;
    for (; i + W <= b1; i += W) V::store(buf + (i - b0), V::decode(codes + i, q.code, s));
    if (i < b1) {
      alignas(64) uint8_t tail[W];
      __builtin_memset(tail, q.zero, sizeof tail);
      __builtin_memcpy(tail, codes + i, b1 - i);
      V::store(buf + (i - b0), V::decode(tail, q.code, s));
    }
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

  // Encodes [b0, b1) of the first moment from mbuf and, with two moments, of the second from vbuf, two vectors
  // per call to encode2 (whose lookups are independent chains that can overlap).
  static SWAPIO_INLINE void encode_block(const float* mbuf, uint8_t* mcodes, Coded mc, const QuantMap& mq,
                                         const float* vbuf, uint8_t* vcodes, Coded vc, const QuantMap* vq,
                                         int64_t b0, int64_t b1) {
    int64_t i = b0;
    if constexpr (two) {
      for (; i + W <= b1; i += W) {
        V::encode2(mcodes + i, V::load(mbuf + (i - b0)), mc.inv, mq, vcodes + i, V::load(vbuf + (i - b0)), vc.inv, *vq);
      }
    } else {
      for (; i + 2 * W <= b1; i += 2 * W) {
        V::encode2(mcodes + i, V::load(mbuf + (i - b0)), mc.inv, mq, mcodes + i + W, V::load(mbuf + (i + W - b0)),
                   mc.inv, mq);
      }
      for (; i + W <= b1; i += W) V::encode(mcodes + i, V::load(mbuf + (i - b0)), mc.inv, mq);
    }
    if (i < b1) {
      encode_tail(mbuf + (i - b0), mcodes + i, b1 - i, mc, mq);
      if (two) encode_tail(vbuf + (i - b0), vcodes + i, b1 - i, vc, *vq);
    }
  }

  static SWAPIO_INLINE void encode_tail(const float* buf, uint8_t* codes, int64_t r, Coded c, const QuantMap& q) {
    alignas(64) uint8_t tail[W];
    alignas(64) float x[W] = {0};
    __builtin_memcpy(x, buf, r * 4);
    V::encode(tail, V::load(x), c.inv, q);
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
