// The weighted all-reduce communication hook in C++ (hetlb.aggregate's fast path).
//
// DDP calls a Python hook once per bucket with the GIL, and the future's continuation that
// unpacks the telemetry table runs Python on a Gloo thread: two GIL hand-offs and a few hundred
// microseconds of interpreter per step, on the critical path between a rank's last gradient and
// its next step. This hook does the same work without Python: scale each bucket by this rank's
// weight (hetlb::scale_), and on the last bucket pack the scaled gradient and this rank's
// telemetry slots into one buffer (hetlb::flatten_scaled) for one SUM all-reduce, then unpack the
// gradient (hetlb::unflatten_) and the [world, fields] table in the continuation. An emulated
// slower device (hetlb.emulate with a time model) is held to its deadline here too, sleeping
// without the GIL. Python only sets the weight, row and deadline before the backward pass and
// reads the table after it (DDP waits for every bucket's future, continuation included, before
// backward returns).
//
// Used for CPU float32/float64 buckets on a non-NCCL group (the Python hook covers NCCL's
// PREMUL_SUM, fp16/bf16 buckets and the emulated bandwidth cap). The semantics are those of
// hetlb.aggregate.weighted_allreduce_hook; tests compare the two.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace hetlb {
namespace {

double monotonic_seconds() {
  // CLOCK_MONOTONIC on Linux, the clock of Python's time.perf_counter().
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// State shared by Python (which sets the step's weight and row and reads the table) and the hook.
// Python writes only between steps, the hook only inside backward, and DDP's wait on the hooks'
// futures orders the two, so no lock is needed.
struct HookCore {
  HookCore(int64_t rank, int64_t world, int64_t fields)
      : rank(rank), world(world), fields(fields), row(fields, 0.0) {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && fields >= 1,
                "hetlb HookCore: need 0 <= rank < world and fields >= 1, got rank=", rank,
                " world=", world, " fields=", fields);
  }

  ~HookCore() {
    if (on_last && Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      on_last = py::object();
    }
  }

  const int64_t rank, world, fields;
  double weight = 1.0;
  std::vector<double> row;
  // Index into row where the hook stamps the compute time (< 0: never; Python's on_last does it).
  int64_t compute_col = -1;
  double t0 = 0.0;
  // Emulation (hetlb.emulate): hold the last bucket until this monotonic time, sleeping the bulk
  // and spinning the last `spin` seconds, without the GIL. -inf: no hold.
  double deadline = -std::numeric_limits<double>::infinity();
  double spin = 0.001;
  py::object on_last;  // optional: runs (with the GIL) when the last bucket is ready
  at::Tensor table;    // [world, fields] float64 once the last bucket's all-reduce completed
  int64_t hooks_run = 0;

  void reset(double w, py::array_t<double, py::array::c_style | py::array::forcecast> r) {
    TORCH_CHECK(std::isfinite(w), "hetlb HookCore.reset: weight must be finite, got ", w);
    TORCH_CHECK(r.ndim() == 1 && r.size() == fields, "hetlb HookCore.reset: row must have ", fields,
                " entries, got shape of size ", r.size());
    weight = w;
    std::memcpy(row.data(), r.data(), sizeof(double) * fields);
    table = at::Tensor();
    hooks_run = 0;
    deadline = -std::numeric_limits<double>::infinity();
    t0 = monotonic_seconds();
  }

  // Runs in the last bucket's hook, before its all-reduce is issued.
  void last_ready() {
    hold();
    if (compute_col >= 0) row[compute_col] = monotonic_seconds() - t0;
    if (on_last) {
      py::gil_scoped_acquire gil;
      py::object fn = on_last;  // the callback may clear on_last
      fn();
    }
  }

  void hold() const {
    for (;;) {
      const double left = deadline - monotonic_seconds();
      if (!(left > 0)) return;
      if (left > spin) std::this_thread::sleep_for(std::chrono::duration<double>(left - spin));
    }
  }
};

// The fused kernels of torch.ops.hetlb (csrc/cpu), called through the dispatcher like any op, so
// the native hook scales and packs with exactly the code the Python hook uses.
void hetlb_scale_(const at::Tensor& buf, double w) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hetlb::scale_", "")
                       .typed<void(at::TensorList, double)>();
  op.call(at::TensorList(buf), w);
}

at::Tensor hetlb_flatten_scaled(const at::Tensor& buf, double w, const at::Tensor& extra) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("hetlb::flatten_scaled", "")
          .typed<at::Tensor(at::TensorList, double, const std::optional<at::Tensor>&)>();
  return op.call(at::TensorList(buf), w, std::optional<at::Tensor>(extra));
}

void hetlb_unflatten_(const at::Tensor& flat, const at::Tensor& buf) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hetlb::unflatten_", "")
                       .typed<void(const at::Tensor&, at::TensorList, double)>();
  op.call(flat, at::TensorList(buf), 1.0);
}

class WeightedHook : public c10d::CommHookInterface {
 public:
  WeightedHook(c10::intrusive_ptr<c10d::ProcessGroup> pg, std::shared_ptr<HookCore> core)
      : pg_(std::move(pg)), core_(std::move(core)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buf = bucket.getBufferRef();
    TORCH_CHECK(buf.device().is_cpu() && (buf.scalar_type() == at::kFloat ||
                                          buf.scalar_type() == at::kDouble),
                "hetlb native comm hook: needs CPU float32/float64 buckets, got ",
                buf.scalar_type(), " on ", buf.device(),
                " (the Balancer picks the Python hook for such models; was the model changed "
                "after the Balancer was made?)");
    TORCH_CHECK(buf.is_contiguous(), "hetlb native comm hook: bucket buffer is not contiguous");
    HookCore& c = *core_;
    ++c.hooks_run;
    const double w = c.weight;
    // A rank with no samples may hold NaN gradients (mean over an empty batch); 0 * NaN = NaN.
    if (w == 0.0) buf.zero_();
    if (!bucket.isLast()) {
      if (w != 0.0 && w != 1.0) hetlb_scale_(buf, w);
      std::vector<at::Tensor> tensors{buf};
      return pg_->allreduce(tensors)->getFuture();
    }
    c.last_ready();
    // The row is read now: last_ready may have written the compute time into it. This rank's
    // row in a zeroed [world, fields] region: the SUM all-reduce fills in the others.
    const int64_t n = buf.numel(), slots = c.world * c.fields;
    at::Tensor region = at::zeros({slots}, at::kDouble);
    std::memcpy(region.data_ptr<double>() + c.rank * c.fields, c.row.data(),
                sizeof(double) * c.fields);
    at::Tensor flat = hetlb_flatten_scaled(buf, w == 0.0 ? 1.0 : w, region);
    std::vector<at::Tensor> tensors{flat};
    auto fut = pg_->allreduce(tensors)->getFuture();
    std::shared_ptr<HookCore> core = core_;
    return fut->then(
        [core, buf, n, slots](c10::ivalue::Future& done) -> c10::IValue {
          at::Tensor out = done.value().toTensorVector()[0];
          core->table =
              out.narrow(0, n, slots).to(at::kDouble).view({core->world, core->fields}).clone();
          hetlb_unflatten_(out, buf);
          return c10::IValue(buf);
        },
        c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  std::shared_ptr<HookCore> core_;
};

}  // namespace

void bind_comm_hook(py::module& m) {
  py::class_<HookCore, std::shared_ptr<HookCore>>(
      m, "HookCore", "Per-step state of the native weighted all-reduce hook (see hetlb.aggregate).")
      .def(py::init<int64_t, int64_t, int64_t>(), py::arg("rank"), py::arg("world"),
           py::arg("fields"))
      .def("reset", &HookCore::reset, py::arg("weight"), py::arg("row"),
           "Set this step's weight and row, forget the last table, start the compute clock.")
      .def(
          "set",
          [](HookCore& c, int64_t col, double value) {
            TORCH_CHECK(col >= 0 && col < c.fields, "hetlb HookCore.set: column must be in [0, ",
                        c.fields, "), got ", col);
            c.row[col] = value;
          },
          py::arg("col"), py::arg("value"),
          "Set one entry of this step's row (e.g. the compute time, from on_last).")
      .def(
          "hold_until",
          [](HookCore& c, double deadline, double spin) {
            TORCH_CHECK(!std::isnan(deadline) && std::isfinite(spin) && spin >= 0,
                        "hetlb HookCore.hold_until: need a deadline (not NaN) and a finite "
                        "spin >= 0, got deadline=", deadline, " spin=", spin);
            c.deadline = deadline;
            c.spin = spin;
          },
          py::arg("deadline"), py::arg("spin") = 0.001,
          "Hold this step's last bucket until `deadline` (monotonic seconds, the clock of "
          "time.perf_counter) before stamping the compute time and sending: an emulated slower "
          "device, without entering Python. reset() clears it.")
      .def_readonly("deadline", &HookCore::deadline)
      .def_readonly("rank", &HookCore::rank)
      .def_readonly("world", &HookCore::world)
      .def_readonly("fields", &HookCore::fields)
      .def_readonly("weight", &HookCore::weight)
      .def_readonly("hooks_run", &HookCore::hooks_run)
      .def_readwrite("compute_col", &HookCore::compute_col)
      .def_property(
          "on_last", [](const HookCore& c) { return c.on_last ? c.on_last : py::none(); },
          [](HookCore& c, py::object fn) {
            TORCH_CHECK(fn.is_none() || PyCallable_Check(fn.ptr()),
                        "hetlb HookCore.on_last: expected a callable or None, got ",
                        std::string(py::str(py::type::of(fn))));
            c.on_last = fn.is_none() ? py::object() : std::move(fn);
          },
          "Called (with the GIL) when the last bucket is ready, before it is sent; or None.")
      .def_property_readonly(
          "row",
          [](const HookCore& c) {
            py::array_t<double> out(static_cast<py::ssize_t>(c.fields));
            std::memcpy(out.mutable_data(), c.row.data(), sizeof(double) * c.fields);
            return out;
          },
          "A copy of this step's row (with the compute time once the last bucket was ready).")
      .def(
          "take_table",
          [](HookCore& c) -> py::object {
            if (!c.table.defined()) return py::none();
            at::Tensor t = std::move(c.table);
            c.table = at::Tensor();
            py::array_t<double> out({c.world, c.fields});
            std::memcpy(out.mutable_data(), t.data_ptr<double>(), sizeof(double) * t.numel());
            return out;
          },
          "The [world, fields] float64 table delivered by the last all-reduce (once), or None.");

  m.def(
      "register_comm_hook",
      [](py::object reducer, c10::intrusive_ptr<c10d::ProcessGroup> pg,
         std::shared_ptr<HookCore> core) {
        auto r = reducer.cast<std::shared_ptr<c10d::Reducer>>();
        TORCH_CHECK(core->world == pg->getSize() && core->rank == pg->getRank(),
                    "hetlb register_comm_hook: HookCore has rank ", core->rank, " of ", core->world,
                    " but the process group has rank ", pg->getRank(), " of ", pg->getSize());
        r->register_comm_hook(std::make_unique<WeightedHook>(std::move(pg), std::move(core)));
      },
      py::arg("reducer"), py::arg("process_group"), py::arg("core"),
      "Register the native weighted all-reduce hook on a DDP model's reducer (once per model).");

  m.def("monotonic", &monotonic_seconds,
        "Seconds of the monotonic clock the native hook stamps compute times with.");
}

}  // namespace hetlb
