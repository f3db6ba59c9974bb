// The calls every step makes (begin, end_kept, restart_clock, the deferred watch) as plain
// CPython builtins (vectorcall) bound to one step core.
//
// They run with the caches cold from the step's compute, where pybind11's generic dispatcher
// (its function records, keyword handling, a type caster that looks `StepCore&` up by
// type_index, ProcessGroup's holder caster) touches several hundred cache lines a call
// (bench/RESULTS.md, "The step's misses counted by callgrind"). These parse their few positional
// arguments directly and call the same StepCore entry points as the bound methods.
#pragma once
#include <pybind11/pybind11.h>

#include <memory>

#include "hook/step_core.h"

namespace hetlb {

// (begin, end_kept, restart_clock, watch) bound to `core`; `side` (a ProcessGroup or None) is
// the group of the deferred watch's table (None: a watch raises).
pybind11::tuple step_calls(std::shared_ptr<StepCore> core, const pybind11::object& side);

}  // namespace hetlb
