#pragma once
// Host-side pieces shared by the entry points of adam.cpp (fp32 Adam) and lowp.cpp (bf16/int8 state, Lion):
// the choice of kernels, hyperparameter checks, the float scalars of a step, and the tiled parallel run.
// Baseline code only (never included by a per-ISA file).
#include <cstdint>
#include <string>

#include "adam/adam.h"
#include "adam/adafactor_kernel.h"
#include "adam/adam_kernel.h"
#include "adam/adam_pool.h"

namespace swapio {
namespace adam {

struct KernelSet {
  AdamKernel adam;
  LowpKernel lowp;
  AdafactorKernel adafactor;
};

// kAuto: the active level; an explicit level the CPU lacks throws std::invalid_argument("<who>: ...").
KernelSet kernels_for(Capability cap, const char* who);

// std::invalid_argument("<who>: <msg>")
[[noreturn]] void bad_argument(const char* who, const std::string& msg);

// The checks of every Adam entry (step >= 1, finite non-negative lr/eps/weight_decay, betas in [0, 1)).
void check_adam_hyper(const AdamHyper& h, const char* who);

// Host scalars in double, rounded to float once: what torch does with its Python-float hyperparameters.
AdamConsts adam_consts(const AdamHyper& h);

// Runs fn over [0, n) in tiles of a multiple of kQuantBlock elements on up to `threads` threads (the caller
// is one; 0 = hardware concurrency); small steps run on the calling thread only. long_tiles: tiles up to 4x
// longer while every thread still gets at least 4 (the int8 loops' pipeline fills and drains at each tile's ends).
void run_tiled(int64_t n, int threads, TileFn fn, const void* ctx, bool long_tiles = false);

}  // namespace adam
}  // namespace swapio
