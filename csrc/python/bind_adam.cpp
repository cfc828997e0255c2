// swapio._C entry points of the CPU Adam kernel: raw pointers (tensor.data_ptr()) and sizes in, ValueError
// out for bad arguments; the step runs with the GIL released. swapio/ops.py is the tensor-level wrapper.
#include "python/bind_adam.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "adam/adam.h"

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

void step(uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq, int64_t n,
          int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw,
          bool maximize, bool amsgrad, uintptr_t max_exp_avg_sq, uintptr_t param_out, int out_dtype, int threads,
          const std::string& capability) {
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
  DType gd = to_dtype(grad_dtype, false, "grad");
  DType od = to_dtype(out_dtype, true, "param_out");
  Capability cap;
  if (!adam::parse_capability(capability, &cap)) {
    throw py::value_error("adam_step: unknown capability '" + capability + "' (scalar, avx2, avx512 or auto)");
  }
  if (n > 0 && (param == 0 || grad == 0 || exp_avg == 0 || exp_avg_sq == 0)) {
    throw py::value_error("adam_step: null buffer pointer");
  }
  if (n > 0 && amsgrad && max_exp_avg_sq == 0) throw py::value_error("adam_step: amsgrad needs max_exp_avg_sq");
  if (n > 0 && od != DType::kNone && param_out == 0) throw py::value_error("adam_step: null param_out");
  std::string error;
  {
    py::gil_scoped_release release;
    try {
      adam::adam_step(static_cast<float*>(ptr(param)), ptr(grad), gd, static_cast<float*>(ptr(exp_avg)),
                      static_cast<float*>(ptr(exp_avg_sq)), static_cast<float*>(ptr(max_exp_avg_sq)), n, h,
                      ptr(param_out), od, threads, cap);
    } catch (const std::invalid_argument& e) {
      error = e.what();
    }
  }
  if (!error.empty()) throw py::value_error(error);
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
  m.def("adam_capability", &adam::adam_capability,
        "SIMD level the Adam kernel uses: 'avx512', 'avx2' or 'scalar'.");
  m.def("adam_capability_info", &capability_info,
        "Dict: active, best (what the CPU supports), requested (SWAPIO_CPU_CAPABILITY or None),\n"
        "request_honored, supported (list of levels usable here).");
  m.def("adam_pool_workers", &adam::adam_pool_workers, "Worker threads the Adam pool has started so far.");
}

}  // namespace swapio
