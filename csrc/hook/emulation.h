// Emulation of a slower device and a slower link (hetlb.emulate), for experiments on one machine.
// The step core holds one only once Python asks for emulation (StepCore.hold, report_no_progress,
// seconds_per_byte); without it the hot path tests one pointer and runs no emulation code.
#pragma once
#include <ATen/core/ivalue.h>

#include <atomic>
#include <cstdint>

namespace hetlb {

class Emulation {
 public:
  // This step: the compute is held until measured * factor + extra seconds have passed, the
  // last `spin` seconds of the wait spinning (the spin is kept for later steps and links).
  void hold(double factor, double extra, double spin);

  // This step: its compute time is reported as +inf (a rank making no progress).
  void report_no_progress() { no_progress_.store(true, std::memory_order_relaxed); }

  // Forgets this step's hold and no-progress report.
  void new_step();

  // The end of a compute that started at `t0` and was measured to end at `now`: sleeps while
  // held; returns the monotonic time after.
  double hold_until(double t0, double now) const;

  bool no_progress() const { return no_progress_.load(std::memory_order_relaxed); }

  // The emulated link: every bucket's result arrives seconds_per_byte * its bytes later.
  double seconds_per_byte() const { return seconds_per_byte_.load(std::memory_order_relaxed); }
  void set_seconds_per_byte(double v) { seconds_per_byte_.store(v, std::memory_order_relaxed); }

  // `fut` delayed by the emulated link for `nbytes` (itself when the link is not emulated).
  c10::intrusive_ptr<c10::ivalue::Future> delay(c10::intrusive_ptr<c10::ivalue::Future> fut,
                                                int64_t nbytes) const;

 private:
  // Set by Python between steps, read by the thread that ends the step's compute.
  std::atomic<bool> hold_{false}, no_progress_{false};
  std::atomic<double> factor_{1.0}, extra_{0.0}, spin_{0.001}, seconds_per_byte_{0.0};
};

}  // namespace hetlb
