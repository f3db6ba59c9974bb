// pybind11 bindings of csrc/hook: the StepCore class, register_comm_hook, step_calls and the
// monotonic clock. Each binding converts its arguments and calls one C++ entry point.
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/extension.h>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <vector>

#include "bindings.h"
#include "hook/clock.h"
#include "hook/fast_calls.h"
#include "hook/step_core.h"
#include "hook/weighted_hook.h"

namespace py = pybind11;

namespace hetlb {
namespace {

using row_array = py::array_t<double, py::array::c_style | py::array::forcecast>;
using GroupPtr = c10::intrusive_ptr<c10d::ProcessGroup>;

py::array_t<double> table_to_numpy(const at::Tensor& t, int64_t fields) {
  at::Tensor c = t.to(at::kDouble).contiguous();
  const int64_t rows = c.numel() / fields;
  py::array_t<double> out({rows, fields});
  std::memcpy(out.mutable_data(), c.data_ptr<double>(), sizeof(double) * rows * fields);
  return out;
}

void bind_step_core(py::module& m) {
  py::class_<StepCore, std::shared_ptr<StepCore>>(
      m, "StepCore",
      "One rank's step telemetry: weight, row, compute clock, emulator hold and the delivered "
      "table (see hetlb.telemetry.StepTelemetry, which owns it).")
      .def(py::init<int64_t, int64_t, int64_t, bool, bool, int64_t, int64_t,
                    std::optional<c10::Device>>(),
           py::arg("rank"), py::arg("world"), py::arg("fields"), py::arg("carry"), py::arg("nccl"),
           py::arg("compute_col"), py::arg("cpu_col"), py::arg("device") = py::none())
      .def(
          "start",
          [](StepCore& c, double weight, const row_array& r, double offset, bool new_window,
             int64_t pos, bool ship) {
            TORCH_CHECK(r.ndim() == 1, "hetlb StepCore.start: row must have ", c.fields(),
                        " entries, got ", r.size());
            c.open({weight, offset, new_window, pos, ship}, r.data(), static_cast<size_t>(r.size()),
                   RowValues::kRow);
          },
          py::arg("weight"), py::arg("row"), py::arg("offset") = 0.0, py::arg("new_window") = true,
          py::arg("pos") = 0, py::arg("ship") = true,
          "Open a step: this rank's weight and row; start the compute clock (plus `offset` seconds "
          "of earlier micro-steps of an accumulation window). `pos`: the step's position in its "
          "block (see set_block); `ship`: whether this step sends the table of positions 0..pos.")
      .def("set_columns", &StepCore::set_columns, py::arg("cols"),
           "The row's columns of begin()'s values, in order (with compute_col and cpu_col, each "
           "column once).")
      .def(
          "begin",
          [](StepCore& c, double weight, double offset, bool new_window, int64_t pos, bool ship,
             double v0, double v1, double v2, double v3, double v4, double v5, double v6, double v7,
             double v8) {
            const double values[] = {v0, v1, v2, v3, v4, v5, v6, v7, v8};
            c.open({weight, offset, new_window, pos, ship}, values, 9, RowValues::kColumns);
          },
          py::arg("weight"), py::arg("offset"), py::arg("new_window"), py::arg("pos"),
          py::arg("ship"), py::arg("v0"), py::arg("v1"), py::arg("v2"), py::arg("v3"),
          py::arg("v4"), py::arg("v5"), py::arg("v6"), py::arg("v7"), py::arg("v8"),
          "start() with the row's 9 values as numbers, in set_columns' order (compute NaN, CPU 0 "
          "until stamped): the step boundary's one call.")
      .def("end_kept", &StepCore::end_kept,
           "End a step that does not send the table (inside a block): stamp it unless a hook "
           "ended its compute, and close it. Returns whether a hook had ended it.")
      .def("set_block", &StepCore::set_block, py::arg("k"),
           "Keep the stamped rows of up to `k` steps, sent together by a step started with ship "
           "(k = 1: every step sends its own row). Between steps only.")
      .def("restart_clock", &StepCore::restart_clock,
           "Restart the compute clock at the step's first forward (later calls do nothing).")
      .def(
          "last_ready",
          [](StepCore& c, bool end_window) {
            py::gil_scoped_release nogil;
            return c.end_compute(end_window);
          },
          py::arg("end_window") = true,
          "Stamp compute time and CPU load now (holding first under emulation); returns the host "
          "compute seconds. The hook does this at the last bucket.")
      .def(
          "hold",
          [](StepCore& c, double factor, double extra, double spin) {
            c.emulation().hold(factor, extra, spin);
          },
          py::arg("factor"), py::arg("extra"), py::arg("spin") = 0.001,
          "Emulation for this step: hold its end until measured * factor + extra seconds.")
      .def(
          "report_no_progress", [](StepCore& c) { c.emulation().report_no_progress(); },
          "Emulation for this step: report its compute time as +inf (a rank making no progress).")
      .def("set", &StepCore::set, py::arg("col"), py::arg("value"),
           "Set one entry of this step's row.")
      .def(
          "take_table",
          [](StepCore& c) -> py::object {
            auto t = c.take_table();
            if (!t) return py::none();
            return table_to_numpy(*t, c.fields());
          },
          "The [world, fields] table delivered this step ([(pos + 1) * world, fields], step-major, "
          "for a block's shipping step), waiting for a pending side all-reduce, "
          "once; None if no exchange delivered one.")
      .def(
          "exchange",
          [](StepCore& c, GroupPtr group, int64_t kept) {
            at::Tensor t;
            {
              py::gil_scoped_release nogil;  // (see reduce)
              t = c.exchange(group, kept);
            }
            return table_to_numpy(t, c.fields());
          },
          py::arg("group"), py::arg("kept") = 0,
          "All-reduce this rank's row now (blocking; with a block, its rows of positions 0..pos) "
          "and return the table. `kept` >= 1: the kept rows of positions 0..kept-1 instead "
          "(kept_slots; a flush of the block's steps so far).")
      .def("close", &StepCore::close,
           "End the step: a backward pass after this raises until the next start().")
      .def(
          "reduce",
          [](StepCore& c, at::Tensor buffer, bool last, GroupPtr group, GroupPtr side) {
            TORCH_CHECK(group && side, "hetlb StepCore.reduce: need a process group and a side group "
                        "(the gradient group itself under Gloo), got None");
            // Without the GIL, as torch's own collective bindings: issuing a Gloo collective
            // takes the work queue's lock, which a Gloo thread may hold while it drops a
            // finished work's tensors, and that can need the GIL.
            py::gil_scoped_release nogil;
            auto fut = reduce_bucket(c, buffer, last, group, side);
            fut->wait();
            return c10d::detail::parseCppCommHookResult(fut->value());
          },
          py::arg("buffer"), py::arg("last"), py::arg("group"), py::arg("side_group"),
          "Run one bucket through the hook (as DDP would) and wait: the reduced bucket. For tests "
          "of the hook's paths (NCCL's PREMUL_SUM, a weight-0 bucket) without a DDP model.")
      .def(
          "store_table",
          [](StepCore& c, const row_array& t) {
            TORCH_CHECK(t.ndim() == 2 && t.shape(0) == c.table_rows() && t.shape(1) == c.fields(),
                        "hetlb StepCore.store_table: need a [", c.table_rows(), ", ", c.fields(),
                        "] table ((pos + 1) * world rows), got ", t.ndim() == 2 ? t.shape(0) : -1,
                        " rows in ", t.ndim(), " dimension(s)");
            at::Tensor table = at::empty({c.table_rows(), c.fields()}, at::kDouble);
            std::memcpy(table.data_ptr<double>(), t.data(), sizeof(double) * t.size());
            c.slot()->deliver(std::move(table));
          },
          py::arg("table"), "Reference hook: deliver the table of the carry transport.")
      .def(
          "adopt_side",
          [](StepCore& c, c10d::Work* work, at::Tensor buffer) {
            TORCH_CHECK(work != nullptr && buffer.numel() == c.table_rows() * c.fields() &&
                            buffer.scalar_type() == at::kDouble,
                        "hetlb StepCore.adopt_side: need a work and its float64 [(pos + 1) * world * "
                        "fields] buffer");
            c.slot()->adopt_side(c10::intrusive_ptr<c10d::Work>::reclaim_copy(work), buffer);
          },
          py::arg("work"), py::arg("buffer"),
          "Reference hook: a pending side all-reduce whose buffer holds the table.")
      .def_property_readonly("row", [](const StepCore& c) {
        py::array_t<double> out(static_cast<py::ssize_t>(c.fields()));
        c.copy_row(out.mutable_data());
        return out;
      }, "A copy of this step's row.")
      .def_property_readonly("slots", &StepCore::slots,
                             "This rank's rows of the block so far (positions 0..pos) in a zeroed "
                             "float64 [(pos + 1) * world * fields] tensor, step-major.")
      .def("kept_slots", &StepCore::kept_slots, py::arg("n"),
           "This rank's kept (stamped) rows of positions 0..n-1 in a zeroed float64 "
           "[n * world * fields] tensor, step-major (slots() without the open step).")
      .def("watch", &StepCore::watch, py::arg("params"),
           "The model's parameters, whose gradients grads_clear() inspects.")
      .def("grads_clear", &StepCore::grads_clear,
           "Whether no watched parameter holds a gradient (all are None).")
      .def_property("side_first", &StepCore::side_first, &StepCore::set_side_first,
                    "Side transport under Gloo: issue the table's all-reduce before the last "
                    "bucket's instead of after it (it then competes with the gradient's "
                    "transfer for the core; for benchmarks). Kept across steps.")
      .def_property("prescaled", &StepCore::prescaled, &StepCore::set_prescaled,
                    "The gradient of the backward in progress already carries this rank's weight "
                    "(the loss was scaled): the hook only sums. Reset by start().")
      .def_property_readonly(
          "carry_capacity", &StepCore::carry_capacity,
          "Elements of the carry transport's persistent buffer (the last bucket and a whole "
          "block's slots; 0 before the first carry).")
      .def_property_readonly("scaled_buckets", &StepCore::scaled_buckets,
                             "Buckets this step whose gradient the hook multiplied by the weight.")
      .def_property_readonly("rank", &StepCore::rank)
      .def_property_readonly("world", &StepCore::world)
      .def_property_readonly("fields", &StepCore::fields)
      .def_property_readonly("carry", &StepCore::carry)
      .def_property_readonly("nccl", &StepCore::nccl)
      .def_property_readonly("weight", &StepCore::weight)
      .def_property_readonly("block", &StepCore::block)
      .def_property_readonly("pos", &StepCore::pos)
      .def_property_readonly("ship", &StepCore::ship)
      .def_property_readonly("open", &StepCore::is_open)
      .def_property_readonly("restarted", &StepCore::restarted)
      .def_property_readonly("reduced", &StepCore::reduced)
      .def("mark_reduced", &StepCore::mark_reduced,
           "The step's gradient reduction finished on this rank (the Python reference hook).")
      .def_property_readonly("compute", &StepCore::compute)
      .def("add_wait", &StepCore::add_wait, py::arg("seconds"),
           "Seconds this step waited for the other ranks in the wrapper's own collectives, left "
           "out of its compute time (reset by start/begin).")
      .def("device_wait_begins", &StepCore::device_wait_begins,
           "A wait in the wrapper's collectives begins on the device's current stream: until "
           "device_wait_ends, its time is left out of the device clock's step (no-op on CPU).")
      .def("device_wait_ends", &StepCore::device_wait_ends,
           "The wait begun by device_wait_begins ends here on the device's current stream.")
      .def_property_readonly("waited", &StepCore::waited)
      .def_property("quiet", &StepCore::quiet, &StepCore::set_quiet,
                    "While True a backward does not end the step (a micro-step before the step's "
                    "last); reset by start/begin.")
      .def_property_readonly("hooks_run", &StepCore::hooks_run)
      .def_property_readonly("last_buckets", &StepCore::last_buckets)
      .def_property("seconds_per_byte", &StepCore::seconds_per_byte,
                    &StepCore::set_seconds_per_byte)
      .def_property("clock_depth", &StepCore::clock_depth, &StepCore::set_clock_depth,
                    "Steps by which device compute times are read late (0: the host clock, no "
                    "lag); settable before the first step only.")
      .def_property("cpu_interval", &StepCore::cpu_interval, &StepCore::set_cpu_interval,
                    "Seconds between fresh CPU-load readings (shorter windows are tick noise).");
}

}  // namespace

void bind_hook(py::module& m) {
  bind_step_core(m);

  m.def(
      "register_comm_hook",
      [](py::object reducer, std::shared_ptr<StepCore> core, GroupPtr pg, GroupPtr side,
         bool attached) {
        auto r = reducer.cast<std::shared_ptr<c10d::Reducer>>();
        register_weighted_hook(*r, std::move(core), std::move(pg), std::move(side), attached);
      },
      py::arg("reducer"), py::arg("core"), py::arg("process_group"), py::arg("side_group"),
      py::arg("attached") = false,
      "Register the weighted all-reduce hook on a DDP model's reducer (once per model); attached: "
      "the hook of another model trained on the same batches (weights only, no telemetry).");

  m.def("step_calls", &step_calls, py::arg("core"), py::arg("side") = py::none(),
        "The per-step calls bound to `core`, as plain builtins (no pybind11 dispatch at the cold "
        "step boundary): (begin, end_kept, restart_clock, watch), positional arguments only, the "
        "same as StepCore's methods of those names; watch(output) is the deferred hook's watch "
        "(side None: a watch raises).");

  m.def("monotonic", &monotonic_seconds,
        "Seconds of the monotonic clock the step core stamps compute times with.");
}

}  // namespace hetlb
