#pragma once
// Portable scalar helpers of the scalar kernel: bf16/fp16 <-> fp32 conversions and a rounding barrier.
// Everything is `static inline` (internal linkage in each includer), so a copy built with other -m flags
// can never be merged into baseline code by the linker.
#include <cmath>
#include <cstdint>
#include <cstring>

namespace swapio {
namespace adam {
namespace scalar_ops {

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

static inline float f32_from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Forces `x` to be materialized as a rounded float, so that the compiler cannot contract the multiply that
// produced it with a later add into a fused multiply-add (GCC contracts across statements by default).
static inline float rounded(float x) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE2__)
  __asm__("" : "+x"(x));
#elif defined(__GNUC__) && defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  volatile float v = x;
  x = v;
#endif
  return x;
}

static inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

// Round to nearest even. NaN becomes 0xFFFF, as in ATen's x86 vector conversion (tensor.to(torch.bfloat16)
// on x86 gives 0xFFFF for every NaN), so the SIMD kernels and this one agree bit for bit.
static inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0xFFFFu;
  uint32_t u = f32_bits(f);
  uint32_t bias = 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + bias) >> 16);
}

// Stochastic rounding to bf16: add 16 random bits below the kept ones, then truncate, so x rounds up with a
// probability equal to the fraction dropped. NaN becomes 0xFFFF, as in f32_to_bf16. (No overflow: only NaNs
// have bits >= 0xFFFF0000.)
static inline uint16_t f32_to_bf16_sr(float f, uint32_t random16) {
  if (std::isnan(f)) return 0xFFFFu;
  return static_cast<uint16_t>((f32_bits(f) + random16) >> 16);
}

// MurmurHash3's 32-bit finalizer (Appleby): a bijection whose output bits each depend on every input bit.
static inline uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// The random bits of element `index` under `key` (a Weyl step apart per element, then mixed).
static inline uint32_t sr_bits(uint32_t key, uint32_t index) { return fmix32(key + index * 0x9E3779B9u); }

// Exact widening, like VCVTPH2PS: subnormals normalized, NaN quieted with its payload kept.
static inline float f16_to_f32(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t mant = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1Fu) {
    bits = sign | 0x7F800000u | (mant << 13) | (mant ? 0x00400000u : 0u);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal half: mant * 2^-24; shift until the implicit bit (bit 10) is set
    uint32_t s = 0;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      ++s;
    }
    bits = sign | ((113u - s) << 23) | ((mant & 0x3FFu) << 13);
  }
  return f32_from_bits(bits);
}

// Round to nearest even, like VCVTPS2PH with _MM_FROUND_TO_NEAREST_INT: overflow to inf, subnormal
// results, NaN quieted keeping the sign and the top payload bits.
static inline uint16_t f32_to_f16(float f) {
  uint32_t u = f32_bits(f);
  uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a >= 0x7F800000u) {
    if (a == 0x7F800000u) return sign | 0x7C00u;
    return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  }
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                       // >= 2^-14: a normal half (rounding may carry upward)
    uint32_t r = a + 0xFFFu + ((a >> 13) & 1u) - (112u << 23);
    return static_cast<uint16_t>(sign | (r >> 13));
  }
  if (a <= 0x33000000u) return sign;  // <= 2^-25 rounds to (signed) zero; 2^-25 itself ties to 0
  uint32_t e = a >> 23;               // 102..112
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126u - e;          // value / 2^-24 = m >> shift; shift in 14..24
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;  // may become 0x400, the smallest normal
  return static_cast<uint16_t>(sign | q);
}

}  // namespace scalar_ops
}  // namespace adam
}  // namespace swapio
