#include "hook/step_core.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "hook/no_python.h"

namespace hetlb {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

}  // namespace

void StepCore::raise_outside_step() {
  TORCH_CHECK(false,
              "hetlb: a backward pass of the DDP model ran outside a balanced step. Iterate the "
              "Balancer's loader (each batch it hands out is one step), or wrap forward and "
              "backward in `with bal.step():`; with a plain DataLoader the gradient weights would "
              "be wrong. A second DDP model trained on another Balancer's batches is attached to "
              "that Balancer (bal.attach(model)) instead of given one of its own. This DDP model "
              "cannot be used again (its reducer stopped inside the backward pass): fix the loop "
              "and start over");
}

StepCore::StepCore(int64_t rank, int64_t world, int64_t fields, bool carry, bool nccl,
                   int64_t compute_col, int64_t cpu_col, std::optional<c10::Device> device)
    : rank_(rank), world_(world), fields_(fields), carry_(carry), nccl_(nccl),
      compute_col_(compute_col), cpu_col_(cpu_col), compute_(kNaN),
      slot_(std::make_shared<TableSlot>()) {
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world && fields >= 1,
              "hetlb StepCore: need 0 <= rank < world and fields >= 1, got rank=", rank,
              " world=", world, " fields=", fields);
  TORCH_CHECK(compute_col >= 0 && compute_col < fields && cpu_col >= 0 && cpu_col < fields,
              "hetlb StepCore: compute_col and cpu_col must be in [0, ", fields, "), got ",
              compute_col, " and ", cpu_col);
  TORCH_CHECK(!(carry && nccl), "hetlb StepCore: the carry transport needs a Gloo group, not NCCL");
  row_.assign(static_cast<size_t>(fields), 0.0);
  rows_.assign(static_cast<size_t>(fields), 0.0);
  if (device && !device->is_cpu()) clock_.emplace(*device);
}

// ---------------------------------------------------------------- configuration

void StepCore::set_columns(const std::vector<int64_t>& cols) {
  std::vector<int> seen(static_cast<size_t>(fields_), 0);
  for (int64_t c : cols) {
    TORCH_CHECK(c >= 0 && c < fields_, "hetlb StepCore.set_columns: a column must be in [0, ",
                fields_, "), got ", c);
    ++seen[static_cast<size_t>(c)];
  }
  ++seen[static_cast<size_t>(compute_col_)];
  ++seen[static_cast<size_t>(cpu_col_)];
  for (int64_t c = 0; c < fields_; ++c)
    TORCH_CHECK(seen[static_cast<size_t>(c)] == 1, "hetlb StepCore.set_columns: the ",
                cols.size(), " columns with compute_col ", compute_col_, " and cpu_col ", cpu_col_,
                " must name each of the ", fields_, " columns once; column ", c, " is named ",
                seen[static_cast<size_t>(c)], " times");
  value_cols_ = cols;
}

void StepCore::set_block(int64_t k) {
  TORCH_CHECK(k >= 1, "hetlb StepCore.set_block: need a block of at least 1 step, got ", k);
  TORCH_CHECK(!is_open(), "hetlb StepCore.set_block: a step is open");
  block_.store(k, std::memory_order_relaxed);
  pos_.store(0, std::memory_order_relaxed);
  ship_.store(true, std::memory_order_relaxed);
  rows_.assign(static_cast<size_t>(k * fields_), 0.0);
}

void StepCore::set_clock_depth(int64_t depth) {
  TORCH_CHECK(clock_, "hetlb StepCore.clock_depth: a CPU step core has no device clock (its "
              "compute times are not read late)");
  clock_->set_depth(depth);
}

bool StepCore::grads_clear() const {
  for (const auto& p : params_)
    if (p.grad().defined()) return false;
  return true;
}

// ---------------------------------------------------------------- emulation

Emulation& StepCore::emulation() {
  Emulation* e = emulation_.load(std::memory_order_relaxed);
  if (e == nullptr) {
    emulation_owner_ = std::make_unique<Emulation>();
    e = emulation_owner_.get();
    emulation_.store(e, std::memory_order_release);
  }
  return *e;
}

double StepCore::seconds_per_byte() const {
  const Emulation* e = emulation_if_any();
  return e != nullptr ? e->seconds_per_byte() : 0.0;
}

void StepCore::set_seconds_per_byte(double v) {
  if (v == 0.0 && emulation_if_any() == nullptr) return;
  emulation().set_seconds_per_byte(v);
}

// ---------------------------------------------------------------- the step

void StepCore::check_start(const StepStart& s, const char* what) const {
  TORCH_CHECK(std::isfinite(s.weight) && s.weight >= 0, "hetlb StepCore.", what,
              ": weight must be finite and >= 0, got ", s.weight);
  TORCH_CHECK(std::isfinite(s.offset) && s.offset >= 0, "hetlb StepCore.", what,
              ": offset must be finite and >= 0, got ", s.offset);
  const int64_t block = this->block();
  TORCH_CHECK(s.pos >= 0 && s.pos < block, "hetlb StepCore.", what, ": pos must be in [0, ", block,
              ") (the block set by set_block), got ", s.pos);
}

void StepCore::open(const StepStart& s, const double* values, size_t n, RowValues layout) {
  if (layout == RowValues::kRow) {
    TORCH_CHECK(n == static_cast<size_t>(fields_), "hetlb StepCore.start: row must have ",
                fields_, " entries, got ", n);
    check_start(s, "start");
    std::memcpy(row_.data(), values, sizeof(double) * n);
  } else {
    TORCH_CHECK(!value_cols_.empty(), "hetlb StepCore.begin: set_columns() was never called");
    TORCH_CHECK(n == value_cols_.size(), "hetlb StepCore.begin: need ", value_cols_.size(),
                " values (set_columns), got ", n);
    check_start(s, "begin");
    for (size_t i = 0; i < n; ++i) row_[static_cast<size_t>(value_cols_[i])] = values[i];
    row_[static_cast<size_t>(compute_col_)] = kNaN;
    row_[static_cast<size_t>(cpu_col_)] = 0.0;
  }
  pos_.store(s.pos, std::memory_order_relaxed);
  ship_.store(s.ship, std::memory_order_relaxed);
  weight_.store(s.weight, std::memory_order_relaxed);
  offset_.store(s.offset, std::memory_order_relaxed);
  waited_.store(0.0, std::memory_order_relaxed);
  quiet_.store(false, std::memory_order_relaxed);
  slot_->clear();
  factors_.clear();
  if (Emulation* e = emulation_if_any()) e->new_step();
  restarted_.store(false, std::memory_order_relaxed);
  reduced_.store(false, std::memory_order_relaxed);
  compute_.store(kNaN, std::memory_order_relaxed);
  hooks_run_.store(0, std::memory_order_relaxed);
  last_buckets_.store(0, std::memory_order_relaxed);
  scaled_buckets_.store(0, std::memory_order_relaxed);
  prescaled_.store(false, std::memory_order_relaxed);
  end_queued_.store(false, std::memory_order_relaxed);
  t0_.store(monotonic_seconds(), std::memory_order_relaxed);
  if (clock_ && s.new_window) clock_->begin();
  open_.store(true, std::memory_order_release);
}

void StepCore::restart_clock() {
  if (!is_open() || restarted_.load(std::memory_order_relaxed) || last_buckets() > 0) return;
  restarted_.store(true, std::memory_order_relaxed);
  t0_.store(monotonic_seconds(), std::memory_order_relaxed);
  if (clock_ && offset_.load(std::memory_order_relaxed) == 0.0) clock_->begin();
}

double StepCore::end_compute(bool end_window) {
  double now = monotonic_seconds();
  const double t0 = t0_.load(std::memory_order_relaxed);
  Emulation* emulation = emulation_if_any();
  if (emulation != nullptr) now = emulation->hold_until(t0, now);
  const double compute = offset_.load(std::memory_order_relaxed) + (now - t0) - waited();
  double reported = compute;
  if (clock_ && end_window) reported = clock_->end_and_read();  // host time stays in compute
  if (emulation != nullptr && emulation->no_progress()) reported = kInf;
  row_[static_cast<size_t>(compute_col_)] = reported;
  row_[static_cast<size_t>(cpu_col_)] = cpu_.read(now);
  std::memcpy(rows_.data() + pos() * fields_, row_.data(), sizeof(double) * fields_);
  compute_.store(compute, std::memory_order_relaxed);
  last_buckets_.fetch_add(1, std::memory_order_release);
  return compute;
}

bool StepCore::end_kept() {
  const bool hooked = last_buckets() > 0;
  if (!hooked) end_compute(true);
  close();
  return hooked;
}

void StepCore::set(int64_t col, double value) {
  TORCH_CHECK(col >= 0 && col < fields_, "hetlb StepCore.set: column must be in [0, ", fields_,
              "), got ", col);
  row_[static_cast<size_t>(col)] = value;
}

void StepCore::copy_row(double* out) const {
  std::memcpy(out, row_.data(), sizeof(double) * fields_);
}

// ---------------------------------------------------------------- the table

at::Tensor StepCore::kept_slots(int64_t n) const {
  TORCH_CHECK(n >= 1 && n <= block(), "hetlb StepCore.kept_slots: need 1 <= n <= block (", block(),
              "), got ", n);
  return region(n, false);
}

at::Tensor StepCore::region(int64_t kept, bool with_row) const {
  const int64_t n = kept + (with_row ? 1 : 0);
  at::Tensor out_t = at::zeros({n * world_ * fields_}, at::kDouble);
  double* out = out_t.data_ptr<double>();
  for (int64_t j = 0; j < kept; ++j)
    std::memcpy(out + (j * world_ + rank_) * fields_, rows_.data() + j * fields_,
                sizeof(double) * fields_);
  if (with_row)
    std::memcpy(out + (kept * world_ + rank_) * fields_, row_.data(), sizeof(double) * fields_);
  return out_t;
}

void StepCore::issue_side(c10d::ProcessGroup& group) { slot_->issue_side(group, slots()); }

std::optional<at::Tensor> StepCore::take_table() {
  TableSlot::Taken taken = slot_->take();
  if (!taken.side_work) return std::move(taken.table);
  {
    pybind11::gil_scoped_release nogil;
    taken.side_work->wait();
  }
  return taken.side_buffer.view({-1, fields_}).clone();
}

at::Tensor StepCore::exchange(const c10::intrusive_ptr<c10d::ProcessGroup>& group, int64_t kept) {
  TORCH_CHECK(group, "hetlb StepCore.exchange: need a process group, got None");
  TORCH_CHECK(kept >= 0 && kept <= block(), "hetlb StepCore.exchange: kept must be in [0, ",
              block(), "] (the block set by set_block), got ", kept);
  NoPythonState no_python;
  at::Tensor buf = kept > 0 ? kept_slots(kept) : slots();
  std::vector<at::Tensor> tensors{buf};
  group->allreduce(tensors)->wait();
  return buf.view({-1, fields_}).clone();
}

// ---------------------------------------------------------------- the hooks' per-bucket state

double StepCore::enter_bucket() {
  bump(hooks_run_);
  return weight();
}

at::Tensor StepCore::premul_factor(const at::Tensor& buf) {
  for (auto& f : factors_)
    if (f.first == buf.scalar_type() && f.second.device() == buf.device()) return f.second;
  // A tensor of the bucket's dtype on its device: c10d reads it through a pointer of the
  // reduced type, and a host-immediate bf16 factor is known to return zeros.
  at::Tensor t = at::full({}, weight(), buf.options());
  factors_.emplace_back(buf.scalar_type(), t);
  return t;
}

at::Tensor StepCore::carry_region(const at::Tensor& buf, int64_t nslots) {
  const int64_t n = buf.numel();
  if (!carry_buffer_.defined() || carry_buffer_.numel() < n + nslots ||
      carry_buffer_.scalar_type() != buf.scalar_type()) {
    carry_buffer_ = at::empty({n + block() * world_ * fields_}, buf.options());
    carry_capacity_.store(carry_buffer_.numel(), std::memory_order_relaxed);
  }
  return carry_buffer_.narrow(0, 0, n + nslots);
}

}  // namespace hetlb
