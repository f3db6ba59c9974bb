#include "hook/clock.h"

#include <c10/util/Exception.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <thread>

namespace hetlb {

double monotonic_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void sleep_until(double deadline, double spin) {
  for (;;) {
    const double left = deadline - monotonic_seconds();
    if (!(left > 0)) return;
    if (left > spin) std::this_thread::sleep_for(std::chrono::duration<double>(left - spin));
  }
}

CpuLoad::CpuLoad() : at_(-std::numeric_limits<double>::infinity()) { sample(busy_, total_); }

double CpuLoad::read(double now) {
  if (now - at_ < interval()) return last_;
  uint64_t busy = 0, total = 0;
  if (!sample(busy, total)) return last_;
  if (total > total_) last_ = static_cast<double>(busy - busy_) / static_cast<double>(total - total_);
  busy_ = busy;
  total_ = total;
  at_ = now;
  return last_;
}

void CpuLoad::set_interval(double seconds) {
  TORCH_CHECK(std::isfinite(seconds) && seconds >= 0,
              "hetlb StepCore.cpu_interval must be >= 0, got ", seconds);
  interval_.store(seconds, std::memory_order_relaxed);
}

bool CpuLoad::sample(uint64_t& busy, uint64_t& total) {
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

DeviceClock::DeviceClock(c10::Device device)
    : device_(device), impl_(device.type()), last_(std::numeric_limits<double>::quiet_NaN()) {}

void DeviceClock::begin() {
  start_.emplace(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  start_->record(impl_.getStream(device_));
}

double DeviceClock::end_and_read() {
  if (!start_) {
    if (!ended_.empty()) ended_.back().second.record(impl_.getStream(device_));
    return last_;
  }
  c10::Event end(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  end.record(impl_.getStream(device_));
  ended_.emplace_back(std::move(*start_), std::move(end));
  start_.reset();
  last_ = std::numeric_limits<double>::quiet_NaN();
  if (static_cast<int64_t>(ended_.size()) > depth_) {
    auto& [s, e] = ended_.front();
    e.synchronize();
    last_ = s.elapsedTime(e) / 1e3;
    ended_.pop_front();
  }
  return last_;
}

void DeviceClock::set_depth(int64_t depth) {
  TORCH_CHECK(depth >= 1, "hetlb DeviceClock: depth must be >= 1, got ", depth);
  TORCH_CHECK(ended_.empty() && !start_,
              "hetlb DeviceClock: the depth can only be set before the first step");
  depth_ = depth;
}

}  // namespace hetlb
