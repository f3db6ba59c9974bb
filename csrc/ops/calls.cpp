// The tensor ops' eager calls from hetlb/ops.py: the lists are unpacked straight from Python and
// the op is called through the dispatcher's typed handle, so the kernels, dispatch keys and checks
// are torch.ops.hetlb's. torch.ops parses a call's arguments into boxed values first, which for a
// model's 400 tensors costs more host time than an H200 takes to scale them (about 35 of 46 us
// on the development machine; bench/RESULTS.md, "CUDA, H200"). A call with anything but plain
// tensors and Parameters in its lists (a tensor subclass such as DTensor, an object with a
// __torch_function__, a wrong type), or under a torch function mode, returns False without
// running: hetlb/ops.py then calls torch.ops, which handles them or raises its own error. As
// torch.ops does, the op runs without the GIL, and its errors and warnings reach Python as
// torch's (torch::wrap_pybind_function).
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <vector>

#include "bindings.h"

namespace hetlb {
namespace {

namespace py = pybind11;

// The tensors of `list`, or nullopt where one of them is not a plain tensor or Parameter or a
// torch function mode is on.
std::optional<std::vector<at::Tensor>> unpack(const py::list& list) {
  if (at::impl::torch_function_mode_enabled()) return std::nullopt;
  std::vector<at::Tensor> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    PyObject* o = PyList_GET_ITEM(list.ptr(), i);
    if (!THPVariable_CheckExact(o)) return std::nullopt;
    out.push_back(THPVariable_Unpack(o));
  }
  return out;
}

template <typename Signature>
c10::TypedOperatorHandle<Signature> handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

bool scale_call(const py::list& tensors, double weight) {
  static const auto op = handle<void(at::TensorList, double)>("hetlb::scale_");
  auto ts = unpack(tensors);
  if (!ts) return false;
  py::gil_scoped_release no_gil;
  op.call(*ts, weight);
  return true;
}

bool delay_compensate_call(const py::list& grads, const py::list& params, const py::list& prevs,
                           double lam) {
  static const auto op =
      handle<void(at::TensorList, at::TensorList, at::TensorList, double)>("hetlb::delay_compensate_");
  auto g = unpack(grads);
  if (!g) return false;
  auto p = unpack(params);
  if (!p) return false;
  auto q = unpack(prevs);
  if (!q) return false;
  py::gil_scoped_release no_gil;
  op.call(*g, *p, *q, lam);
  return true;
}

}  // namespace

void bind_ops(py::module& m) {
#ifdef HETLB_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
  m.def("scale_call", torch::wrap_pybind_function(scale_call), py::arg("tensors"),
        py::arg("weight"),
        "torch.ops.hetlb.scale_ with the list unpacked directly; False (nothing run) where an "
        "element is not a plain tensor or Parameter or a torch function mode is on.");
  m.def("delay_compensate_call", torch::wrap_pybind_function(delay_compensate_call),
        py::arg("grads"), py::arg("params"), py::arg("prevs"), py::arg("lam"),
        "torch.ops.hetlb.delay_compensate_ with the lists unpacked directly; False (nothing run) "
        "where an element is not a plain tensor or Parameter or a torch function mode is on.");
}

}  // namespace hetlb
