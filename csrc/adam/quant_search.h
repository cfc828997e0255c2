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

// P of y in region r (in 1 / kPosUnit code steps, from code 0), one fused multiply-subtract, as the kernel does.
static inline float quant_pos(const QuantMap& q, int r, float y) { return std::fma(y, q.pos_scale[r], -q.pos_offset[r]); }

// The arithmetic search: the code of +y (zero + k), and whether P rounded to a multiple of kPosUnit (then k may be
// off and exact_k decides). P is never negative (checked when the maps are built), so the shift is a floor.
static inline int quick_code(const QuantMap& q, float y, bool* deferred) {
  const int r = quant_region(q, y);
  const int32_t u = static_cast<int32_t>(std::nearbyint(quant_pos(q, r, y)));
  *deferred = (u & (kPosUnit - 1)) == 0;
  const int c = u >> kPosBits;
  return c < q.region_code_max[r] ? c : q.region_code_max[r];
}

// The AVX2 kernel's arithmetic search (quant.h): the same as quick_code, with the 8-entry tables (by r % 8) and the
// clamp of its int8 Adam encode (code_max16, by r % 16).
static inline int quick_code8(const QuantMap& q, float y, bool* deferred) {
  const uint32_t bits = scalar_ops::f32_bits(y), pair = bits >> 24;
  const int below = q.pair_below[pair > kPairBase ? pair - kPairBase : 0];
  const int r = below + (y > q.mid8[below & 7]), line = r & 7;
  const int32_t u = static_cast<int32_t>(std::nearbyint(std::fma(y, q.pos_scale8[line], -q.pos_offset8[line])));
  *deferred = (u & (kPos8Unit - 1)) <= kPos8Window;
  const int c = u >> kPos8Bits, code_max = q.code_max16[r & 15];
  return c < code_max ? c : code_max;
}

// The AVX2 kernel's decode of a code (before the block scale): rank * B + C in one rounding, B and C the 8-entry
// tables' at the low 3 bits of float(rank)'s exponent field. The signed map's kernel takes r = 4 (code - zero),
// exact in float and signed, and computes r * B + (C with r's sign) = sign * (|r| * B + C) (quant.cpp's tables):
// the zero code's r = +0 meets the line B = 1/512, C = 0 and gives +0.
static inline float decode8(const QuantMap& q, int code) {
  if (q.is_signed) {
    const float r = std::fma(static_cast<float>(code), 4.0f, -4.0f * static_cast<float>(q.zero));
    const uint32_t bits = scalar_ops::f32_bits(r);
    const int slot = static_cast<int>(bits >> 23) & 7;
    const float c = scalar_ops::f32_from_bits(scalar_ops::f32_bits(q.rank_offset8[slot]) ^ (bits & 0x80000000u));
    return std::fma(r, q.rank_scale8[slot], c);
  }
  const float rf = static_cast<float>(code + 1);
  const int slot = static_cast<int>(scalar_ops::f32_bits(rf) >> 23) & 7;
  return std::fma(rf, q.rank_scale8[slot], q.rank_offset8[slot]);
}

}  // namespace adam
}  // namespace swapio
