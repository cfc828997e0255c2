// swapio._C entry points of the CPU Adam kernel: raw pointers (tensor.data_ptr()) and sizes in, ValueError
// out for bad arguments; the step runs with the GIL released. swapio/ops.py is the tensor-level wrapper.
#include "python/bind_adam.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adam/adafactor.h"
#include "adam/adam.h"
#include "adam/quant.h"

namespace py = pybind11;

namespace swapio {
namespace {

using adam::Capability;
using adam::DType;

DType to_dtype(int code, bool allow_none, const char* what) {
  switch (code) {
    case static_cast<int>(DType::kF32): return DType::kF32;
    case static_cast<int>(DType::kBF16): return DType::kBF16;
    case static_cast<int>(DType::kF16): return DType::kF16;
    case static_cast<int>(DType::kNone):
      if (allow_none) return DType::kNone;
      break;
    default: break;
  }
  throw py::value_error(std::string("adam_step: bad dtype code ") + std::to_string(code) + " for " + what);
}

void* ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

Capability to_capability(const std::string& capability, const char* who) {
  Capability cap;
  if (!adam::parse_capability(capability, &cap)) {
    throw py::value_error(std::string(who) + ": unknown capability '" + capability + "' (scalar, avx2, avx512 or auto)");
  }
  return cap;
}

adam::StateOptions state_options(int state, uint64_t seed, int64_t index_base) {
  adam::StateOptions o;
  if (state < 0 || state > static_cast<int>(adam::StateType::kInt8)) {
    throw py::value_error("bad state type code " + std::to_string(state));
  }
  o.state = static_cast<adam::StateType>(state);
  o.seed = seed;
  o.index_base = index_base;
  return o;
}

// Runs fn with the GIL released; std::invalid_argument becomes ValueError.
template <class Fn>
int64_t released(Fn fn) {
  std::string error;
  int64_t result = 0;
  {
    py::gil_scoped_release release;
    try {
      result = fn();
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
  }
  if (!error.empty()) throw py::value_error(error);
  return result;
}

adam::AdamHyper adam_hyper(int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay,
                           bool adamw, bool maximize, bool amsgrad) {
  adam::AdamHyper h;
  h.step = step;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adamw = adamw;
  h.maximize = maximize;
  h.amsgrad = amsgrad;
  return h;
}

void step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq, int64_t n,
          int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
          bool maximize, bool amsgrad, uintptr_t max_exp_avg_sq, uintptr_t param_out, int out_dtype, int threads,
          const std::string& capability) {
  adam::AdamHyper h = adam_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, amsgrad);
  DType gd = to_dtype(grad_dtype, false, "grad");
  DType od = to_dtype(out_dtype, true, "param_out");
  Capability cap = to_capability(capability, "adam_step");
  if (n > 0 && (param == 0 || grad == 0 || exp_avg == 0 || exp_avg_sq == 0)) {
    throw py::value_error("adam_step: null buffer pointer");
  }
  if (n > 0 && amsgrad && max_exp_avg_sq == 0) throw py::value_error("adam_step: amsgrad needs max_exp_avg_sq");
  if (n > 0 && od != DType::kNone && param_out == 0) throw py::value_error("adam_step: null param_out");
  released([&] {
    adam::adam_step(static_cast<float*>(ptr(param)), ptr(grad), gd, static_cast<float*>(ptr(exp_avg)),
                    static_cast<float*>(ptr(exp_avg_sq)), static_cast<float*>(ptr(max_exp_avg_sq)), n, h,
                    ptr(param_out), od, threads, cap);
    return int64_t{0};
  });
}

int64_t step_state(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_scale,
                   uintptr_t exp_avg_sq, uintptr_t exp_avg_sq_scale, int64_t n, int state, uint64_t seed,
                   int64_t index_base, int64_t step, double lr, double beta1, double beta2, double eps,
                   double weight_decay, bool adamw, bool maximize, uintptr_t param_out, int out_dtype, int threads,
                   const std::string& capability) {
  adam::AdamHyper h = adam_hyper(step, lr, beta1, beta2, eps, weight_decay, adamw, maximize, false);
  DType gd = to_dtype(grad_dtype, false, "grad");
  DType od = to_dtype(out_dtype, true, "param_out");
  Capability cap = to_capability(capability, "adam_step");
  adam::StateOptions o = state_options(state, seed, index_base);
  adam::MomentBuf m{ptr(exp_avg), static_cast<float*>(ptr(exp_avg_scale))};
  adam::MomentBuf v{ptr(exp_avg_sq), static_cast<float*>(ptr(exp_avg_sq_scale))};
  return released([&] {
    return adam::adam_step_state(static_cast<float*>(ptr(param)), ptr(grad), gd, m, v, n, h, ptr(param_out), od, o,
                                 threads, cap);
  });
}

int64_t lion(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_scale, int64_t n,
             int state, uint64_t seed, int64_t index_base, int64_t step, double lr, double beta1, double beta2,
             double weight_decay, bool maximize, uintptr_t param_out, int out_dtype, int threads,
             const std::string& capability) {
  adam::LionHyper h;
  h.step = step;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.weight_decay = weight_decay;
  h.maximize = maximize;
  DType gd = to_dtype(grad_dtype, false, "grad");
  DType od = to_dtype(out_dtype, true, "param_out");
  Capability cap = to_capability(capability, "lion_step");
  adam::StateOptions o = state_options(state, seed, index_base);
  adam::MomentBuf m{ptr(exp_avg), static_cast<float*>(ptr(exp_avg_scale))};
  return released([&] {
    return adam::lion_step(static_cast<float*>(ptr(param)), ptr(grad), gd, m, n, h, ptr(param_out), od, o, threads,
                           cap);
  });
}

void adafactor(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t row_var, uintptr_t col_var,
               uintptr_t variance, int64_t n, bool factored, int64_t batches, int64_t rows, int64_t cols,
               int64_t step, double lr, double beta2_decay, double eps1, double eps2, double d,
               double weight_decay, bool maximize, uintptr_t param_out, int out_dtype, int threads,
               const std::string& capability) {
  adam::AdafactorHyper h;
  h.step = step;
  h.lr = lr;
  h.beta2_decay = beta2_decay;
  h.eps1 = eps1;
  h.eps2 = eps2;
  h.d = d;
  h.weight_decay = weight_decay;
  h.maximize = maximize;
  DType gd = to_dtype(grad_dtype, false, "grad");
  DType od = to_dtype(out_dtype, true, "param_out");
  Capability cap = to_capability(capability, "adafactor_step");
  released([&] {
    adam::adafactor_step(static_cast<float*>(ptr(param)), ptr(grad), gd, static_cast<float*>(ptr(row_var)),
                         static_cast<float*>(ptr(col_var)), static_cast<float*>(ptr(variance)), n, factored,
                         batches, rows, cols, h, ptr(param_out), od, threads, cap);
    return int64_t{0};
  });
}

py::list quant_map(bool is_signed) {
  const adam::QuantMap& q = is_signed ? adam::signed_map() : adam::unsigned_map();
  py::list codes;
  for (float c : q.code) codes.append(c);
  return codes;
}

py::dict capability_info() {
  adam::CapabilityInfo info = adam::adam_capability_info();
  py::list supported;
  for (Capability c : info.supported) supported.append(adam::capability_name(c));
  py::dict d;
  d["active"] = adam::capability_name(info.active);
  d["best"] = adam::capability_name(info.best);
  d["requested"] = info.requested.empty() ? py::object(py::none()) : py::object(py::str(info.requested));
  d["request_honored"] = info.request_honored;
  d["supported"] = supported;
  return d;
}

}  // namespace

void bind_adam(py::module_& m) {
  py::dict codes;
  codes["float32"] = static_cast<int>(adam::DType::kF32);
  codes["bfloat16"] = static_cast<int>(adam::DType::kBF16);
  codes["float16"] = static_cast<int>(adam::DType::kF16);
  codes["none"] = static_cast<int>(adam::DType::kNone);
  m.attr("ADAM_DTYPE_CODES") = codes;

  m.def("adam_step", &step,
        "One Adam/AdamW step over n fp32 elements in place (param, exp_avg, exp_avg_sq[, max_exp_avg_sq]),\n"
        "grad of dtype code grad_dtype, optional param_out of dtype code out_dtype written in the same pass.\n"
        "Pointers are addresses (tensor.data_ptr()); the caller keeps the memory alive. The GIL is released.\n"
        "threads: total threads (0 = hardware concurrency). capability: '' (active level) or an explicit\n"
        "'scalar' / 'avx2' / 'avx512' (ValueError if this CPU lacks it). Bad arguments raise ValueError.",
        py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("n"), py::kw_only(), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true, py::arg("maximize") = false,
        py::arg("amsgrad") = false, py::arg("max_exp_avg_sq") = 0, py::arg("param_out") = 0,
        py::arg("out_dtype") = static_cast<int>(adam::DType::kNone), py::arg("threads") = 0,
        py::arg("capability") = "");
  py::dict states;
  states["fp32"] = static_cast<int>(adam::StateType::kF32);
  states["bf16"] = static_cast<int>(adam::StateType::kBF16);
  states["int8"] = static_cast<int>(adam::StateType::kInt8);
  m.attr("STATE_CODES") = states;
  m.attr("QUANT_BLOCK") = adam::kQuantBlock;

  m.def("adam_step_state", &step_state,
        "adam_step with moments stored as state code `state` (fp32, bf16 with stochastic rounding seeded by\n"
        "(seed, step, index_base + i), or int8 codes with one fp32 scale per QUANT_BLOCK elements); no amsgrad.\n"
        "Returns how many non-finite new moments were stored as zero (int8). Bad arguments raise ValueError.",
        py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_scale"),
        py::arg("exp_avg_sq"), py::arg("exp_avg_sq_scale"), py::arg("n"), py::kw_only(), py::arg("state"),
        py::arg("seed"), py::arg("index_base"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"),
        py::arg("eps"), py::arg("weight_decay"), py::arg("adamw") = true, py::arg("maximize") = false,
        py::arg("param_out") = 0, py::arg("out_dtype") = static_cast<int>(adam::DType::kNone),
        py::arg("threads") = 0, py::arg("capability") = "");
  m.def("lion_step", &lion,
        "One Lion step over n elements in place; exp_avg stored as state code `state` (see adam_step_state).\n"
        "Returns how many non-finite new moments were stored as zero (int8). Bad arguments raise ValueError.",
        py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_scale"),
        py::arg("n"), py::kw_only(), py::arg("state"), py::arg("seed"), py::arg("index_base"), py::arg("step"),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("maximize") = false,
        py::arg("param_out") = 0, py::arg("out_dtype") = static_cast<int>(adam::DType::kNone),
        py::arg("threads") = 0, py::arg("capability") = "");
  m.def("adafactor_step", &adafactor,
        "One Adafactor step (torch.optim.Adafactor's algorithm) of a whole parameter of n elements in place:\n"
        "factored ([batches, rows, cols], row_var and col_var) or not (variance). Bad arguments raise ValueError.",
        py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("row_var"), py::arg("col_var"),
        py::arg("variance"), py::arg("n"), py::kw_only(), py::arg("factored"), py::arg("batches"),
        py::arg("rows"), py::arg("cols"), py::arg("step"), py::arg("lr"), py::arg("beta2_decay"), py::arg("eps1"),
        py::arg("eps2"), py::arg("d"), py::arg("weight_decay"), py::arg("maximize") = false,
        py::arg("param_out") = 0, py::arg("out_dtype") = static_cast<int>(adam::DType::kNone),
        py::arg("threads") = 0, py::arg("capability") = "");
  m.def("quant_map", &quant_map, py::arg("signed"),
        "The 256 code values of the int8 dynamic-tree map (signed: first moments; unsigned: second moments).");
  m.def("adam_capability", &adam::adam_capability,
        "SIMD level the Adam kernel uses: 'avx512', 'avx2' or 'scalar'.");
  m.def("adam_capability_info", &capability_info,
        "Dict: active, best (what the CPU supports), requested (SWAPIO_CPU_CAPABILITY or None),\n"
        "request_honored, supported (list of levels usable here).");
  m.def("adam_pool_workers", &adam::adam_pool_workers, "Worker threads the Adam pool has started so far.");
}

}  // namespace swapio
