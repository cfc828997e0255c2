#pragma once
#include <pybind11/pybind11.h>

namespace swapio {
// Registers the CPU Adam kernel entry points on swapio._C (defined in csrc/python/bind_adam.cpp).
void bind_adam(pybind11::module_& m);
}  // namespace swapio
