// The clocks a step is timed with: the host's monotonic clock, the machine's CPU load, and a
// device's compute time from events.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <optional>
#include <utility>
#include <vector>

namespace hetlb {

// Seconds of CLOCK_MONOTONIC on Linux, the clock of Python's time.perf_counter().
double monotonic_seconds();

// Sleeps until monotonic_seconds() reaches `deadline`, spinning through the last `spin` seconds.
void sleep_until(double deadline, double spin);

// Machine CPU utilisation in [0, 1] from /proc/stat (psutil.cpu_percent's definition: busy =
// total - idle - iowait, guest time counted once), refreshed at most every interval() seconds:
// the kernel counts in 10 ms ticks, so a shorter window is noise. read() runs on one thread at a
// time (the step's end); the interval may be set from another.
class CpuLoad {
 public:
  CpuLoad();

  double read(double now);

  double interval() const { return interval_.load(std::memory_order_relaxed); }
  void set_interval(double seconds);

 private:
  static bool sample(uint64_t& busy, uint64_t& total);

  std::atomic<double> interval_{0.2};
  double at_, last_ = 0.0;
  uint64_t busy_ = 0, total_ = 0;
};

// CUDA (or any accelerator) compute time from device events, read `depth` steps late (1 by
// default) so the host never waits for the device: that step's end event has normally completed
// long before. Reading it still waits for it, so the host can run at most `depth` steps ahead of
// the device; a deeper clock lets it run further (the compute column then lags its row by
// `depth` steps: StepTelemetry.lag).
class DeviceClock {
 public:
  explicit DeviceClock(c10::Device device);

  void begin();

  // Records this step's end; returns the seconds of the step `depth` steps before (NaN for the
  // first `depth` steps). A second end in the same step (a second backward) moves the step's end
  // event to now (its pair is the newest, not read yet: depth >= 1) and returns what the first
  // end read.
  double end_and_read();

  // A wait of the wrapper's own begins or ends on the device's current stream (FSDP2: the
  // compute stream waiting for an all-gather or the reduce-scatters, or stalled while the host
  // waits): the time between the two events is left out of the step's time when it is read. A
  // wait that began and did not end by the step's end is not counted.
  void wait_begins();
  void wait_ends();

  int64_t depth() const { return depth_; }

  // Before the first step only: the steps already ended would be read at the wrong lag.
  void set_depth(int64_t depth);

 private:
  c10::Device device_;
  c10::impl::VirtualGuardImpl impl_;
  int64_t depth_ = 1;
  double last_;
  using Pair = std::pair<c10::Event, c10::Event>;
  struct Ended {
    Pair span;               // the step's (start, end)
    std::vector<Pair> waits;  // the wrapper's waits inside it
  };
  c10::Event event_now();
  std::optional<c10::Event> start_, wait_start_;
  std::vector<Pair> waits_;  // of the step not ended yet
  std::deque<Ended> ended_;  // steps not read yet
};

}  // namespace hetlb
