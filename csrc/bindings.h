// The pybind11 parts of hetlb._C, one function per area; csrc/module.cpp calls each once.
#pragma once
#include <pybind11/pybind11.h>

namespace hetlb {

// Host algorithms on NumPy arrays (csrc/solve/bindings.cpp).
void bind_solve(pybind11::module& m);

// The tensor ops' eager calls and whether the CUDA kernels were built, `has_cuda`
// (csrc/ops/calls.cpp).
void bind_ops(pybind11::module& m);

// The step core, the weighted DDP hook and the per-step fast calls (csrc/hook/bindings.cpp).
void bind_hook(pybind11::module& m);

}  // namespace hetlb
