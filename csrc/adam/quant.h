#pragma once
// 8-bit dynamic-tree quantisation of optimizer moments, block-wise (Dettmers et al., "8-bit Optimizers via
// Block-wise Quantization", ICLR 2022; the scheme of bitsandbytes' and torchao's 8-bit Adam): each block of
// kQuantBlock elements keeps its absolute maximum A as an fp32 scale and each element an 8-bit code whose value
// times A is the moment. The 256 code values are 0, 1 and, per decade 10^-6 .. 10^0, evenly spaced means
// between 0.1 and 1 times the decade, more of them in the upper decades: a float-like map with ~3 significant
// bits near 1 and 7 decades of range. The signed map (first moments) spends one bit on the sign (127 values
// each side, +1 but no -1); the unsigned map (second moments, never negative) has 254 positive values.
//
// Quantising x with scale A: y = |x| * (1/A), clamped to 1; the nearest magnitude k (ties toward zero) is
// found with one table load: y's top 16 bits pick a bucket, which holds at most one midpoint between codes;
// the bucket's entry is (magnitudes below the bucket) << 16 | (low 16 bits of its midpoint, or 0xFFFF when it
// has none), and k = entry >> 16, plus one when y's low 16 bits exceed the entry's.
// The SIMD kernels, where gathers are slow (CPUs with the Gather Data Sampling microcode fix), find the same k
// by arithmetic (quant_search.h): y's binade says how many region midpoints (those around 0, between decades,
// and below 1) lie below it, up to one comparison with the region midpoint inside that binade; within a decade
// the magnitudes are evenly spaced, so P = y * pos_scale - pos_offset (one fused rounding), rounded to an integer
// u, puts the decade's t-th inner midpoint at u = (code0 + t) * kPosUnit exactly, code0 being the code of the
// decade's first magnitude (checked when the maps are built). P only grows with y, so every y above that midpoint
// has u >= (code0 + t) * kPosUnit and every other y u <= (code0 + t) * kPosUnit: unless u is a multiple of
// kPosUnit, the code of +y (zero + k) is min(u / kPosUnit, region_code_max). The rare u that are multiples take
// the bucket lookup. (AVX-512 looks the binade up in 32-entry tables, AVX2 its pair of binades in 8-entry ones.)
// Non-finite x and blocks whose A is below FLT_MIN quantise to zero. Plain data, shared with the per-ISA kernels.
#include <cstdint>

#include "adam/adam_types.h"

namespace swapio {
namespace adam {

// Buckets: the top 16 bits of y (a bfloat16 of y) from 2^-24 up to 1.0; everything below 2^-24 (below half
// the smallest nonzero code of either map) shares bucket 0.
constexpr uint32_t kBucketKeyMin = (127u - 24u) << 7;
constexpr uint32_t kBucketKeyMax = 0x3F80u;  // top 16 bits of 1.0f
constexpr int kBuckets = static_cast<int>(kBucketKeyMax - kBucketKeyMin + 1);

// Region tables: binades 2^-31 .. 2^0 by y's exponent field (all smaller y share the first); regions 0 .. 8 (y
// below the first nonzero magnitude's midpoint, the 7 decades, y above the last midpoint), padded to 16.
constexpr int kRegionBinades = 32;
constexpr uint32_t kRegionExpBase = 127u - 31u;
constexpr int kRegions = 16;
// P counts 2^-15 code steps (P < 2^23 in the decades): a lane defers where rint(P) is a multiple of kPosUnit. With
// 2^-12 steps, where the moments change from step to step, one AVX2 encode of 32 lanes in 200 took the scalar
// lookup; now one in 1200 (benchmarks/RESULTS.md).
constexpr int kPosBits = 15;
constexpr int32_t kPosUnit = 1 << kPosBits;
// The AVX2 kernel's lines (pos_scale8, pos_offset8) count 2^-16 code steps: the code is rint(P8)'s high 16 bits, and
// its low 16 bits, which one vpminuw takes over two vectors, the fraction. At a midpoint rint(P8) lies up to
// kPos8Window above its multiple of 2^16 (checked when the maps are built), so a lane defers where the low 16 bits
// are at most kPos8Window (above the midpoint P8 >= the multiple, below it P8 <= the multiple + kPos8Window).
constexpr int kPos8Bits = 16;
constexpr int32_t kPos8Unit = 1 << kPos8Bits;
constexpr int32_t kPos8Window = 1;
// The signed map's code of 0 and largest negative magnitude index (the AVX2 kernel's constants; checked at build)
constexpr int32_t kSignedZero = 127;
constexpr int32_t kSignedMaxNegK = 127;
constexpr uint32_t kPairBase = 48;  // pairs of binades 2^-31 .. 2^0 (exponent fields 96 .. 127) by field / 2 - 48

struct QuantMap {
  float code[256];         // code value of each 8-bit code, ascending
  float mid[256];          // mid[k]: midpoint between magnitudes k and k+1; +inf from max_k on
  // Magnitude k > 0 is float(rank * rank_scale[slot] + rank_offset[slot]), one rounding (an FMA), where rank =
  // k + rank_bias and slot = the low 4 bits of float(rank)'s exponent field: decade i starts at a rank that is a
  // power of two (quant.cpp), so the binade of the rank picks the decade's line, and 1.0 has a binade of its own.
  alignas(64) float rank_scale[16];
  alignas(64) float rank_offset[16];
  uint32_t bucket[kBuckets];  // per bucket: (midpoints below its smallest y) << 16 | low 16 bits of its own
  alignas(64) float region_mid[kRegionBinades];  // the region midpoint inside each binade, or +inf
  alignas(64) int32_t region_below[kRegionBinades];  // region midpoints below each binade
  alignas(64) float pos_scale[kRegions];  // per region: P = fma(y, pos_scale, -pos_offset)
  alignas(64) float pos_offset[kRegions];
  alignas(64) int32_t region_code_max[kRegions];  // the code of +y = min(rint(P) / kPosUnit, region_code_max)
  // The AVX2 kernel's tables, 8 entries each (one vpermps, or one vpshufb of 16 bytes):
  // decode: the line of a rank's binade by the low 3 bits of float(rank)'s exponent field. The unsigned map's ranks
  // 1 (code 0) and 256 (1.0) share an entry: the line through 0 at rank 1 and 1.0 at rank 256. The signed map's
  // entries are by float(4 rank) (B / 4), where the zero code and 1.0 share the line through 0 (quant.cpp).
  alignas(32) float rank_scale8[8];
  alignas(32) float rank_offset8[8];
  // encode: y's pair of binades (exponent field / 2 - kPairBase, 0 below) gives the region midpoints below it
  // (a pair, 4x, holds at most one; they are ~10x apart); one comparison with the next one, mid8, gives the region
  // r in 0 .. 8, and line r % 8: regions 0 (below the first magnitude's midpoint) and 8 (above the last midpoint)
  // share the line P8 = (zero + 1/2 + 512 y) kPos8Unit, clamped to zero + max_k: 512 y < 1/2 in region 0, and
  // 512 y > max_k in region 8. Lines 1 .. 7 are the decades', as in pos_scale (in kPos8Unit steps). The unsigned map's pair_below
  // entries but the first carry + 8 (its r is 0 or 8 .. 16), which the 8-entry tables ignore: the int8 Adam encode
  // looks both maps' clamps up in one 16-byte table by r (code_max16).
  alignas(16) uint8_t pair_below[16];
  alignas(32) float mid8[8];
  alignas(32) float pos_scale8[8];
  alignas(32) float pos_offset8[8];
  alignas(32) int32_t code_max8[8];
  // code_max8 as bytes by r % 16, the same in both maps: the signed map's lines 0 .. 7, then the unsigned map's (the
  // signed map's region 8 reads entry 8, line 0's of the unsigned map, the same 255; the unsigned map's r 16 entry 0)
  alignas(16) uint8_t code_max16[16];
  int32_t zero;            // the code of 0 (127 signed, 0 unsigned)
  int32_t max_k;           // largest magnitude index (128 signed: 1.0; 255 unsigned)
  int32_t max_neg_k;       // largest magnitude index of a negative value (127: the map has no -1.0)
  int32_t rank_bias;       // 0 signed, 1 unsigned
  bool is_signed;
};

// The two maps, built once (thread-safe static). A map's magnitudes are code[zero + k] for k in [0, max_k].
const QuantMap& signed_map();
const QuantMap& unsigned_map();

// True when every bucket holds at most one midpoint, every binade at most one region midpoint, every inner
// midpoint's P rounds to its multiple of kPosUnit (P8: within kPos8Window above its multiple of kPos8Unit) and no
// P or P8 in a decade lies below its first code's (checked when the maps are built; tests assert it).
bool quant_maps_valid();

}  // namespace adam
}  // namespace swapio
