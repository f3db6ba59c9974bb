// Collectives issued without the thread's Python objects.
//
// torch stashes a contextvars context (and any saved-tensor hooks) in thread-local state during
// backward. A Gloo work captures the thread-local state it was created in and is destroyed on a
// Gloo thread; a Python object captured there would make that thread take the GIL. At teardown
// the main thread holds the GIL while the process group's destructor joins the Gloo threads, so
// such a work could deadlock the exit. Every collective of csrc/hook is therefore created under a
// NoPythonState, and continuations capture only a table slot and a weak reference to the side
// group (never the step core), so a Gloo thread keeps nothing alive that owns a process group.
#pragma once
#include <ATen/SavedTensorHooks.h>
#include <ATen/ThreadLocalPythonObjects.h>

#include <optional>

namespace hetlb {

// Clears the thread's Python objects for its lifetime and restores them after.
class NoPythonState {
 public:
  NoPythonState();
  ~NoPythonState();
  NoPythonState(const NoPythonState&) = delete;
  NoPythonState& operator=(const NoPythonState&) = delete;

 private:
  at::impl::ThreadLocalPythonObjects objects_;
  std::optional<at::impl::SavedTensorDefaultHooksTLS> hooks_;
};

}  // namespace hetlb
