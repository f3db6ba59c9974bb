#include "hook/emulation.h"

#include <c10/util/Exception.h>

#include <cmath>

#include "hook/clock.h"

namespace hetlb {

void Emulation::hold(double factor, double extra, double spin) {
  TORCH_CHECK(std::isfinite(factor) && factor >= 0 && std::isfinite(extra) && std::isfinite(spin) &&
                  spin >= 0,
              "hetlb StepCore.hold: need finite factor >= 0, extra and spin >= 0, got ", factor,
              ", ", extra, ", ", spin);
  factor_.store(factor, std::memory_order_relaxed);
  extra_.store(extra, std::memory_order_relaxed);
  spin_.store(spin, std::memory_order_relaxed);
  hold_.store(true, std::memory_order_release);
}

void Emulation::new_step() {
  hold_.store(false, std::memory_order_relaxed);
  no_progress_.store(false, std::memory_order_relaxed);
  factor_.store(1.0, std::memory_order_relaxed);
  extra_.store(0.0, std::memory_order_relaxed);
}

double Emulation::hold_until(double t0, double now) const {
  if (!hold_.load(std::memory_order_acquire)) return now;
  const double measured = now - t0;
  const double goal = measured * factor_.load(std::memory_order_relaxed) +
                      extra_.load(std::memory_order_relaxed);
  if (!(goal > measured)) return now;
  sleep_until(t0 + goal, spin_.load(std::memory_order_relaxed));
  return monotonic_seconds();
}

c10::intrusive_ptr<c10::ivalue::Future> Emulation::delay(
    c10::intrusive_ptr<c10::ivalue::Future> fut, int64_t nbytes) const {
  const double per_byte = seconds_per_byte();
  if (!(per_byte > 0)) return fut;
  const double seconds = per_byte * static_cast<double>(nbytes);
  const double spin = spin_.load(std::memory_order_relaxed);
  return fut->then(
      [seconds, spin](c10::ivalue::Future& done) -> c10::IValue {
        sleep_until(monotonic_seconds() + seconds, spin);
        return done.value();
      },
      fut->elementType());
}

}  // namespace hetlb
