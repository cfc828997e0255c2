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

// Positive magnitudes of a map, ascending, starting with 0 and ending with 1: per decade i (values
// 10^(i-6) * [0.1, 1)), parts_of(i) evenly spaced means of the intervals that split [0.1, 1] into that
// many parts. Computed in double, rounded to float once (the Python reference does the same).
std::vector<float> magnitudes(bool is_signed) {
  std::vector<float> mags{0.0f};
  for (int i = 0; i < 7; ++i) {
    const int parts = parts_of(is_signed, i);
    for (int j = 0; j < parts; ++j) {
      const double mean = 0.1 + 0.9 * (j + 0.5) / parts;
      mags.push_back(static_cast<float>(kDecade[i] * mean));
    }
  }
  mags.push_back(1.0f);
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
  for (int r = 0; r < kRegions; ++r) {  // regions 0 and 8 (and the padding): P = kPosUnit / 2, k = 0 or max_k
    q.pos_scale[r] = 0.0f;
    q.pos_offset[r] = -0.5f * kPosUnit;
    q.region_code0[r] = q.region_code_max[r] = q.zero + (r == 0 ? 0 : q.max_k);
  }
  for (int d = 0; d < 7; ++d) {
    const int parts = first[d + 1] - first[d];
    q.pos_scale[d + 1] = static_cast<float>(kPosUnit * parts / (0.9 * kDecade[d]));
    q.pos_offset[d + 1] = static_cast<float>(kPosUnit * 0.1 * parts / 0.9);
    q.region_code0[d + 1] = q.zero + first[d];
    q.region_code_max[d + 1] = q.zero + first[d] + parts - 1;
    if (quant_pos(q, d + 1, region[d]) < 0.0f) valid = false;  // every y of the region lies above region[d]
    for (int t = 1; t < parts; ++t) {  // inner midpoint t of the decade
      const float u = std::nearbyint(quant_pos(q, d + 1, q.mid[first[d] + t - 1]));
      if (u != static_cast<float>(t * kPosUnit)) valid = false;
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
  const std::vector<float> mags = magnitudes(is_signed);
  const int max_k = static_cast<int>(mags.size()) - 1;
  q.is_signed = is_signed;
  q.max_k = max_k;
  q.max_neg_k = is_signed ? max_k - 1 : 0;
  q.zero = is_signed ? q.max_neg_k : 0;
  for (int k = 0; k <= max_k; ++k) q.code[q.zero + k] = mags[k];
  for (int k = 1; k <= q.max_neg_k; ++k) q.code[q.zero - k] = -mags[k];
  if (is_signed) {
    for (int k = 1; k <= max_k; ++k) q.magnitude[k % 128] = mags[k];
    if (max_k != 128) b.valid = false;
  }
  const float inf = std::numeric_limits<float>::infinity();
  for (int k = 0; k < 256; ++k) q.mid[k] = k < max_k ? (mags[k] + mags[k + 1]) / 2.0f : inf;
  // count of midpoints strictly below y
  auto below = [&](float y) { return static_cast<int>(std::lower_bound(q.mid, q.mid + max_k, y) - q.mid); };
  b.valid = true;
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
