#include "hook/fast_calls.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include <exception>
#include <iterator>

#include "hook/deferred_hook.h"

namespace hetlb {
namespace {

constexpr const char* kStepCalls = "hetlb.StepCalls";

// The capsule's payload: what the calls are bound to.
struct StepCalls {
  std::shared_ptr<StepCore> core;
  // The watch's side group, held weakly (see no_python.h).
  c10::weak_intrusive_ptr<c10d::ProcessGroup> side;
};

StepCalls& calls_of(PyObject* self) {
  return *static_cast<StepCalls*>(PyCapsule_GetPointer(self, kStepCalls));
}

// A C++ error as pybind11 (with torch's translator) raises it: RuntimeError, without the C++
// backtrace.
PyObject* raise_cpp(const std::exception& e) {
  const auto* err = dynamic_cast<const c10::Error*>(&e);
  PyErr_SetString(PyExc_RuntimeError, err != nullptr ? err->what_without_backtrace() : e.what());
  return nullptr;
}

bool as_double(PyObject* o, double& out) {
  out = PyFloat_AsDouble(o);
  return !(out == -1.0 && PyErr_Occurred());
}

// begin(weight, offset, new_window, pos, ship, v0, ..., v8): StepCore::open with the row's
// set_columns() values.
PyObject* calls_begin(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  constexpr int kValues = 9;
  if (nargs != 5 + kValues) {
    PyErr_Format(PyExc_TypeError,
                 "hetlb step begin() takes %d arguments (weight, offset, new_window, pos, ship "
                 "and the row's %d values), got %zd", 5 + kValues, kValues, nargs);
    return nullptr;
  }
  StepStart start{};
  double values[kValues];
  if (!as_double(args[0], start.weight) || !as_double(args[1], start.offset)) return nullptr;
  const int new_window = PyObject_IsTrue(args[2]);
  if (new_window < 0) return nullptr;
  const long long pos = PyLong_AsLongLong(args[3]);
  if (pos == -1 && PyErr_Occurred()) return nullptr;
  const int ship = PyObject_IsTrue(args[4]);
  if (ship < 0) return nullptr;
  for (int i = 0; i < kValues; ++i)
    if (!as_double(args[5 + i], values[i])) return nullptr;
  start.new_window = new_window != 0;
  start.pos = pos;
  start.ship = ship != 0;
  try {
    calls_of(self).core->open(start, values, kValues, RowValues::kColumns);
  } catch (const std::exception& e) {
    return raise_cpp(e);
  }
  Py_RETURN_NONE;
}

// end_kept(): StepCore::end_kept.
PyObject* calls_end_kept(PyObject* self, PyObject* /*unused*/) {
  try {
    return PyBool_FromLong(calls_of(self).core->end_kept() ? 1 : 0);
  } catch (const std::exception& e) {
    return raise_cpp(e);
  }
}

// restart_clock(): StepCore::restart_clock.
PyObject* calls_restart_clock(PyObject* self, PyObject* /*unused*/) {
  try {
    calls_of(self).core->restart_clock();
  } catch (const std::exception& e) {
    return raise_cpp(e);
  }
  Py_RETURN_NONE;
}

// watch(output): watch_output with the side group bound at creation.
PyObject* calls_watch(PyObject* self, PyObject* out) {
  if (!THPVariable_Check(out)) {
    PyErr_Format(PyExc_TypeError, "hetlb step watch() needs a tensor, got %s", Py_TYPE(out)->tp_name);
    return nullptr;
  }
  StepCalls& calls = calls_of(self);
  if (calls.side.expired()) {
    PyErr_SetString(PyExc_RuntimeError,
                    "hetlb step watch(): no side process group: none was given, or it was "
                    "destroyed (a backward after destroy_process_group?)");
    return nullptr;
  }
  try {
    watch_output(calls.core, THPVariable_Unpack(out), calls.side);
  } catch (const std::exception& e) {
    return raise_cpp(e);
  }
  Py_RETURN_NONE;
}

PyMethodDef kCallDefs[] = {
    {"begin", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(calls_begin)),
     METH_FASTCALL, "StepCore.begin(weight, offset, new_window, pos, ship, v0, ..., v8), positional."},
    {"end_kept", calls_end_kept, METH_NOARGS, "StepCore.end_kept()."},
    {"restart_clock", calls_restart_clock, METH_NOARGS, "StepCore.restart_clock()."},
    {"watch", calls_watch, METH_O, "watch_output(output, side) with the side group bound: the deferred hook's watch."},
};

}  // namespace

pybind11::tuple step_calls(std::shared_ptr<StepCore> core, const pybind11::object& group) {
  namespace py = pybind11;
  TORCH_CHECK(core, "hetlb step_calls: need a StepCore, got None");
  c10::intrusive_ptr<c10d::ProcessGroup> side;
  if (!group.is_none()) side = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
  TORCH_CHECK(!side || side->getSize() == core->world(), "hetlb step_calls: need the side group of ",
              core->world(), " ranks, got one of ", side ? side->getSize() : 0);
  auto* calls = new StepCalls{std::move(core), c10::weak_intrusive_ptr<c10d::ProcessGroup>(side)};
  py::object capsule = py::reinterpret_steal<py::object>(
      PyCapsule_New(calls, kStepCalls, [](PyObject* cap) {
        delete static_cast<StepCalls*>(PyCapsule_GetPointer(cap, kStepCalls));
      }));
  if (!capsule) {
    delete calls;
    throw py::error_already_set();
  }
  py::tuple out(std::size(kCallDefs));
  for (size_t i = 0; i < std::size(kCallDefs); ++i) {
    PyObject* f = PyCFunction_NewEx(&kCallDefs[i], capsule.ptr(), nullptr);
    if (f == nullptr) throw py::error_already_set();
    PyTuple_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), f);
  }
  return out;
}

}  // namespace hetlb
