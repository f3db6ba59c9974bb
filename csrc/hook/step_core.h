// StepCore: one rank's step telemetry, the one store of it in the process.
//
// It holds this rank's weight and row, the compute clock, the CPU-load meter, the rows kept over
// a block of steps and the [world, fields] table the exchange delivers. Python
// (hetlb.telemetry.StepTelemetry) opens a step with its weight and row before the backward pass
// and reads the table after it; the weighted hook (hook/weighted_hook.h) or the deferred hook
// (hook/deferred_hook.h) ends the step's compute and ships the table while backward runs. The
// pure Python hook in hetlb.reference does the same through the bound methods (it is the test
// oracle of csrc/hook).
//
// Threads: Python opens, stamps, exchanges and closes steps; the hooks run on the autograd
// engine's thread for the model's device (the calling thread for a CPU model); an all-reduce's
// continuation runs on a Gloo thread and touches only the TableSlot, which has its own lock.
// Every scalar that one of these threads writes and another reads is an atomic. The vectors,
// clocks and buffers change hands at a backward's start and end, which the autograd engine
// orders (its ready queue, and Python's wait for the backward); besides, open() writes the row
// before it sets `open` (release), which the hook reads (acquire) before the row, and
// end_compute() writes the row and the block's rows before it counts `last_buckets` (release),
// which Python reads (acquire) before them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "hook/clock.h"
#include "hook/emulation.h"
#include "hook/table.h"

namespace hetlb {

// The arguments that open a step (StepCore::open).
struct StepStart {
  double weight;    // this rank's gradient weight, finite and >= 0
  double offset;    // seconds of earlier micro-steps of the accumulation window
  bool new_window;  // the first micro-step of a window: the device clock starts here
  int64_t pos;      // the step's position in its block, in [0, block)
  bool ship;        // whether this step sends the table of positions 0..pos
};

// How the values given to StepCore::open fill the row.
enum class RowValues {
  kRow,      // the whole row, `fields` values (StepCore.start)
  kColumns,  // the set_columns() columns in their order; compute NaN and CPU 0 (StepCore.begin)
};

class StepCore {
 public:
  StepCore(int64_t rank, int64_t world, int64_t fields, bool carry, bool nccl, int64_t compute_col,
           int64_t cpu_col, std::optional<c10::Device> device);
  StepCore(const StepCore&) = delete;
  StepCore& operator=(const StepCore&) = delete;

  // ---- fixed at construction
  int64_t rank() const { return rank_; }
  int64_t world() const { return world_; }
  int64_t fields() const { return fields_; }
  bool carry() const { return carry_; }  // the table rides in the last gradient bucket
  bool nccl() const { return nccl_; }    // the gradient group is NCCL (weights in PREMUL_SUM)

  // ---- configuration, between steps
  // The row's columns of open(kColumns)'s values, in order; with compute_col and cpu_col they
  // cover every column once, so a step leaves nothing of an earlier one in the row.
  void set_columns(const std::vector<int64_t>& cols);
  // Exchange every `k` steps (Balancer(exchange_every=)): each step's stamped row is kept at its
  // position in the block, and only a step with `ship` set sends the table, of the rows of
  // positions 0..pos of every rank ([(pos + 1) * world, fields], step-major). k = 1: every step.
  void set_block(int64_t k);
  int64_t block() const { return block_.load(std::memory_order_relaxed); }
  // Steps by which device compute times are read late (0: a CPU core, timed by the host clock).
  int64_t clock_depth() const { return clock_ ? clock_->depth() : 0; }
  void set_clock_depth(int64_t depth);
  double cpu_interval() const { return cpu_.interval(); }
  void set_cpu_interval(double seconds) { cpu_.set_interval(seconds); }
  // Side transport under Gloo: issue the table's all-reduce before the last bucket's instead of
  // from its continuation (see hook/weighted_hook.h).
  bool side_first() const { return side_first_.load(std::memory_order_relaxed); }
  void set_side_first(bool v) { side_first_.store(v, std::memory_order_relaxed); }
  // The model's parameters, whose gradients grads_clear() inspects.
  void watch(std::vector<at::Tensor> params) { params_ = std::move(params); }
  bool grads_clear() const;

  // ---- emulation (hook/emulation.h): created by the first call of emulation() (from Python,
  // between steps), never on the production path
  Emulation& emulation();
  Emulation* emulation_if_any() const { return emulation_.load(std::memory_order_acquire); }
  double seconds_per_byte() const;
  void set_seconds_per_byte(double v);

  // ---- the step
  // Opens a step: checks the arguments, fills the row from `values` (see RowValues), forgets
  // the previous step's table, counts and emulation, and starts the compute clock.
  void open(const StepStart& start, const double* values, size_t n, RowValues layout);
  // Timing starts at the step's first forward, not when the batch was handed over: restarts the
  // compute clock once, before any end of the compute.
  void restart_clock();
  // The end of this step's compute: holds for the emulator, stamps compute time and CPU load
  // into the row and keeps it at the step's block position; returns the host compute seconds.
  // Runs in the last bucket's hook, or from Python when no hook ran. A second backward in the
  // same step stamps again (the compute then spans both). A device clock is read only at the
  // end of an accumulation window (its events span the whole window).
  double end_compute(bool end_window);
  // Seconds of this step's host time spent waiting for the other ranks inside the wrapper's own
  // collectives (FSDP2's all-gathers and reduce-scatters), left out of its compute time. Reset
  // by open().
  void add_wait(double seconds) { waited_.store(waited() + seconds, std::memory_order_relaxed); }
  // The same waits on the device's stream, where a device clock times the step (DeviceClock's
  // wait_begins and wait_ends; nothing on the host clock, which add_wait serves).
  void device_wait_begins() {
    if (clock_) clock_->wait_begins();
  }
  void device_wait_ends() {
    if (clock_) clock_->wait_ends();
  }
  // While set, a backward does not end the step (the watch of a deferred hook or of FSDP2 skips
  // it): the micro-steps of a step before its last. Reset by open().
  bool quiet() const { return quiet_.load(std::memory_order_relaxed); }
  void set_quiet(bool v) { quiet_.store(v, std::memory_order_relaxed); }
  double waited() const { return waited_.load(std::memory_order_relaxed); }
  // Ends a step that does not send the table (inside a block): stamps it unless a hook ended its
  // compute, and closes it. Returns whether a hook had ended it.
  bool end_kept();
  // A backward pass after this raises until the next open().
  void close() { open_.store(false, std::memory_order_release); }
  // Sets one entry of this step's row.
  void set(int64_t col, double value);
  // The gradient of the backward in progress already carries the weight (the loss was scaled):
  // the hook sums without its own pass over the bucket. Reset by open().
  bool prescaled() const { return prescaled_.load(std::memory_order_relaxed); }
  void set_prescaled(bool v) { prescaled_.store(v, std::memory_order_relaxed); }

  bool is_open() const { return open_.load(std::memory_order_acquire); }
  // Whether the step's first forward ran (restart_clock), and whether its gradient's reduction
  // finished on this rank (the last bucket's all-reduce, or DDP's end of backward under the
  // deferred hook): the watchdog's "waiting for the others" lies between the two.
  bool restarted() const { return restarted_.load(std::memory_order_relaxed); }
  bool reduced() const { return reduced_.load(std::memory_order_acquire); }
  void mark_reduced() { reduced_.store(true, std::memory_order_release); }
  double weight() const { return weight_.load(std::memory_order_relaxed); }
  int64_t pos() const { return pos_.load(std::memory_order_relaxed); }
  bool ship() const { return ship_.load(std::memory_order_relaxed); }
  double compute() const { return compute_.load(std::memory_order_relaxed); }
  int64_t hooks_run() const { return hooks_run_.load(std::memory_order_relaxed); }
  int64_t last_buckets() const { return last_buckets_.load(std::memory_order_acquire); }
  int64_t scaled_buckets() const { return scaled_buckets_.load(std::memory_order_relaxed); }
  // Copies this step's row (`fields` values) to `out`.
  void copy_row(double* out) const;

  // ---- the table
  // This rank's rows in a zeroed [(pos + 1) * world * fields] float64 region (step-major: the
  // block's position j, then the rank): what a SUM all-reduce fills in. The current step's row
  // is the row (stamped or not); earlier positions are the block's stamped rows.
  at::Tensor slots() const { return region(pos(), true); }
  // The kept (stamped) rows of positions 0..n-1 alone, laid out as slots(): what a flush of a
  // block sends (the steps since the last exchange), whatever step is open now.
  at::Tensor kept_slots(int64_t n) const;
  int64_t table_rows() const { return (pos() + 1) * world_; }
  const std::shared_ptr<TableSlot>& slot() const { return slot_; }
  // Issues the side all-reduce of slots() on `group` now; the table is its result.
  void issue_side(c10d::ProcessGroup& group);
  // The delivered table (waiting, without the GIL, for the side all-reduce if one is pending),
  // or nullopt if nothing delivered one this step. Taken once. Called with the GIL held.
  std::optional<at::Tensor> take_table();
  // Blocking all-reduce of the row (a step in which no hook carried it) on `group`; returns the
  // table. kept >= 1: the kept rows of positions 0..kept-1 instead (kept_slots). Called without
  // the GIL.
  at::Tensor exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int64_t kept);

  // ---- what the weighted hook needs of the step, per bucket
  // Raises the "outside a balanced step" error unless a step is open.
  void require_open() const {
    if (!is_open()) raise_outside_step();
  }
  // Counts a bucket the hook runs; returns this step's weight.
  double enter_bucket();
  void count_scaled() { bump(scaled_buckets_); }
  // NCCL PREMUL_SUM's factor: this step's weight as a tensor of the bucket's dtype and device.
  at::Tensor premul_factor(const at::Tensor& buf);
  // The carry transport's persistent buffer for a bucket like `buf` followed by `nslots` table
  // entries: a contiguous prefix of one buffer kept across steps, sized for a whole block.
  at::Tensor carry_region(const at::Tensor& buf, int64_t nslots);
  int64_t carry_capacity() const { return carry_capacity_.load(std::memory_order_relaxed); }

  // ---- the deferred hook's end-of-backward callback (hook/deferred_hook.h)
  // Forgets a queued callback (a backward that raised ran none).
  void unqueue_end() { end_queued_.store(false, std::memory_order_relaxed); }
  // Marks the callback queued; false if it already was (another output of the same backward).
  bool queue_end() { return !end_queued_.exchange(true, std::memory_order_relaxed); }

  [[noreturn]] static void raise_outside_step();

 private:
  // A counter the hooks of several models may bump; read by Python after backward.
  static void bump(std::atomic<int64_t>& n) { n.fetch_add(1, std::memory_order_relaxed); }
  void check_start(const StepStart& s, const char* what) const;
  // The kept rows of positions 0..kept-1, then (with_row) the current row at position `kept`.
  at::Tensor region(int64_t kept, bool with_row) const;

  const int64_t rank_, world_, fields_;
  const bool carry_, nccl_;
  const int64_t compute_col_, cpu_col_;

  // Configuration: written by Python between steps only.
  std::atomic<int64_t> block_{1};
  std::vector<int64_t> value_cols_;
  std::vector<at::Tensor> params_;

  // The open step's scalars (see the file comment for who reads them where).
  std::atomic<bool> open_{false}, ship_{true}, prescaled_{false}, side_first_{false};
  std::atomic<bool> restarted_{false}, end_queued_{false}, reduced_{false}, quiet_{false};
  std::atomic<int64_t> pos_{0}, hooks_run_{0}, last_buckets_{0}, scaled_buckets_{0};
  std::atomic<int64_t> carry_capacity_{0};
  std::atomic<double> weight_{1.0}, t0_{0.0}, offset_{0.0}, compute_, waited_{0.0};
  // The open step's row, and the stamped rows of the block's positions ([block, fields]).
  std::vector<double> row_, rows_;

  CpuLoad cpu_;
  std::optional<DeviceClock> clock_;
  std::shared_ptr<TableSlot> slot_;
  // The hooks' state: NCCL PREMUL_SUM factors per dtype (this step), the carry buffer (kept).
  std::vector<std::pair<c10::ScalarType, at::Tensor>> factors_;
  at::Tensor carry_buffer_;

  std::unique_ptr<Emulation> emulation_owner_;
  std::atomic<Emulation*> emulation_{nullptr};
};

}  // namespace hetlb
