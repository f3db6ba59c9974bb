#include "hook/no_python.h"

#include <pybind11/pybind11.h>

#include <utility>

namespace hetlb {

NoPythonState::NoPythonState() : objects_(at::impl::ThreadLocalPythonObjects::get_state()) {
  at::impl::ThreadLocalPythonObjects::set_state(at::impl::ThreadLocalPythonObjects());
  // Saved-tensor hooks (activation offloading) are Python objects too; copying them needs the
  // GIL, so only when there are any.
  if (!at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) {
    pybind11::gil_scoped_acquire gil;
    hooks_.emplace(at::SavedTensorDefaultHooks::get_tls_state());
    at::SavedTensorDefaultHooks::set_tls_state(at::impl::SavedTensorDefaultHooksTLS());
  }
}

NoPythonState::~NoPythonState() {
  at::impl::ThreadLocalPythonObjects::set_state(std::move(objects_));
  if (hooks_) {
    pybind11::gil_scoped_acquire gil;
    at::SavedTensorDefaultHooks::set_tls_state(*hooks_);
    hooks_.reset();
  }
}

}  // namespace hetlb
