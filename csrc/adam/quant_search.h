#pragma once
// The two searches of quant.h for the magnitude index k of y in [0, 1], in scalar code: the bucket lookup
// (exact; the scalar and AVX2 kernels, and the AVX-512 kernel's rare lanes within the band) and the arithmetic
// one (what the AVX-512 kernel computes per lane; here for the map builder's checks and the tests).
// static inline: each per-ISA file that includes this gets its own copy, built with its own flags.
#include "adam/adam_scalar_ops.h"
#include "adam/quant.h"

namespace swapio {
namespace adam {

// The count of midpoints strictly below y (ties toward zero).
static inline int exact_k(const QuantMap& q, float y) {
  const uint32_t bits = scalar_ops::f32_bits(y), key = bits >> 16;
  const uint32_t entry = q.bucket[key > kBucketKeyMin ? key - kBucketKeyMin : 0];
  return static_cast<int>((entry >> 16) + ((bits & 0xFFFFu) > (entry & 0xFFFFu)));
}

static inline int quant_region(const QuantMap& q, float y) {
  const uint32_t e = scalar_ops::f32_bits(y) >> 23;
  const uint32_t b = e > kRegionExpBase ? e - kRegionExpBase : 0;
  return q.region_below[b] + (y > q.region_mid[b]);
}

// pos of y in region r, rounded after the multiply and after the subtraction, as the kernel does.
static inline float quant_pos(const QuantMap& q, int r, float y) { return scalar_ops::rounded(y * q.pos_scale[r]) - q.pos_offset[r]; }

// The arithmetic search: k, and whether y fell within the band (then k may be off and exact_k decides).
static inline int quick_k(const QuantMap& q, float y, bool* in_band) {
  const int r = quant_region(q, y);
  const float pos = quant_pos(q, r, y);
  *in_band = std::fabs(pos - std::nearbyint(pos)) <= kPosBand;
  int c = static_cast<int>(std::ceil(pos));
  c = c < 1 ? 1 : (c > q.region_parts[r] ? q.region_parts[r] : c);
  return q.region_first[r] + c;
}

}  // namespace adam
}  // namespace swapio
