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
  return b;
}

const Built& built(bool is_signed) {
  static const Built s = build(true);
  static const Built u = build(false);
  return is_signed ? s : u;
}

}  // namespace

const QuantMap& signed_map() { return built(true).map; }
const QuantMap& unsigned_map() { return built(false).map; }
bool quant_maps_valid() { return built(true).valid && built(false).valid; }

}  // namespace adam
}  // namespace swapio
