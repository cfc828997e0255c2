#pragma once
// The loops of the Adafactor passes (adafactor_kernel.h), written once over the vector type V of each per-ISA
// file (the V of lowp_loops.h, plus clamp_min), in an anonymous namespace so that every instantiation has
// internal linkage and that file's flags only (see adam_variants.h).
//
// Bit-identical across levels: element-wise operations are the same correctly rounded operations at every
// level; every sum runs over 16 canonical lanes (lane k holds the elements k, k+16, k+32, ... of a row or
// block, in order, by fused multiply-add), kept as 16/W vectors of W lanes, and its lanes are added in one
// fixed tree. A tail shorter than 16 goes through zero-padded stack copies and the same vector code.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "adam/adafactor_kernel.h"

#ifndef SWAPIO_INLINE
#define SWAPIO_INLINE inline __attribute__((always_inline))
#endif

namespace swapio {
namespace adam {
namespace afactor {
namespace {  // one copy per including (per-ISA) file

constexpr int kLanes = 16;

constexpr int64_t size_of(DType t) { return t == DType::kF32 ? 4 : (t == DType::kNone ? 0 : 2); }

template <class V>
struct Sum16 {
  using F = typename V::F;
  static constexpr int K = kLanes / V::W;
  F acc[K];
  SWAPIO_INLINE Sum16() {
    for (int k = 0; k < K; ++k) acc[k] = V::set1(0.0f);
  }
  SWAPIO_INLINE void add_sq(int k, F x) { acc[k] = V::fma(x, x, acc[k]); }
  float total() const {
    alignas(64) float lane[kLanes];
    for (int k = 0; k < K; ++k) V::store(lane + k * V::W, acc[k]);
    for (int w = kLanes / 2; w >= 1; w /= 2) {
      for (int i = 0; i < w; ++i) lane[i] = lane[i] + lane[i + w];
    }
    return lane[0];
  }
};

// 16 elements (or a zero-padded tail of them) of a row or block: pointers to their first element.
struct Tile {
  float* p;
  const void* g;
  void* out;
  const float* c;  // factored: column factors
  float* v;        // vector: the second moment
};

template <class V, DType G, DType O>
struct Loops {
  using F = typename V::F;
  static constexpr int W = V::W;
  static constexpr int K = kLanes / W;
  static constexpr int64_t gs = size_of(G), os = size_of(O);

  static SWAPIO_INLINE F grad(const AdafactorArgs& a, const void* g) {
    F x = V::template load_grad<G>(g);
    return a.grad_sign ? V::flip(x, a.grad_sign) : x;
  }
  // u = g / sqrt(max(v, eps1^2))
  static SWAPIO_INLINE F update(const AdafactorArgs& a, F g, F v) {
    return V::div(g, V::sqrt(V::clamp_min(v, V::set1(a.eps1_sq))));
  }
  static SWAPIO_INLINE F apply(const AdafactorArgs& a, F p, F u) {
    if (a.decayed) p = V::mul(p, V::set1(a.decay));
    return V::fma(u, V::set1(a.neg_scale), p);
  }
  static SWAPIO_INLINE F lerp(const AdafactorArgs& a, F v, F e) {  // ATen's lerp with a scalar weight
    F d = V::sub(e, v);
    return a.w_small ? V::fma(V::set1(a.w), d, v) : V::fma(V::set1(a.w_minus_1), d, e);
  }

  // ---- one tile of 16 elements, per pass -------------------------------------------------------------------
  static SWAPIO_INLINE void reduce_tile(const AdafactorArgs&, const Tile& t, Sum16<V>& gs2, Sum16<V>& ps2,
                                        float* col) {
    for (int k = 0; k < K; ++k) {
      F g = V::template load_grad<G>(static_cast<const char*>(t.g) + k * W * gs);
      F p = V::load(t.p + k * W);
      gs2.add_sq(k, g);
      ps2.add_sq(k, p);
      V::store(col + k * W, V::fma(g, g, V::load(col + k * W)));
    }
  }
  // u = g / max(sqrt(row factor) * sqrt(col factor), a.eps1): the square roots per row and per column, not per
  // element (sqrt(max(v, e)) = max(sqrt(v), sqrt(e)), a.eps1 = sqrt(float(eps1^2))); NaN and inf go as with
  // torch's rsqrt(max(v, eps1^2)) * g
  static SWAPIO_INLINE void factor_u(const AdafactorArgs& a, const Tile& t, F scale, F* u) {
    for (int k = 0; k < K; ++k) {
      F g = grad(a, static_cast<const char*>(t.g) + k * W * gs);
      u[k] = V::div(g, V::clamp_min(V::mul(scale, V::load(t.c + k * W)), V::set1(a.eps1)));
    }
  }
  static SWAPIO_INLINE void vector_u(const AdafactorArgs& a, const Tile& t, F* u, bool store_v) {
    for (int k = 0; k < K; ++k) {
      F g = grad(a, static_cast<const char*>(t.g) + k * W * gs);
      F v = V::load(t.v + k * W);
      if (store_v) {
        v = lerp(a, v, V::mul(g, g));
        V::store(t.v + k * W, v);
      }
      u[k] = update(a, g, v);
    }
  }
  static SWAPIO_INLINE void apply_tile(const AdafactorArgs& a, const Tile& t, const F* u) {
    for (int k = 0; k < K; ++k) {
      F p = apply(a, V::load(t.p + k * W), u[k]);
      V::store(t.p + k * W, p);
      if constexpr (O != DType::kNone) V::template store_out<O>(static_cast<char*>(t.out) + k * W * os, p);
    }
  }

  // Zero-padded copies of the last n < 16 elements (c padded with 1, so padded lanes never divide 0 by 0).
  struct Tail {
    alignas(64) float p[kLanes];
    alignas(64) unsigned char g[kLanes * 4];
    alignas(64) unsigned char out[kLanes * 4];
    alignas(64) float c[kLanes];
    alignas(64) float v[kLanes];
    Tile tile;
    Tail(const AdafactorArgs& a, int64_t i, int64_t col0, int64_t n) {
      std::memset(p, 0, sizeof p);
      std::memset(g, 0, sizeof g);
      std::memset(out, 0, sizeof out);
      std::memset(v, 0, sizeof v);
      for (int k = 0; k < kLanes; ++k) c[k] = 1.0f;
      std::memcpy(p, a.param + i, n * 4);
      std::memcpy(g, static_cast<const char*>(a.grad) + i * gs, n * gs);
      if (a.col_var) std::memcpy(c, a.col_var + col0, n * 4);
      if (a.variance) std::memcpy(v, a.variance + i, n * 4);
      tile = Tile{p, g, out, c, v};
    }
    void store(const AdafactorArgs& a, int64_t i, int64_t n, bool param, bool variance) const {
      if (param) {
        std::memcpy(a.param + i, p, n * 4);
        if constexpr (O != DType::kNone) std::memcpy(static_cast<char*>(a.param_out) + i * os, out, n * os);
      }
      if (variance) std::memcpy(a.variance + i, v, n * 4);
    }
  };

  static Tile at(const AdafactorArgs& a, int64_t i, int64_t col0) {
    return Tile{a.param + i, static_cast<const char*>(a.grad) + i * gs,
                os ? static_cast<char*>(a.param_out) + i * os : nullptr, a.col_var ? a.col_var + col0 : nullptr,
                a.variance ? a.variance + i : nullptr};
  }

  // u^2 of the real lanes only: a tail's padded lanes are zeroed before they are summed
  static SWAPIO_INLINE void add_u2(Sum16<V>& s, const F* u, int64_t real) {
    if (real == kLanes) {
      for (int k = 0; k < K; ++k) s.add_sq(k, u[k]);
      return;
    }
    alignas(64) float lane[kLanes];
    for (int k = 0; k < K; ++k) V::store(lane + k * W, u[k]);
    for (int64_t k = real; k < kLanes; ++k) lane[k] = 0.0f;
    for (int k = 0; k < K; ++k) s.add_sq(k, V::load(lane + k * W));
  }

  // ---- the passes --------------------------------------------------------------------------------------------
  static void factor_reduce(const AdafactorArgs& a, int64_t begin, int64_t end) {
    const int64_t R = a.rows_per_batch, C = a.cols, nb = a.blocks_per_batch;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nb, blk = task % nb;
      float* col = a.col_part + task * C;
      std::memset(col, 0, C * 4);
      const int64_t r0 = b * R + blk * kFactorRowBlock, r1 = b * R + std::min(R, (blk + 1) * kFactorRowBlock);
      for (int64_t r = r0; r < r1; ++r) {
        Sum16<V> g2, p2;
        const int64_t row = r * C;
        int64_t j = 0;
        for (; j + kLanes <= C; j += kLanes) reduce_tile(a, at(a, row + j, 0), g2, p2, col + j);
        if (j < C) {
          Tail t(a, row + j, 0, C - j);
          alignas(64) float part[kLanes] = {};
          std::memcpy(part, col + j, (C - j) * 4);
          reduce_tile(a, t.tile, g2, p2, part);
          std::memcpy(col + j, part, (C - j) * 4);
        }
        a.row_sumsq[r] = g2.total();
        a.param_sumsq[r] = p2.total();
      }
    }
  }

  template <bool kApply>
  static void factor_rows(const AdafactorArgs& a, int64_t begin, int64_t end) {
    const int64_t R = a.rows_per_batch, C = a.cols;
    F u[K];
    for (int64_t r = begin; r < end; ++r) {
      const F scale = V::set1(a.row_scale[r]);
      const int64_t row = r * C, col0 = (r / R) * C;
      Sum16<V> u2;
      int64_t j = 0;
      for (; j + kLanes <= C; j += kLanes) {
        const Tile t = at(a, row + j, col0 + j);
        factor_u(a, t, scale, u);
        if constexpr (kApply) apply_tile(a, t, u);
        else add_u2(u2, u, kLanes);
      }
      if (j < C) {
        Tail t(a, row + j, col0 + j, C - j);
        factor_u(a, t.tile, scale, u);
        if constexpr (kApply) {
          apply_tile(a, t.tile, u);
          t.store(a, row + j, C - j, true, false);
        } else {
          add_u2(u2, u, C - j);
        }
      }
      if constexpr (!kApply) a.row_sumsq[r] = u2.total();
    }
  }

  template <bool kApply>
  static void vector_blocks(const AdafactorArgs& a, int64_t begin, int64_t end) {
    F u[K];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t i0 = blk * kVectorBlock, i1 = std::min(a.n, i0 + kVectorBlock);
      Sum16<V> u2, p2;
      int64_t i = i0;
      for (; i + kLanes <= i1; i += kLanes) {
        const Tile t = at(a, i, 0);
        if constexpr (kApply) {
          vector_u(a, t, u, false);
          apply_tile(a, t, u);
        } else {
          for (int k = 0; k < K; ++k) p2.add_sq(k, V::load(t.p + k * W));
          vector_u(a, t, u, true);
          add_u2(u2, u, kLanes);
        }
      }
      if (i < i1) {
        Tail t(a, i, 0, i1 - i);
        if constexpr (kApply) {
          vector_u(a, t.tile, u, false);
          apply_tile(a, t.tile, u);
          t.store(a, i, i1 - i, true, false);
        } else {
          for (int k = 0; k < K; ++k) p2.add_sq(k, V::load(t.tile.p + k * W));
          vector_u(a, t.tile, u, true);
          add_u2(u2, u, i1 - i);
          t.store(a, i, i1 - i, false, true);
        }
      }
      if constexpr (!kApply) {
        a.row_sumsq[blk] = u2.total();
        a.param_sumsq[blk] = p2.total();
      }
    }
  }

  static void run(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end) {
    switch (pass) {
      case AdafactorPass::kFactorReduce: return factor_reduce(a, begin, end);
      case AdafactorPass::kFactorNorm: return factor_rows<false>(a, begin, end);
      case AdafactorPass::kFactorApply: return factor_rows<true>(a, begin, end);
      case AdafactorPass::kVectorNorm: return vector_blocks<false>(a, begin, end);
      case AdafactorPass::kVectorApply: return vector_blocks<true>(a, begin, end);
    }
  }
};

template <class V, DType G>
void run_with_out(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end) {
  const bool writes = pass == AdafactorPass::kFactorApply || pass == AdafactorPass::kVectorApply;
  switch (writes ? a.out_dtype : DType::kNone) {
    case DType::kF32: return Loops<V, G, DType::kF32>::run(a, pass, begin, end);
    case DType::kBF16: return Loops<V, G, DType::kBF16>::run(a, pass, begin, end);
    case DType::kF16: return Loops<V, G, DType::kF16>::run(a, pass, begin, end);
    default: return Loops<V, G, DType::kNone>::run(a, pass, begin, end);
  }
}

template <class V>
void run(const AdafactorArgs& a, AdafactorPass pass, int64_t begin, int64_t end) {
  switch (a.grad_dtype) {
    case DType::kBF16: return run_with_out<V, DType::kBF16>(a, pass, begin, end);
    case DType::kF16: return run_with_out<V, DType::kF16>(a, pass, begin, end);
    default: return run_with_out<V, DType::kF32>(a, pass, begin, end);
  }
}

}  // namespace
}  // namespace afactor
}  // namespace adam
}  // namespace swapio
