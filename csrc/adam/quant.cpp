// Builds the dynamic-tree maps of quant.h (baseline code, once).
#include "adam/quant.h"

#include "adam/quant_search.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace swapio {
namespace adam {
namespace {

constexpr double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};

// Magnitudes of decade i of a map: more in the upper decades, twice as many in the unsigned map.
int parts_of(bool is_signed, int i) { return is_signed ? 1 << i : 2 << i; }

// The rank tables' entry of a rank's binade (quant.h): the low 4 bits of the binade's float exponent field.
int rank_slot(int rank) { return (127 + std::ilogb(static_cast<double>(rank))) & 15; }

// Decade i of a map holds parts_of(i) magnitudes, 10^(i-6) times the evenly spaced means of the intervals that
// split [0.1, 1] into that many parts. They are numbered by rank = k + rank_bias (quant.h), which starts the
// decade at rank parts_of(i), a power of two: so the rank's binade names the decade, and the magnitude is linear
// in the rank, decade * (0.1 + 0.9 * (rank - parts + 0.5) / parts) = rank * B + C. The map's value is that line
// in float32, B and C rounded to float once and rank * B + C rounded once (the product and the sum are exact in
// double, so this is what one fused multiply-add gives): the AVX-512 kernel decodes by arithmetic, and the
// values lie within a few float32 ulps of the decimal formula. (bitsandbytes builds the same formula in float32
// torch operations, which round differently again.) The Python reference (swapio/quant.py) does the same.
void build_decades(QuantMap& q) {
  for (int slot = 0; slot < 16; ++slot) q.rank_scale[slot] = q.rank_offset[slot] = 0.0f;  // unsigned rank 1: 0
  for (int i = 0; i < 7; ++i) {
    const int parts = parts_of(q.is_signed, i);
    const int slot = rank_slot(parts);
    q.rank_scale[slot] = static_cast<float>(0.9 * kDecade[i] / parts);
    q.rank_offset[slot] = static_cast<float>(kDecade[i] * (0.45 / parts - 0.8));
  }
  q.rank_offset[rank_slot(q.max_k + q.rank_bias)] = 1.0f;  // the last magnitude, a binade of its own
  // AVX2: the same lines by the low 3 bits of the exponent field, where ranks 1 .. max_k + rank_bias fall into
  // 8 slots, except the unsigned map's 9 binades: its ranks 1 (0.0) and 256 (1.0) share a slot, whose line
  // B = float(1/255), C = -B gives 0 at rank 1 exactly and rounds 255 B to 1.0 (checked in build()).
  // The signed map's kernel converts 4 (code - zero) instead, sign included (quant_search.h's decode8): its
  // binades put ranks 1 .. 127 in slots 1 .. 7 and rank 128 (1.0) in slot 0 with the zero code, whose line
  // B = 1/512, C = 0 gives both exactly; B / 4 is exact, so 4 rank * B / 4 + C rounds as rank * B + C.
  for (int rank = 1; rank <= q.max_k + q.rank_bias; rank *= 2) {
    const int slot = rank_slot(q.is_signed ? 4 * rank : rank) & 7;
    q.rank_scale8[slot] = q.rank_scale[rank_slot(rank)] / (q.is_signed ? 4 : 1);
    q.rank_offset8[slot] = q.rank_offset[rank_slot(rank)];
  }
  if (q.is_signed) {
    q.rank_scale8[rank_slot(4 * q.max_k) & 7] = 1.0f / static_cast<float>(4 * q.max_k);
    q.rank_offset8[rank_slot(4 * q.max_k) & 7] = 0.0f;
  } else {
    const int top = q.max_k + q.rank_bias;
    q.rank_scale8[rank_slot(1) & 7] = static_cast<float>(1.0 / (top - 1));
    q.rank_offset8[rank_slot(1) & 7] = -q.rank_scale8[rank_slot(1) & 7];
  }
}

// The positive magnitudes k = 0 .. max_k, ascending from 0 to 1.
std::vector<float> magnitudes(const QuantMap& q) {
  std::vector<float> mags{0.0f};
  for (int k = 1; k <= q.max_k; ++k) {
    const int rank = k + q.rank_bias, slot = rank_slot(rank);
    mags.push_back(static_cast<float>(rank * static_cast<double>(q.rank_scale[slot]) + q.rank_offset[slot]));
  }
  return mags;  // signed: 1 + 127 + 1 = 129 values; unsigned: 1 + 254 + 1 = 256
}

// The AVX2 kernel's 8-entry tables of the code search (quant.h), from the region midpoints and the lines of
// build_regions.
void build_regions8(QuantMap& q, const float (&region)[8], const int (&first)[8], bool& valid) {
  const float to8 = static_cast<float>(kPos8Unit / kPosUnit);  // a power of two: the lines scaled exactly
  for (int r = 0; r < 8; ++r) {  // line 0: regions 0 and 8
    q.mid8[r] = region[r];
    q.pos_scale8[r] = r == 0 ? 512.0f * kPos8Unit : q.pos_scale[r] * to8;
    q.pos_offset8[r] = r == 0 ? -(q.zero + 0.5f) * kPos8Unit : q.pos_offset[r] * to8;
    q.code_max8[r] = r == 0 ? q.zero + q.max_k : q.region_code_max[r];
  }
  for (int d = 0; d < 7; ++d) {  // quant.h's kPos8Window
    const int code0 = q.zero + first[d];
    auto p8 = [&](float y) { return std::nearbyint(std::fma(y, q.pos_scale8[d + 1], -q.pos_offset8[d + 1])); };
    if (p8(region[d]) < static_cast<float>(code0) * kPos8Unit) valid = false;
    for (int t = 1; t < first[d + 1] - first[d]; ++t) {
      const double above = p8(q.mid[first[d] + t - 1]) - static_cast<double>(code0 + t) * kPos8Unit;
      if (above < 0 || above > kPos8Window) valid = false;
    }
  }
  // region 0 (y <= region[0]) must stay below zero + 1, region 8 (y > region[7]) reach zero + max_k
  if (512.0 * region[0] >= 0.5 || 512.0 * region[7] + 0.5 < q.max_k) valid = false;
  for (int t = 0; t < 16; ++t) {  // pair t: exponent fields 2 (t + kPairBase) and one more; all below for t = 0
    const uint32_t e = 2 * (kPairBase + static_cast<uint32_t>(t));
    const float lo = t == 0 ? 0.0f : scalar_ops::f32_from_bits(e << 23), hi = scalar_ops::f32_from_bits((e + 2) << 23);
    int below = 0, inside = 0;
    for (float m : region) below += m < lo, inside += m >= lo && m < hi;
    q.pair_below[t] = static_cast<uint8_t>(below + (t > 0 && !q.is_signed ? 8 : 0));  // (quant.h)
    // one comparison settles the pair; mid8[below] exists; entry 0 is 0 (the kernel's vpshufb reads it for the
    // other three bytes of each lane)
    if (inside > 1 || below > 7 || (t == 0 && below != 0)) valid = false;
  }
}

// The tables of the arithmetic search (quant.h). Decade d's magnitudes are k = first(d) .. first(d) + parts(d) - 1;
// the region midpoints are mid[first(d) - 1] for d = 0 .. 7 (first(7) = max_k: the midpoint below 1).
void build_regions(QuantMap& q, bool& valid) {
  const float inf = std::numeric_limits<float>::infinity();
  int first[8];
  first[0] = 1;
  for (int d = 0; d < 7; ++d) first[d + 1] = first[d] + parts_of(q.is_signed, d);
  float region[8];
  for (int d = 0; d < 8; ++d) region[d] = q.mid[first[d] - 1];
  // P counts in units of 1 / kPosUnit from code 0, so that rint(P) / kPosUnit is the code itself
  for (int r = 0; r < kRegions; ++r) {  // regions 0 and 8 (and the padding): P = (code + 1/2) kPosUnit
    const int code = q.zero + (r == 0 ? 0 : q.max_k);
    q.pos_scale[r] = 0.0f;
    q.pos_offset[r] = -(code + 0.5f) * kPosUnit;
    q.region_code_max[r] = code;
  }
  for (int d = 0; d < 7; ++d) {
    const int parts = first[d + 1] - first[d], code0 = q.zero + first[d];
    q.pos_scale[d + 1] = static_cast<float>(kPosUnit * parts / (0.9 * kDecade[d]));
    q.pos_offset[d + 1] = static_cast<float>(kPosUnit * (0.1 * parts / 0.9 - code0));
    q.region_code_max[d + 1] = code0 + parts - 1;
    // every y of the region lies above region[d]: P >= code0 * kPosUnit
    if (quant_pos(q, d + 1, region[d]) < static_cast<float>(code0 * kPosUnit)) valid = false;
    for (int t = 1; t < parts; ++t) {  // inner midpoint t of the decade
      const float u = std::nearbyint(quant_pos(q, d + 1, q.mid[first[d] + t - 1]));
      if (u != static_cast<float>((code0 + t) * kPosUnit)) valid = false;
    }
  }
  for (int b = 0; b < kRegionBinades; ++b) {  // binade b: [lo, hi), all y below 2^-30 for b = 0
    const uint32_t e = kRegionExpBase + static_cast<uint32_t>(b);
    const float lo = b == 0 ? 0.0f : scalar_ops::f32_from_bits(e << 23), hi = scalar_ops::f32_from_bits((e + 1) << 23);
    int below = 0, inside = 0;
    q.region_mid[b] = inf;
    for (float m : region) {
      below += m < lo;
      if (m >= lo && m < hi) q.region_mid[b] = m, ++inside;
    }
    q.region_below[b] = below;
    if (inside > 1) valid = false;  // one comparison must settle every y of the binade
  }
  build_regions8(q, region, first, valid);
}

struct Built {
  QuantMap map;
  bool valid;
};

Built build(bool is_signed) {
  Built b{};
  QuantMap& q = b.map;
  q.is_signed = is_signed;
  q.max_k = is_signed ? 128 : 255;
  q.max_neg_k = is_signed ? q.max_k - 1 : 0;
  q.zero = is_signed ? q.max_neg_k : 0;
  q.rank_bias = is_signed ? 0 : 1;
  build_decades(q);
  const std::vector<float> mags = magnitudes(q);
  const int max_k = q.max_k;
  b.valid = true;
  for (int k = 0; k <= max_k; ++k) q.code[q.zero + k] = mags[k];
  for (int k = 1; k <= q.max_neg_k; ++k) q.code[q.zero - k] = -mags[k];
  const float inf = std::numeric_limits<float>::infinity();
  for (int k = 0; k < 256; ++k) q.mid[k] = k < max_k ? (mags[k] + mags[k + 1]) / 2.0f : inf;
  // count of midpoints strictly below y
  auto below = [&](float y) { return static_cast<int>(std::lower_bound(q.mid, q.mid + max_k, y) - q.mid); };
  for (int idx = 0; idx < kBuckets; ++idx) {
    const uint32_t key = kBucketKeyMin + static_cast<uint32_t>(idx);
    const float lo = idx == 0 ? 0.0f : scalar_ops::f32_from_bits(key << 16);
    const float hi = key == kBucketKeyMax ? 1.0f : scalar_ops::f32_from_bits((key << 16) | 0xFFFFu);
    const int first = below(lo);
    uint32_t low = 0xFFFFu;  // no midpoint in the bucket: y > mid[first] for none of its values
    if (below(hi) > first) {  // mid[first] lies in (lo, hi]: compare low halves (same top half)
      const uint32_t mid_bits = scalar_ops::f32_bits(q.mid[first]);
      if (mid_bits >> 16 != key || idx == 0) b.valid = false;
      low = mid_bits & 0xFFFFu;
    }
    if (below(hi) - first > 1) b.valid = false;  // one comparison must settle every y of the bucket
    q.bucket[idx] = static_cast<uint32_t>(first) << 16 | low;
  }
  build_regions(q, b.valid);
  if (is_signed && (q.zero != kSignedZero || q.max_neg_k != kSignedMaxNegK)) b.valid = false;
  for (int c = 0; c < 256; ++c) {  // the AVX2 decode gives every code's value, bit for bit
    if (scalar_ops::f32_bits(decode8(q, c)) != scalar_ops::f32_bits(q.code[c])) b.valid = false;
  }
  return b;
}

struct Maps {
  Built s, u;
};

// Both maps, and their shared clamp table code_max16 (quant.h).
Maps build_maps() {
  Maps b{build(true), build(false)};
  for (QuantMap* q : {&b.s.map, &b.u.map}) {
    for (int r = 0; r < 8; ++r) {
      q->code_max16[r] = static_cast<uint8_t>(b.s.map.code_max8[r]);
      q->code_max16[8 + r] = static_cast<uint8_t>(b.u.map.code_max8[r]);
    }
  }
  // the signed map's region 8 reads entry 8: both maps' line 0 must clamp alike; every clamp fits a byte
  auto bytes = [](const QuantMap& q) {
    return std::all_of(q.code_max8, q.code_max8 + 8, [](int32_t c) { return c >= 0 && c < 256; });
  };
  const bool fits = b.s.map.code_max8[0] == b.u.map.code_max8[0] && bytes(b.s.map) && bytes(b.u.map);
  b.s.valid = b.s.valid && fits;
  b.u.valid = b.u.valid && fits;
  return b;
}

const Built& built(bool is_signed) {
  static const Maps b = build_maps();
  return is_signed ? b.s : b.u;
}

}  // namespace

const QuantMap& signed_map() { return built(true).map; }
const QuantMap& unsigned_map() { return built(false).map; }
bool quant_maps_valid() { return built(true).valid && built(false).valid; }

}  // namespace adam
}  // namespace swapio
