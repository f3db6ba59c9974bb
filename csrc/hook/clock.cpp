#include "hook/clock.h"

#include <c10/util/Exception.h>

#include <algorithm>
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

c10::Event DeviceClock::event_now() {
  c10::Event e(device_.type(), c10::EventFlag::BACKEND_DEFAULT);
  e.record(impl_.getStream(device_));
  return e;
}

void DeviceClock::begin() {
  start_.emplace(event_now());
  waits_.clear();
  wait_start_.reset();
}

void DeviceClock::wait_begins() { wait_start_.emplace(event_now()); }

void DeviceClock::wait_ends() {
  if (!wait_start_) return;
  waits_.emplace_back(std::move(*wait_start_), event_now());
  wait_start_.reset();
}

double DeviceClock::end_and_read() {
  wait_start_.reset();
  if (!start_) {
    if (!ended_.empty()) {
      Ended& last = ended_.back();
      last.span.second.record(impl_.getStream(device_));
      for (auto& w : waits_) last.waits.push_back(std::move(w));
    }
    waits_.clear();
    return last_;
  }
  ended_.push_back(Ended{Pair(std::move(*start_), event_now()), std::move(waits_)});
  waits_.clear();  // (moved from: valid, unspecified)
  start_.reset();
  last_ = std::numeric_limits<double>::quiet_NaN();
  if (static_cast<int64_t>(ended_.size()) > depth_) {
    Ended& step = ended_.front();
    step.span.second.synchronize();
    double ms = step.span.first.elapsedTime(step.span.second);
    for (auto& [a, b] : step.waits) {
      b.synchronize();  // (on the end's stream it has completed; on another it may not have)
      ms -= a.elapsedTime(b);
    }
    last_ = std::max(ms, 0.0) / 1e3;
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
