// The weighted all-reduce communication hook and the per-step telemetry core it shares with Python.
//
// StepCore is the one store of a step's telemetry: this rank's weight and row, the compute clock,
// the emulator's hold, the CPU-load meter, and the [world, fields] table the exchange delivers.
// Python (hetlb.telemetry.StepTelemetry) writes the weight and row before the backward pass and
// reads the table after it; the hook reads and writes the same core while DDP runs it. The pure
// Python hook in hetlb.reference does the same through this object's methods (it is the test
// oracle of this file).
//
// Per bucket the hook multiplies the gradient by this rank's weight (hetlb::scale_, or NCCL's
// PREMUL_SUM) and SUM all-reduces it. (DDP copies gradients into buckets without averaging once a
// hook is registered, so this pass is what every communication hook pays; NCCL's PREMUL_SUM
// fuses it into the reduction; Balancer.backward skips it by scaling the loss instead, which
// sets `prescaled`.) When the last bucket is ready it stamps the step's compute
// time and CPU load into the row (holding the bucket first when an emulated slower device says
// so) and ships the row with one of two transports, agreed by all ranks at start-up:
//   carry: the row rides in a zeroed [world, fields] region appended to the last bucket in a
//          persistent buffer (the scaled gradient is written into it in the pass that would
//          otherwise scale the bucket; DDP copies the result out of it), so the gradient's own
//          all-reduce delivers the table;
//   side:  a separate small float64 all-reduce on a Gloo side group. Under Gloo it is issued
//          when the last bucket's all-reduce has finished (from that bucket's continuation):
//          issued beside the gradient's transfer, its thread competed with that transfer for
//          the core and cost a few per cent of the step on CPU (bench/RESULTS.md, "Homogeneous
//          overhead": where hetlb's 2-rank wall time goes).
//          Under NCCL (the gradient on the device, nothing to compete with), when the side
//          group is the gradient group, or with `side_first` (a switch for
//          bench/bench_overhead.py's side-by-side comparison) it is issued just before the last
//          bucket's. The step's end waits for it, normally long done.
// With a block of k steps (Balancer(exchange_every=k)) each step's stamped row is kept in the
// core and only the block's last step ships: its table holds the rows of every step of the block
// (carry's slot region or the side buffer grows to k tables); the other steps send nothing but
// the gradient.
//
// Nothing here holds a Python object, and every collective is issued with the thread's Python
// objects (torch stashes a contextvars context in thread-local state during backward) cleared:
// a Gloo work captures the thread-local state it was created in and is destroyed on a Gloo
// thread, and a captured Python object would make that thread take the GIL. At teardown the
// main thread holds the GIL while the process group's destructor joins the Gloo threads, so such
// a work could deadlock the exit. Continuations capture only a small table slot (never the
// core) and a weak reference to the side group, so a Gloo thread never keeps alive anything
// that owns a process group.
#include <ATen/SavedTensorHooks.h>
#include <ATen/ThreadLocalPythonObjects.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/extension.h>

#include "bindings.h"

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <deque>
#include <iterator>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

namespace py = pybind11;

namespace hetlb {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr const char* kOutsideStep =
    "hetlb: a backward pass of the DDP model ran outside a balanced step. Iterate the Balancer's "
    "loader (each batch it hands out is one step), or wrap forward and backward in `with "
    "bal.step():`; with a plain DataLoader the gradient weights would be wrong. A second DDP "
    "model trained on another Balancer's batches is attached to that Balancer (bal.attach(model)) "
    "instead of given one of its own. This DDP model cannot be used again (its reducer stopped "
    "inside the backward pass): fix the loop and start over";
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double monotonic_seconds() {
  // CLOCK_MONOTONIC on Linux, the clock of Python's time.perf_counter().
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sleep_until(double deadline, double spin) {
  for (;;) {
    const double left = deadline - monotonic_seconds();
    if (!(left > 0)) return;
    if (left > spin) std::this_thread::sleep_for(std::chrono::duration<double>(left - spin));
  }
}

// Machine CPU utilisation in [0, 1] from /proc/stat (psutil.cpu_percent's definition: busy =
// total - idle - iowait, guest time counted once), refreshed at most every `interval` seconds:
// the kernel counts in 10 ms ticks, so a shorter window is noise.
class CpuLoad {
 public:
  CpuLoad() { sample(busy_, total_); }

  double read(double now) {
    if (now - at_ < interval) return last_;
    uint64_t busy = 0, total = 0;
    if (!sample(busy, total)) return last_;
    if (total > total_) last_ = static_cast<double>(busy - busy_) / static_cast<double>(total - total_);
    busy_ = busy;
    total_ = total;
    at_ = now;
    return last_;
  }

  double interval = 0.2;

 private:
  static bool sample(uint64_t& busy, uint64_t& total) {
    std::FILE* f = std::fopen("/proc/stat", "r");
    if (f == nullptr) return false;
    unsigned long long v[10] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    const int n = std::fscanf(f, "cpu %llu %llu %llu %llu %llu %llu %llu %llu %llu %llu", &v[0],
                              &v[1], &v[2], &v[3], &v[4], &v[5], &v[6], &v[7], &v[8], &v[9]);
    std::fclose(f);
    if (n < 4) return false;
    // user nice system idle iowait irq softirq steal guest guest_nice; guest is inside user.
    total = v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
    busy = total - v[3] - v[4];
    return true;
  }

  double at_ = -kInf, last_ = 0.0;
  uint64_t busy_ = 0, total_ = 0;
};

// CUDA (or any accelerator) compute time from device events, read `depth` steps late (1 by
// default) so the host never waits for the device: that step's end event has normally completed
// long before. Reading it still waits for it, so the host can run at most `depth` steps ahead of
// the device; a deeper clock lets it run further (the compute column then lags its row by
// `depth` steps: StepTelemetry.lag).
class DeviceClock {
 public:
  explicit DeviceClock(c10::Device device) : device_(device), impl_(device.type()) {}

  void begin() {
    start_.emplace(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    start_->record(impl_.getStream(device_));
  }

  // Records this step's end; returns the seconds of the step `depth` steps before (NaN for the
  // first `depth` steps). A second end in the same step (a second backward) moves the step's end
  // event to now (its pair is the newest, not read yet: depth >= 1) and returns what the first
  // end read.
  double end_and_read() {
    if (!start_) {
      if (!ended_.empty()) ended_.back().second.record(impl_.getStream(device_));
      return last_;
    }
    c10::Event end(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
    end.record(impl_.getStream(device_));
    ended_.emplace_back(std::move(*start_), std::move(end));
    start_.reset();
    last_ = kNaN;
    if (static_cast<int64_t>(ended_.size()) > depth_) {
      auto& [s, e] = ended_.front();
      e.synchronize();
      last_ = s.elapsedTime(e) / 1e3;
      ended_.pop_front();
    }
    return last_;
  }

  int64_t depth() const { return depth_; }

  // Before the first step only: the steps already ended would be read at the wrong lag.
  void set_depth(int64_t depth) {
    TORCH_CHECK(depth >= 1, "hetlb DeviceClock: depth must be >= 1, got ", depth);
    TORCH_CHECK(ended_.empty() && !start_, "hetlb DeviceClock: the depth can only be set before "
                "the first step");
    depth_ = depth;
  }

 private:
  c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  int64_t depth_ = 1;
  double last_ = kNaN;
  std::optional<c10::Event> start_;
  std::deque<std::pair<c10::Event, c10::Event>> ended_;  // (start, end) of steps not read yet
};

// What a step delivers the table with, written by an all-reduce's continuation (on a Gloo
// thread) and taken by Python after backward: the carry transport's table, or the side
// transport's pending all-reduce and its buffer. Separate from StepCore so the continuation
// holds nothing else.
struct TableSlot {
  std::mutex mu;
  at::Tensor table;
  c10::intrusive_ptr<c10d::Work> side_work;
  at::Tensor side_buffer;

  void clear() {
    std::lock_guard<std::mutex> lock(mu);
    table = at::Tensor();
    side_work.reset();
    side_buffer = at::Tensor();
  }

  void adopt_side(c10::intrusive_ptr<c10d::Work> work, at::Tensor buffer) {
    std::lock_guard<std::mutex> lock(mu);
    side_work = std::move(work);
    side_buffer = std::move(buffer);
  }
};

// Clears the thread's Python objects while a collective is created (see the file comment).
class NoPythonState {
 public:
  NoPythonState() : objects_(at::impl::ThreadLocalPythonObjects::get_state()) {
    at::impl::ThreadLocalPythonObjects::set_state(at::impl::ThreadLocalPythonObjects());
    // Saved-tensor hooks (activation offloading) are Python objects too; copying them needs the
    // GIL, so only when there are any.
    if (!at::SavedTensorDefaultHooks::get_tls_state().stack.empty()) {
      py::gil_scoped_acquire gil;
      hooks_.emplace(at::SavedTensorDefaultHooks::get_tls_state());
      at::SavedTensorDefaultHooks::set_tls_state(at::impl::SavedTensorDefaultHooksTLS());
    }
  }
  ~NoPythonState() {
    at::impl::ThreadLocalPythonObjects::set_state(std::move(objects_));
    if (hooks_) {
      py::gil_scoped_acquire gil;
      at::SavedTensorDefaultHooks::set_tls_state(*hooks_);
      hooks_.reset();
    }
  }
  NoPythonState(const NoPythonState&) = delete;
  NoPythonState& operator=(const NoPythonState&) = delete;

 private:
  at::impl::ThreadLocalPythonObjects objects_;
  std::optional<at::impl::SavedTensorDefaultHooksTLS> hooks_;
};

// hetlb::scale_ (csrc/ops/cpu, csrc/ops/cuda) through the dispatcher like any op, so this hook and the
// Python reference run exactly the same arithmetic.
bool has_hetlb_kernel(const at::Tensor& t) {
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("hetlb::scale_", "");
  return handle.hasKernelForDispatchKey(c10::computeDispatchKey(std::nullopt, t.layout(), t.device()));
}

void scale_(const at::Tensor& buf, double w) {
  if (!has_hetlb_kernel(buf)) {  // e.g. CUDA tensors with an extension built without CUDA
    buf.mul_(w);
    return;
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hetlb::scale_", "")
                       .typed<void(at::TensorList, double)>();
  op.call(at::TensorList(buf), w);
}

py::array_t<double> table_to_numpy(const at::Tensor& t, int64_t fields) {
  at::Tensor c = t.to(at::kDouble).contiguous();
  const int64_t rows = c.numel() / fields;
  py::array_t<double> out({rows, fields});
  std::memcpy(out.mutable_data(), c.data_ptr<double>(), sizeof(double) * rows * fields);
  return out;
}

}  // namespace

// One rank's step telemetry (see the file comment). Python writes between steps and the hook only
// inside backward; DDP waits for every bucket's future before backward returns, which orders the
// two, so only the table slot (written on a Gloo thread) needs a lock.
struct StepCore {
  StepCore(int64_t rank, int64_t world, int64_t fields, bool carry, bool nccl, int64_t compute_col,
           int64_t cpu_col, std::optional<c10::Device> device)
      : rank(rank), world(world), fields(fields), carry(carry), nccl(nccl),
        compute_col(compute_col), cpu_col(cpu_col), rows(fields, 0.0), row(fields, 0.0),
        slot(std::make_shared<TableSlot>()) {
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && fields >= 1,
                "hetlb StepCore: need 0 <= rank < world and fields >= 1, got rank=", rank,
                " world=", world, " fields=", fields);
    TORCH_CHECK(compute_col >= 0 && compute_col < fields && cpu_col >= 0 && cpu_col < fields,
                "hetlb StepCore: compute_col and cpu_col must be in [0, ", fields, "), got ",
                compute_col, " and ", cpu_col);
    TORCH_CHECK(!(carry && nccl), "hetlb StepCore: the carry transport needs a Gloo group, not NCCL");
    if (device && !device->is_cpu()) clock.emplace(*device);
  }

  const int64_t rank, world, fields;
  const bool carry, nccl;
  const int64_t compute_col, cpu_col;

  // Exchange every `block` steps (Balancer(exchange_every=)): each step's stamped row is kept at
  // its position in `rows`, and only a step with `ship` set sends the table, of the rows of
  // positions 0..pos of every rank ([(pos + 1) * world, fields], step-major). block = 1 is the
  // per-step exchange.
  int64_t block = 1, pos = 0;
  bool ship = true;
  std::vector<double> rows;

  // This step (set by start()).
  bool open = false;
  double weight = 1.0;
  std::vector<double> row;
  double t0 = 0.0, offset = 0.0;
  bool restarted = false;
  // Emulation: the compute is held until measured * hold_factor + hold_extra seconds have passed.
  bool hold = false, no_progress = false;
  double hold_factor = 1.0, hold_extra = 0.0, spin = 0.001;
  double seconds_per_byte = 0.0;  // emulated link: every bucket's result arrives this much later
  double compute = kNaN;          // the stamped compute seconds (host clock), NaN until stamped
  int64_t hooks_run = 0, last_buckets = 0;
  // The gradient already carries the weight (Balancer.backward scaled the loss; set by Python
  // around that backward only): the hook sums without its own pass over the bucket.
  bool prescaled = false;
  // Issue the side table before the last bucket's all-reduce even under Gloo (see the file comment).
  bool side_first = false;
  int64_t scaled_buckets = 0;  // buckets this step the hook applied the weight to
  bool end_queued = false;     // a deferred hook's end-of-backward callback is queued (watch_output)
  std::vector<at::Tensor> params;  // the model's parameters, for grads_clear()

  CpuLoad cpu;
  std::optional<DeviceClock> clock;
  std::shared_ptr<TableSlot> slot;
  std::vector<std::pair<c10::ScalarType, at::Tensor>> factors;  // NCCL PREMUL_SUM, per dtype
  at::Tensor flat_;  // carry transport: the last bucket and the slots, reused every step

  void set_block(int64_t k) {
    TORCH_CHECK(k >= 1, "hetlb StepCore.set_block: need a block of at least 1 step, got ", k);
    TORCH_CHECK(!open, "hetlb StepCore.set_block: a step is open");
    block = k;
    pos = 0;
    ship = true;
    rows.assign(static_cast<size_t>(k * fields), 0.0);
  }

  void start(double w, const double* r, double off, bool new_window, int64_t at = 0, bool send = true) {
    check_start(w, off, at, "start");
    std::memcpy(row.data(), r, sizeof(double) * fields);
    open_step(w, off, new_window, at, send);
  }

  // The row's columns of begin()'s values, in its argument order; with compute_col and cpu_col
  // they cover every column once, so begin() leaves nothing of an earlier step in the row.
  std::vector<int64_t> value_cols;

  void set_columns(const std::vector<int64_t>& cols) {
    std::vector<int> seen(static_cast<size_t>(fields), 0);
    for (int64_t c : cols) {
      TORCH_CHECK(c >= 0 && c < fields, "hetlb StepCore.set_columns: a column must be in [0, ",
                  fields, "), got ", c);
      ++seen[static_cast<size_t>(c)];
    }
    ++seen[static_cast<size_t>(compute_col)];
    ++seen[static_cast<size_t>(cpu_col)];
    for (int64_t c = 0; c < fields; ++c)
      TORCH_CHECK(seen[static_cast<size_t>(c)] == 1, "hetlb StepCore.set_columns: the ",
                  cols.size(), " columns with compute_col ", compute_col, " and cpu_col ", cpu_col,
                  " must name each of the ", fields, " columns once; column ", c, " is named ",
                  seen[static_cast<size_t>(c)], " times");
    value_cols = cols;
  }

  // start() with the row's values as numbers (in set_columns' order; compute NaN and CPU 0 until
  // stamped): the step boundary's one call, without building a row array first.
  void begin(double w, double off, bool new_window, int64_t at, bool send, const double* values,
             size_t n) {
    TORCH_CHECK(!value_cols.empty(), "hetlb StepCore.begin: set_columns() was never called");
    TORCH_CHECK(n == value_cols.size(), "hetlb StepCore.begin: need ", value_cols.size(),
                " values (set_columns), got ", n);
    check_start(w, off, at, "begin");
    for (size_t i = 0; i < n; ++i) row[static_cast<size_t>(value_cols[i])] = values[i];
    row[static_cast<size_t>(compute_col)] = kNaN;
    row[static_cast<size_t>(cpu_col)] = 0.0;
    open_step(w, off, new_window, at, send);
  }

  // End a step inside a block (it does not send the table): stamped here unless a hook ended its
  // compute, and closed. Returns whether a hook had ended it.
  bool end_kept() {
    const bool hooked = last_buckets > 0;
    if (!hooked) last_ready(true);
    open = false;
    return hooked;
  }

  void check_start(double w, double off, int64_t at, const char* what) const {
    TORCH_CHECK(std::isfinite(w) && w >= 0, "hetlb StepCore.", what,
                ": weight must be finite and >= 0, got ", w);
    TORCH_CHECK(std::isfinite(off) && off >= 0, "hetlb StepCore.", what,
                ": offset must be finite and >= 0, got ", off);
    TORCH_CHECK(at >= 0 && at < block, "hetlb StepCore.", what, ": pos must be in [0, ", block,
                ") (the block set by set_block), got ", at);
  }

  void open_step(double w, double off, bool new_window, int64_t at, bool send) {
    pos = at;
    ship = send;
    weight = w;
    offset = off;
    slot->clear();
    factors.clear();
    hold = no_progress = restarted = false;
    hold_factor = 1.0;
    hold_extra = 0.0;
    compute = kNaN;
    hooks_run = last_buckets = scaled_buckets = 0;
    prescaled = end_queued = false;
    open = true;
    t0 = monotonic_seconds();
    if (clock && new_window) clock->begin();
  }

  // Timing starts at the step's first forward, not when the batch was handed over.
  void restart_clock() {
    if (!open || restarted || last_buckets > 0) return;
    restarted = true;
    t0 = monotonic_seconds();
    if (clock && offset == 0.0) clock->begin();
  }

  // The end of this step's compute: hold for the emulator, stamp compute time and CPU load.
  // Runs in the last bucket's hook, or from Python when no hook ran. A second backward in the
  // same step stamps again (the compute then spans both). A device clock is read only at the end
  // of an accumulation window (its events span the whole window).
  double last_ready(bool end_window = true) {
    double now = monotonic_seconds();
    const double measured = now - t0;
    if (hold) {
      const double goal = measured * hold_factor + hold_extra;
      if (goal > measured) {
        sleep_until(t0 + goal, spin);
        now = monotonic_seconds();
      }
    }
    compute = offset + (now - t0);
    double reported = compute;
    if (clock && end_window) reported = clock->end_and_read();  // host time stays in `compute`
    if (no_progress) reported = kInf;
    row[compute_col] = reported;
    row[cpu_col] = cpu.read(now);
    std::memcpy(rows.data() + pos * fields, row.data(), sizeof(double) * fields);
    ++last_buckets;
    return compute;
  }

  // This rank's rows in a zeroed [(pos + 1) * world * fields] float64 region (step-major: the
  // block's position j, then the rank): what a SUM all-reduce fills in. The current step's row is
  // `row` (stamped or not); earlier positions are the block's stamped rows.
  at::Tensor slots() const { return region(pos, true); }

  // The kept (stamped) rows of positions 0..n-1 alone, laid out as slots(): what a flush of a
  // block sends (the steps since the last exchange), whatever step is open now.
  at::Tensor kept_slots(int64_t n) const {
    TORCH_CHECK(n >= 1 && n <= block, "hetlb StepCore.kept_slots: need 1 <= n <= block (", block,
                "), got ", n);
    return region(n, false);
  }

  // The kept rows of positions 0..kept-1, then (with_row) the current row at position `kept`.
  at::Tensor region(int64_t kept, bool with_row) const {
    const int64_t n = kept + (with_row ? 1 : 0);
    at::Tensor out_t = at::zeros({n * world * fields}, at::kDouble);
    double* out = out_t.data_ptr<double>();
    for (int64_t j = 0; j < kept; ++j)
      std::memcpy(out + (j * world + rank) * fields, rows.data() + j * fields, sizeof(double) * fields);
    if (with_row)
      std::memcpy(out + (kept * world + rank) * fields, row.data(), sizeof(double) * fields);
    return out_t;
  }

  int64_t table_rows() const { return (pos + 1) * world; }

  at::Tensor factor(const at::Tensor& buf) {
    for (auto& f : factors)
      if (f.first == buf.scalar_type() && f.second.device() == buf.device()) return f.second;
    // A tensor of the bucket's dtype on its device: c10d reads it through a pointer of the
    // reduced type, and a host-immediate bf16 factor is known to return zeros.
    at::Tensor t = at::full({}, weight, buf.options());
    factors.emplace_back(buf.scalar_type(), t);
    return t;
  }

  void launch_side(const c10::intrusive_ptr<c10d::ProcessGroup>& side) {
    at::Tensor buffer = slots();
    std::vector<at::Tensor> tensors{buffer};
    slot->adopt_side(side->allreduce(tensors), std::move(buffer));
  }

  // The side all-reduce issued once `fut` (the last bucket's all-reduce) has finished, from its
  // continuation on the Gloo thread; the row is taken now. A failed bucket issues nothing (DDP
  // raises, the step is dropped). The group is held weakly: whoever owns it decides its life.
  c10::intrusive_ptr<c10::ivalue::Future> side_after(
      c10::intrusive_ptr<c10::ivalue::Future> fut, const c10::intrusive_ptr<c10d::ProcessGroup>& side) {
    at::Tensor buffer = slots();
    std::shared_ptr<TableSlot> s = slot;
    c10::weak_intrusive_ptr<c10d::ProcessGroup> weak(side);
    return fut->then(
        [s, buffer, weak](c10::ivalue::Future& done) -> c10::IValue {
          c10::IValue value = done.value();
          if (auto group = weak.lock()) {
            std::vector<at::Tensor> tensors{buffer};
            s->adopt_side(group->allreduce(tensors), buffer);
          }
          return value;
        },
        fut->elementType());
  }

  c10::intrusive_ptr<c10::ivalue::Future> delayed(c10::intrusive_ptr<c10::ivalue::Future> fut,
                                                  int64_t nbytes) const {
    if (!(seconds_per_byte > 0)) return fut;
    const double delay = seconds_per_byte * static_cast<double>(nbytes);
    const double spin_s = spin;
    return fut->then(
        [delay, spin_s](c10::ivalue::Future& done) -> c10::IValue {
          sleep_until(monotonic_seconds() + delay, spin_s);
          return done.value();
        },
        fut->elementType());
  }

  c10::intrusive_ptr<c10::ivalue::Future> run_bucket(at::Tensor buf, bool last,
                                                     const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                                     const c10::intrusive_ptr<c10d::ProcessGroup>& side) {
    TORCH_CHECK(open, kOutsideStep);
    TORCH_CHECK(!buf.is_sparse(), "hetlb comm hook: got a sparse gradient bucket (layout ",
                buf.layout(), "); the Balancer weighs dense gradients only: build the model's "
                "embeddings with sparse=False");
    TORCH_CHECK(buf.is_contiguous(), "hetlb comm hook: bucket buffer is not contiguous (sizes ",
                buf.sizes(), ", strides ", buf.strides(), ")");
    NoPythonState no_python;
    ++hooks_run;
    const double w = weight;
    // A bucket needs the weight applied here unless it is 0 (zeroed below), 1, or already in it.
    const bool weigh = !prescaled && w != 0.0 && w != 1.0;
    const int64_t nbytes = buf.numel() * buf.element_size();
    // A rank without samples may hold NaN gradients (the mean over an empty batch), and
    // 0 * NaN = NaN would poison every rank: zero the bucket on every path.
    if (w == 0.0) buf.zero_();
    if (last) last_ready();
    const bool send = last && ship;  // (only a block's shipping step sends the table)
    std::vector<at::Tensor> tensors{buf};
    // Issued from a continuation, a collective on the gradient group itself could be ordered
    // differently on two ranks against DDP's own (find_unused_parameters' all-reduce): there
    // (and under NCCL, or when asked) the table goes first.
    const bool table_first = side_first || nccl || side.get() == pg.get();
    if (send && !carry && table_first) launch_side(side);
    if (nccl) {
      c10d::AllreduceOptions opts;
      if (weigh) {
        if (buf.scalar_type() == at::kBFloat16) {
          // c10d reads a bfloat16 PREMUL_SUM factor through a float (a tensor factor is refused,
          // a host one arrives as zero): scale the bucket here and sum, one pass on the device.
          buf.mul_(w);
        } else {
          // Built by hand: torch < 2.12 names the helper makeNCCLPreMulSum, later ones
          // makePreMulSum; the supplement's old name is kept as an alias in both.
          c10d::ReduceOp op;
          op.op_ = c10d::ReduceOp::PREMUL_SUM;
          op.supplement_ = c10::make_intrusive<c10d::NCCLPreMulSumSupplement>(factor(buf));
          opts.reduceOp = std::move(op);
        }
        ++scaled_buckets;
      }
      auto fut = pg->allreduce(tensors, opts)->getFuture();
      return delayed(fut, nbytes);
    }
    if (send && carry) {
      TORCH_CHECK(buf.device().is_cpu() && (buf.scalar_type() == at::kFloat ||
                                            buf.scalar_type() == at::kDouble),
                  "hetlb comm hook: the carry transport needs CPU float32/float64 buckets, got ",
                  buf.scalar_type(), " on ", buf.device(),
                  " (was the model changed after the Balancer was made?)");
      const int64_t n = buf.numel(), nslots = table_rows() * fields;
      // One persistent buffer for bucket + slots (a fresh one each step costs page faults):
      // the scaled gradient is written into it in one pass (it replaces the scaling pass), and
      // the hook returns a view of it, so DDP's own copy out of the result is the only one. It
      // holds a whole block's slots, so a shorter block (an epoch's end, the first step) sends a
      // prefix of it instead of reallocating.
      if (!flat_.defined() || flat_.numel() < n + nslots || flat_.scalar_type() != buf.scalar_type())
        flat_ = at::empty({n + block * world * fields}, buf.options());
      at::Tensor flat = flat_.narrow(0, 0, n + nslots);  // contiguous: a prefix
      at::Tensor head = flat.narrow(0, 0, n);
      if (weigh) {
        at::mul_out(head, buf, at::scalar_tensor(w, at::kDouble));
        ++scaled_buckets;
      } else {
        head.copy_(buf);  // (a weight-0 bucket was zeroed above)
      }
      flat.narrow(0, n, nslots).copy_(slots());
      std::vector<at::Tensor> packed{flat};
      auto fut = pg->allreduce(packed)->getFuture();
      const int64_t W = table_rows(), F = fields;
      std::shared_ptr<TableSlot> s = slot;
      auto unpacked = fut->then(
          [s, flat, n, nslots, W, F](c10::ivalue::Future& done) -> c10::IValue {
            // A failed all-reduce (a peer died) must fail the bucket: reading the buffer instead
            // would hand DDP this rank's own unreduced gradient as the sum.
            done.value();
            at::Tensor table = flat.narrow(0, n, nslots).to(at::kDouble).view({W, F}).clone();
            {
              std::lock_guard<std::mutex> lock(s->mu);
              s->table = std::move(table);
            }
            return c10::IValue(flat.narrow(0, 0, n));
          },
          c10::TensorType::get());
      return delayed(unpacked, nbytes);
    }
    if (weigh) {
      scale_(buf, w);
      ++scaled_buckets;
    }
    auto fut = pg->allreduce(tensors)->getFuture();
    if (send && !carry && !table_first) fut = side_after(fut, side);
    return delayed(fut, nbytes);
  }

  // The delivered table (waiting for the side all-reduce if one is pending), or None if nothing
  // delivered one this step. Taken once.
  std::optional<at::Tensor> take_table() {
    c10::intrusive_ptr<c10d::Work> work;
    at::Tensor buffer;
    {
      std::lock_guard<std::mutex> lock(slot->mu);
      if (!slot->side_work) {
        if (!slot->table.defined()) return std::nullopt;
        at::Tensor t = std::move(slot->table);
        slot->table = at::Tensor();
        return t;
      }
      work = std::move(slot->side_work);
      buffer = std::move(slot->side_buffer);
      slot->side_work.reset();
      slot->side_buffer = at::Tensor();
    }
    {
      py::gil_scoped_release nogil;
      work->wait();
    }
    return buffer.view({-1, fields}).clone();
  }

  // Whether no parameter holds a gradient (so a backward's result is that backward's alone).
  bool grads_clear() const {
    for (const auto& p : params)
      if (p.grad().defined()) return false;
    return true;
  }

  // Blocking all-reduce of the row (a step in which no hook carried it). Called without the GIL.
  // kept >= 1: the kept rows of positions 0..kept-1 instead (kept_slots).
  at::Tensor exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int64_t kept = 0) {
    NoPythonState no_python;
    at::Tensor buf = kept > 0 ? kept_slots(kept) : slots();
    std::vector<at::Tensor> tensors{buf};
    group->allreduce(tensors)->wait();
    return buf.view({-1, fields}).clone();
  }
};

// A deferred hook (hetlb.aggregate.BackwardWatch): the end of a backward of the model without a
// communication hook. A hook on the model's output `out` (it runs as the backward starts) checks
// that a step is open and queues an autograd final callback, which runs when the backward's
// compute is done and before DDP's own (queued when its last bucket is ready) waits for the
// all-reduces: it stamps the compute time and queues a second callback, which runs after DDP's
// and issues the side all-reduce of the table (the gradient is reduced by then: nothing to
// compete with). All of it native and on the backward's thread, without the GIL. A pass for given
// inputs (torch.autograd.grad, backward(inputs=)) is not the step's backward: DDP reduces
// nothing in it, and it is skipped. `end_queued` needs no lock: deferral is for CPU models only,
// whose hooks and callbacks all run on the thread that called backward.
void watch_output(const std::shared_ptr<StepCore>& core, const at::Tensor& out,
                  const c10::weak_intrusive_ptr<c10d::ProcessGroup>& weak) {
  TORCH_CHECK(out.requires_grad(), "hetlb step watch(): the tensor does not require grad");
  core->end_queued = false;  // (a backward that raised ran no callback)
  out.register_hook([core, weak](const at::Tensor&) {
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    if (exec_info != nullptr && !exec_info->empty()) return;
    TORCH_CHECK(core->open, kOutsideStep);
    if (core->end_queued) return;  // (another output of the same backward)
    core->end_queued = true;
    torch::autograd::Engine::get_default_engine().queue_callback([core, weak]() {
      core->end_queued = false;
      core->last_ready();
      torch::autograd::Engine::get_default_engine().queue_callback([core, weak]() {
        if (!core->ship) return;
        if (auto group = weak.lock()) {
          NoPythonState no_python;
          core->launch_side(group);
        }
      });
    });
  });
}

namespace {

// The balanced model's hook, or (attached) the hook of another DDP model trained on the same
// batches (Balancer.attach): the same weight, but its last bucket neither ends the step's
// compute nor sends the table, which the balanced model's hook does once per step.
class WeightedHook : public c10d::CommHookInterface {
 public:
  WeightedHook(std::shared_ptr<StepCore> core, c10::intrusive_ptr<c10d::ProcessGroup> pg,
               c10::intrusive_ptr<c10d::ProcessGroup> side, bool attached)
      : core_(std::move(core)), pg_(std::move(pg)), side_(std::move(side)), attached_(attached) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    return core_->run_bucket(bucket.getBufferRef(), bucket.isLast() && !attached_, pg_, side_);
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  std::shared_ptr<StepCore> core_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_, side_;
  const bool attached_;
};

using row_array = py::array_t<double, py::array::c_style | py::array::forcecast>;

// The calls every step makes (begin, end_kept, restart_clock, the deferred watch) as plain CPython
// builtins (vectorcall), bound to one core. They run with the caches cold from the step's
// compute, where pybind11's generic dispatcher (its function records, kwargs handling, a type
// caster that looks `StepCore&` up by type_index, ProcessGroup's holder caster) touches several
// hundred cache lines a call: callgrind put 4 such calls at about 570 of the ~1500 last-level
// cache misses hetlb added to a step (bench/RESULTS.md, "The step's misses counted by
// callgrind"). These parse their few arguments directly. The pybind methods of the same names stay, for everything else.
constexpr const char* kStepCalls = "hetlb.StepCalls";

struct StepCalls {
  std::shared_ptr<StepCore> core;
  c10::weak_intrusive_ptr<c10d::ProcessGroup> side;  // the watch's side group (weak: see above)
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

// begin(weight, offset, new_window, pos, ship, v0, ..., v7): StepCore.begin.
PyObject* calls_begin(PyObject* self, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 13) {
    PyErr_Format(PyExc_TypeError,
                 "hetlb step begin() takes 13 arguments (weight, offset, new_window, pos, ship "
                 "and the row's 8 values), got %zd", nargs);
    return nullptr;
  }
  double w = 0, off = 0, values[8];
  if (!as_double(args[0], w) || !as_double(args[1], off)) return nullptr;
  const int new_window = PyObject_IsTrue(args[2]);
  if (new_window < 0) return nullptr;
  const long long pos = PyLong_AsLongLong(args[3]);
  if (pos == -1 && PyErr_Occurred()) return nullptr;
  const int ship = PyObject_IsTrue(args[4]);
  if (ship < 0) return nullptr;
  for (int i = 0; i < 8; ++i)
    if (!as_double(args[5 + i], values[i])) return nullptr;
  try {
    calls_of(self).core->begin(w, off, new_window != 0, pos, ship != 0, values, 8);
  } catch (const std::exception& e) {
    return raise_cpp(e);
  }
  Py_RETURN_NONE;
}

// end_kept(): StepCore.end_kept.
PyObject* calls_end_kept(PyObject* self, PyObject* /*unused*/) {
  try {
    return PyBool_FromLong(calls_of(self).core->end_kept() ? 1 : 0);
  } catch (const std::exception& e) {
    return raise_cpp(e);
  }
}

// restart_clock(): StepCore.restart_clock.
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
     METH_FASTCALL, "StepCore.begin(weight, offset, new_window, pos, ship, v0, ..., v7), positional."},
    {"end_kept", calls_end_kept, METH_NOARGS, "StepCore.end_kept()."},
    {"restart_clock", calls_restart_clock, METH_NOARGS, "StepCore.restart_clock()."},
    {"watch", calls_watch, METH_O, "watch_output(output, side) with the side group bound: the deferred hook's watch."},
};

}  // namespace

void bind_hook(py::module& m) {
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
            TORCH_CHECK(r.ndim() == 1 && r.size() == c.fields, "hetlb StepCore.start: row must have ",
                        c.fields, " entries, got ", r.size());
            c.start(weight, r.data(), offset, new_window, pos, ship);
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
             double v0, double v1, double v2, double v3, double v4, double v5, double v6, double v7) {
            const double values[] = {v0, v1, v2, v3, v4, v5, v6, v7};
            c.begin(weight, offset, new_window, pos, ship, values, 8);
          },
          py::arg("weight"), py::arg("offset"), py::arg("new_window"), py::arg("pos"),
          py::arg("ship"), py::arg("v0"), py::arg("v1"), py::arg("v2"), py::arg("v3"),
          py::arg("v4"), py::arg("v5"), py::arg("v6"), py::arg("v7"),
          "start() with the row's 8 values as numbers, in set_columns' order (compute NaN, CPU 0 "
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
            return c.last_ready(end_window);
          },
          py::arg("end_window") = true,
          "Stamp compute time and CPU load now (holding first under emulation); returns the host "
          "compute seconds. The hook does this at the last bucket.")
      .def(
          "hold",
          [](StepCore& c, double factor, double extra, double spin) {
            TORCH_CHECK(std::isfinite(factor) && factor >= 0 && std::isfinite(extra) &&
                            std::isfinite(spin) && spin >= 0,
                        "hetlb StepCore.hold: need finite factor >= 0, extra and spin >= 0, got ",
                        factor, ", ", extra, ", ", spin);
            c.hold = true;
            c.hold_factor = factor;
            c.hold_extra = extra;
            c.spin = spin;
          },
          py::arg("factor"), py::arg("extra"), py::arg("spin") = 0.001,
          "Emulation for this step: hold its end until measured * factor + extra seconds.")
      .def(
          "report_no_progress", [](StepCore& c) { c.no_progress = true; },
          "Emulation for this step: report its compute time as +inf (a rank making no progress).")
      .def(
          "set",
          [](StepCore& c, int64_t col, double value) {
            TORCH_CHECK(col >= 0 && col < c.fields, "hetlb StepCore.set: column must be in [0, ",
                        c.fields, "), got ", col);
            c.row[col] = value;
          },
          py::arg("col"), py::arg("value"), "Set one entry of this step's row.")
      .def(
          "take_table",
          [](StepCore& c) -> py::object {
            auto t = c.take_table();
            if (!t) return py::none();
            return table_to_numpy(*t, c.fields);
          },
          "The [world, fields] table delivered this step ([(pos + 1) * world, fields], step-major, "
          "for a block's shipping step), waiting for a pending side all-reduce, "
          "once; None if no exchange delivered one.")
      .def(
          "exchange",
          [](StepCore& c, c10::intrusive_ptr<c10d::ProcessGroup> group, int64_t kept) {
            TORCH_CHECK(group, "hetlb StepCore.exchange: need a process group, got None");
            TORCH_CHECK(kept >= 0 && kept <= c.block, "hetlb StepCore.exchange: kept must be in [0, ",
                        c.block, "] (the block set by set_block), got ", kept);
            at::Tensor t;
            {
              py::gil_scoped_release nogil;  // (see reduce)
              t = c.exchange(group, kept);
            }
            return table_to_numpy(t, c.fields);
          },
          py::arg("group"), py::arg("kept") = 0,
          "All-reduce this rank's row now (blocking; with a block, its rows of positions 0..pos) "
          "and return the table. `kept` >= 1: the kept rows of positions 0..kept-1 instead "
          "(kept_slots; a flush of the block's steps so far).")
      .def(
          "close", [](StepCore& c) { c.open = false; },
          "End the step: a backward pass after this raises until the next start().")
      .def(
          "reduce",
          [](StepCore& c, at::Tensor buffer, bool last, c10::intrusive_ptr<c10d::ProcessGroup> group,
             c10::intrusive_ptr<c10d::ProcessGroup> side) {
            TORCH_CHECK(group && side, "hetlb StepCore.reduce: need a process group and a side group "
                        "(the gradient group itself under Gloo), got None");
            // Without the GIL, as torch's own collective bindings: issuing a Gloo collective
            // takes the work queue's lock, which a Gloo thread may hold while it drops a
            // finished work's tensors, and that can need the GIL.
            py::gil_scoped_release nogil;
            auto fut = c.run_bucket(buffer, last, group, side);
            fut->wait();
            return c10d::detail::parseCppCommHookResult(fut->value());
          },
          py::arg("buffer"), py::arg("last"), py::arg("group"), py::arg("side_group"),
          "Run one bucket through the hook (as DDP would) and wait: the reduced bucket. For tests "
          "of the hook's paths (NCCL's PREMUL_SUM, a weight-0 bucket) without a DDP model.")
      .def(
          "store_table",
          [](StepCore& c, const row_array& t) {
            TORCH_CHECK(t.ndim() == 2 && t.shape(0) == c.table_rows() && t.shape(1) == c.fields,
                        "hetlb StepCore.store_table: need a [", c.table_rows(), ", ", c.fields,
                        "] table ((pos + 1) * world rows), got ", t.ndim() == 2 ? t.shape(0) : -1,
                        " rows in ", t.ndim(), " dimension(s)");
            at::Tensor table = at::empty({c.table_rows(), c.fields}, at::kDouble);
            std::memcpy(table.data_ptr<double>(), t.data(), sizeof(double) * t.size());
            std::lock_guard<std::mutex> lock(c.slot->mu);
            c.slot->table = table;
          },
          py::arg("table"), "Reference hook: deliver the table of the carry transport.")
      .def(
          "adopt_side",
          [](StepCore& c, c10d::Work* work, at::Tensor buffer) {
            TORCH_CHECK(work != nullptr && buffer.numel() == c.table_rows() * c.fields &&
                            buffer.scalar_type() == at::kDouble,
                        "hetlb StepCore.adopt_side: need a work and its float64 [(pos + 1) * world * "
                        "fields] buffer");
            c.slot->adopt_side(c10::intrusive_ptr<c10d::Work>::reclaim_copy(work), buffer);
          },
          py::arg("work"), py::arg("buffer"),
          "Reference hook: a pending side all-reduce whose buffer holds the table.")
      .def_property_readonly("row", [](const StepCore& c) {
        py::array_t<double> out(static_cast<py::ssize_t>(c.fields));
        std::memcpy(out.mutable_data(), c.row.data(), sizeof(double) * c.fields);
        return out;
      }, "A copy of this step's row.")
      .def_property_readonly("slots", &StepCore::slots,
                             "This rank's rows of the block so far (positions 0..pos) in a zeroed "
                             "float64 [(pos + 1) * world * fields] tensor, step-major.")
      .def("kept_slots", &StepCore::kept_slots, py::arg("n"),
           "This rank's kept (stamped) rows of positions 0..n-1 in a zeroed float64 "
           "[n * world * fields] tensor, step-major (slots() without the open step).")
      .def(
          "watch",
          [](StepCore& c, std::vector<at::Tensor> params) { c.params = std::move(params); },
          py::arg("params"), "The model's parameters, whose gradients grads_clear() inspects.")
      .def("grads_clear", &StepCore::grads_clear,
           "Whether no watched parameter holds a gradient (all are None).")
      .def_readwrite("side_first", &StepCore::side_first,
                     "Side transport under Gloo: issue the table's all-reduce before the last "
                     "bucket's instead of after it (it then competes with the gradient's "
                     "transfer for the core; for benchmarks). Kept across steps.")
      .def_readwrite("prescaled", &StepCore::prescaled,
                     "The gradient of the backward in progress already carries this rank's weight "
                     "(the loss was scaled): the hook only sums. Reset by start().")
      .def_property_readonly(
          "carry_capacity", [](const StepCore& c) { return c.flat_.defined() ? c.flat_.numel() : 0; },
          "Elements of the carry transport's persistent buffer (the last bucket and a whole "
          "block's slots; 0 before the first carry).")
      .def_readonly("scaled_buckets", &StepCore::scaled_buckets,
                    "Buckets this step whose gradient the hook multiplied by the weight.")
      .def_readonly("rank", &StepCore::rank)
      .def_readonly("world", &StepCore::world)
      .def_readonly("fields", &StepCore::fields)
      .def_readonly("carry", &StepCore::carry)
      .def_readonly("nccl", &StepCore::nccl)
      .def_readonly("weight", &StepCore::weight)
      .def_readonly("block", &StepCore::block)
      .def_readonly("pos", &StepCore::pos)
      .def_readonly("ship", &StepCore::ship)
      .def_readonly("open", &StepCore::open)
      .def_readonly("compute", &StepCore::compute)
      .def_readonly("hooks_run", &StepCore::hooks_run)
      .def_readonly("last_buckets", &StepCore::last_buckets)
      .def_readwrite("seconds_per_byte", &StepCore::seconds_per_byte)
      .def_property(
          "clock_depth",
          [](const StepCore& c) -> int64_t { return c.clock ? c.clock->depth() : 0; },
          [](StepCore& c, int64_t depth) {
            TORCH_CHECK(c.clock, "hetlb StepCore.clock_depth: a CPU step core has no device clock "
                        "(its compute times are not read late)");
            c.clock->set_depth(depth);
          },
          "Steps by which device compute times are read late (0: the host clock, no lag); "
          "settable before the first step only.")
      .def_property(
          "cpu_interval", [](const StepCore& c) { return c.cpu.interval; },
          [](StepCore& c, double v) {
            TORCH_CHECK(std::isfinite(v) && v >= 0, "hetlb StepCore.cpu_interval must be >= 0, got ", v);
            c.cpu.interval = v;
          },
          "Seconds between fresh CPU-load readings (shorter windows are tick noise).");

  m.def(
      "register_comm_hook",
      [](py::object reducer, std::shared_ptr<StepCore> core,
         c10::intrusive_ptr<c10d::ProcessGroup> pg, c10::intrusive_ptr<c10d::ProcessGroup> side,
         bool attached) {
        auto r = reducer.cast<std::shared_ptr<c10d::Reducer>>();
        TORCH_CHECK(core && pg && side, "hetlb register_comm_hook: need a core, a process group and "
                    "a side group (the gradient group itself under Gloo), got None");
        TORCH_CHECK(core->world == pg->getSize() && core->rank == pg->getRank(),
                    "hetlb register_comm_hook: StepCore has rank ", core->rank, " of ", core->world,
                    " but the process group has rank ", pg->getRank(), " of ", pg->getSize());
        TORCH_CHECK(side->getSize() == pg->getSize(),
                    "hetlb register_comm_hook: the side group has ", side->getSize(),
                    " ranks, the gradient group ", pg->getSize());
        r->register_comm_hook(
            std::make_unique<WeightedHook>(std::move(core), std::move(pg), std::move(side), attached));
      },
      py::arg("reducer"), py::arg("core"), py::arg("process_group"), py::arg("side_group"),
      py::arg("attached") = false,
      "Register the weighted all-reduce hook on a DDP model's reducer (once per model); attached: "
      "the hook of another model trained on the same batches (weights only, no telemetry).");

  m.def(
      "step_calls",
      [](std::shared_ptr<StepCore> core, const py::object& group) {
        TORCH_CHECK(core, "hetlb step_calls: need a StepCore, got None");
        c10::intrusive_ptr<c10d::ProcessGroup> side;
        if (!group.is_none()) side = group.cast<c10::intrusive_ptr<c10d::ProcessGroup>>();
        TORCH_CHECK(!side || side->getSize() == core->world, "hetlb step_calls: need the side group of ",
                    core->world, " ranks, got one of ", side ? side->getSize() : 0);
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
      },
      py::arg("core"), py::arg("side") = py::none(),
      "The per-step calls bound to `core`, as plain builtins (no pybind11 dispatch at the cold "
      "step boundary): (begin, end_kept, restart_clock, watch), positional arguments only, the "
      "same as StepCore's methods of those names; watch(output) is the deferred hook's watch "
      "(side None: a watch raises).");

  m.def("monotonic", &monotonic_seconds,
        "Seconds of the monotonic clock the step core stamps compute times with.");
}

}  // namespace hetlb
