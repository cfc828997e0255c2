// Builds the dynamic-tree maps of quant.h (baseline code, once).
#include "adam/quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace swapio {
namespace adam {
namespace {

// Positive magnitudes of a map, ascending, starting with 0 and ending with 1: per decade i (values
// 10^(i-6) * [0.1, 1)), `per_decade(i)` evenly spaced means of the intervals that split [0.1, 1] into that
// many parts. Computed in double, rounded to float once (the Python reference does the same).
std::vector<float> magnitudes(bool is_signed) {
  static const double kDecade[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  std::vector<float> mags{0.0f};
  for (int i = 0; i < 7; ++i) {
    const int parts = is_signed ? (1 << i) : (2 << i);
    for (int j = 0; j < parts; ++j) {
      const double mean = 0.1 + 0.9 * (j + 0.5) / parts;
      mags.push_back(static_cast<float>(kDecade[i] * mean));
    }
  }
  mags.push_back(1.0f);
  return mags;  // signed: 1 + 127 + 1 = 129 values; unsigned: 1 + 254 + 1 = 256
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
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
  const float inf = std::numeric_limits<float>::infinity();
  for (int k = 0; k < 256; ++k) q.mid[k] = k < max_k ? (mags[k] + mags[k + 1]) / 2.0f : inf;
  q.search_depth = is_signed ? 7 : 8;
  const int slots = 1 << q.search_depth;
  for (int r = 0; r < 8; ++r) {
    const int stride = r < q.search_depth ? 1 << (q.search_depth - r) : 0;
    for (int t = 0; t < 128; ++t) q.search[r][t] = t < (1 << r) && stride ? q.mid[(2 * t + 1) * stride / 2 - 1] : inf;
  }
  q.search_last = q.mid[slots - 1];
  // count of midpoints strictly below y
  auto below = [&](float y) { return static_cast<int>(std::lower_bound(q.mid, q.mid + max_k, y) - q.mid); };
  b.valid = true;
  for (int idx = 0; idx < kBuckets; ++idx) {
    const uint32_t key = kBucketKeyMin + static_cast<uint32_t>(idx);
    const float lo = idx == 0 ? 0.0f : from_bits(key << 16);
    const float hi = key == kBucketKeyMax ? 1.0f : from_bits((key << 16) | 0xFFFFu);
    const int first = below(lo);
    uint32_t low = 0xFFFFu;  // no midpoint in the bucket: y > mid[first] for none of its values
    if (below(hi) > first) {  // mid[first] lies in (lo, hi]: compare low halves (same top half)
      const uint32_t mid_bits = bits_of(q.mid[first]);
      if (mid_bits >> 16 != key || idx == 0) b.valid = false;
      low = mid_bits & 0xFFFFu;
    }
    if (below(hi) - first > 1) b.valid = false;  // one comparison must settle every y of the bucket
    q.bucket[idx] = static_cast<uint32_t>(first) << 16 | low;
  }
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
