#pragma once
// Enums shared by the public API (adam.h) and the per-ISA kernels (adam_kernel.h). Kept free of standard
// library headers other than <cstdint>, because per-ISA translation units include it.
#include <cstdint>

namespace swapio {
namespace adam {

// Element types of grad and param_out. The numeric codes are part of the binding (swapio._C).
enum class DType : int { kNone = -1, kF32 = 0, kBF16 = 1, kF16 = 2 };

// Storage of optimizer moments: fp32, bf16 with stochastic rounding, or 8-bit codes of a block-wise
// dynamic-tree map with one fp32 scale per block of kQuantBlock elements. Codes are part of the binding.
enum class StateType : int { kF32 = 0, kBF16 = 1, kInt8 = 2 };
constexpr int64_t kQuantBlock = 256;

// SIMD levels, lowest first. kAuto means "the level chosen at startup".
enum class Capability : int { kAuto = -1, kScalar = 0, kAVX2 = 1, kAVX512 = 2 };

}  // namespace adam
}  // namespace swapio
