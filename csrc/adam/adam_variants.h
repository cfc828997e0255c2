#pragma once
// Turns the runtime choices of one step (grad dtype, param_out dtype, L2 vs decoupled decay, amsgrad) into
// a call of the matching compile-time kernel variant, so each per-ISA file only writes its loop.
//
// Safe in per-ISA translation units despite adam_kernel.h's rule: every instantiation takes that file's own
// anonymous-namespace Kernel type, so it has internal linkage and the linker cannot merge it across
// instruction sets.
#include "adam/adam_kernel.h"

namespace swapio {
namespace adam {

// Kernel::run<GradDType, OutDType, L2, AMSGrad>(args, begin, end) is the loop of one ISA.
template <class Kernel, DType G, DType O>
void run_with_decay(const AdamArgs& a, int64_t begin, int64_t end) {
  if (a.c.l2) {
    if (a.c.amsgrad) Kernel::template run<G, O, true, true>(a, begin, end);
    else Kernel::template run<G, O, true, false>(a, begin, end);
  } else {
    if (a.c.amsgrad) Kernel::template run<G, O, false, true>(a, begin, end);
    else Kernel::template run<G, O, false, false>(a, begin, end);
  }
}

template <class Kernel, DType G>
void run_with_out(const AdamArgs& a, int64_t begin, int64_t end) {
  switch (a.out_dtype) {
    case DType::kF32: return run_with_decay<Kernel, G, DType::kF32>(a, begin, end);
    case DType::kBF16: return run_with_decay<Kernel, G, DType::kBF16>(a, begin, end);
    case DType::kF16: return run_with_decay<Kernel, G, DType::kF16>(a, begin, end);
    default: return run_with_decay<Kernel, G, DType::kNone>(a, begin, end);
  }
}

template <class Kernel>
void run_variant(const AdamArgs& a, int64_t begin, int64_t end) {
  switch (a.grad_dtype) {
    case DType::kBF16: return run_with_out<Kernel, DType::kBF16>(a, begin, end);
    case DType::kF16: return run_with_out<Kernel, DType::kF16>(a, begin, end);
    default: return run_with_out<Kernel, DType::kF32>(a, begin, end);
  }
}

}  // namespace adam
}  // namespace swapio
