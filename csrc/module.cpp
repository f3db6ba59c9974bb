// hetlb._C: the pybind11 module. Each area binds its own names; the tensor ops register themselves
// with TORCH_LIBRARY (csrc/ops/ops.cpp) when the library is loaded.
#include <pybind11/pybind11.h>

#include "bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetlb native core: host algorithms (pybind11) and tensor kernels (torch.ops.hetlb)";
  hetlb::bind_solve(m);
  hetlb::bind_hook(m);
  hetlb::bind_ops(m);
}
