// LB-BSP's CPU-mode rule x_i = v_i / sum(v) * X, made integral by largest-remainder rounding.
// With bounds the continuous shares are clip(lambda * v_i, lo_i, hi_i) for the lambda that makes
// them sum to X (water-filling); lambda is found exactly by a binary search over double bit
// patterns, then floors are topped up by the largest fractional parts (ties: lower index).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>
#include <string>

#include "solve/solve.h"

namespace hetlb {

// Slowest speed relative to the fastest that is told apart (see hetlb.allocate_proportional).
constexpr double kMinRatio = 1e-200;

std::vector<int64_t> allocate_proportional(const std::vector<double>& speeds, int64_t total,
                                           const std::vector<int64_t>& lower,
                                           const std::vector<int64_t>& upper) {
  const int64_t n = static_cast<int64_t>(speeds.size());
  if (n == 0) throw std::invalid_argument("allocate_proportional: no workers (empty speeds)");
  if (total < 0)
    throw std::invalid_argument("allocate_proportional: total must be >= 0, got " + std::to_string(total));
  if (static_cast<int64_t>(lower.size()) != n || static_cast<int64_t>(upper.size()) != n)
    throw std::invalid_argument("allocate_proportional: lower/upper must have one entry per worker (" +
                                std::to_string(n) + ")");
  check_counts("allocate_proportional", n, total, lower);
  std::vector<int64_t> lo(lower), hi(n);
  int64_t sum_lo = 0, sum_hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(speeds[i]) || speeds[i] < 0)
      throw std::invalid_argument("allocate_proportional: speed of worker " + std::to_string(i) +
                                  " must be finite and >= 0, got " + std::to_string(speeds[i]));
    if (lower[i] < 0 || lower[i] > upper[i])
      throw std::invalid_argument("allocate_proportional: need 0 <= lower <= upper for worker " +
                                  std::to_string(i) + " (lower=" + std::to_string(lower[i]) +
                                  ", upper=" + std::to_string(upper[i]) + ")");
    hi[i] = std::max(lo[i], std::min(upper[i], total));
    sum_lo += lo[i];
    sum_hi += hi[i];
  }
  if (sum_lo > total)
    throw std::invalid_argument("allocate_proportional: lower bounds sum to " + std::to_string(sum_lo) +
                                " > total " + std::to_string(total));
  if (sum_hi < total)
    throw std::invalid_argument("allocate_proportional: upper bounds sum to " + std::to_string(sum_hi) +
                                " < total " + std::to_string(total));

  // Workers of speed 0 keep their lower bound unless the others, full to their upper bounds,
  // cannot take the rest: then those are full and the speed-0 workers share the rest equally.
  int64_t pos_room = 0;
  for (int64_t i = 0; i < n; ++i) pos_room += speeds[i] > 0 ? hi[i] : lo[i];
  std::vector<double> v(n, 0.0);
  if (pos_room < total) {
    for (int64_t i = 0; i < n; ++i) {
      if (speeds[i] > 0) lo[i] = hi[i];
      else v[i] = 1.0;
    }
  } else {
    // Speeds relative to the fastest, floored at kMinRatio, so lambda <= total / kMinRatio stays
    // finite whatever the scale of the speeds (subnormal or huge).
    double vmax = 0.0;
    for (int64_t i = 0; i < n; ++i) vmax = std::max(vmax, speeds[i]);
    for (int64_t i = 0; i < n; ++i) v[i] = speeds[i] > 0 ? std::max(speeds[i] / vmax, kMinRatio) : 0.0;
  }
  auto share = [&](double lam, int64_t i) {
    if (!(v[i] > 0)) return static_cast<double>(lo[i]);
    return std::min(std::max(lam * v[i], static_cast<double>(lo[i])), static_cast<double>(hi[i]));
  };
  auto enough = [&](double lam) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += share(lam, i);
    return s >= static_cast<double>(total);
  };
  double top = 1.0;
  for (int k = 0; k < 2100 && !enough(top); ++k) top *= 2.0;  // reaches inf at worst
  if (!enough(top)) throw std::logic_error("allocate_proportional: internal error, no scale reaches total");
  uint64_t a = 0, z;
  std::memcpy(&z, &top, sizeof z);
  double lam = 0.0;
  if (!enough(0.0)) {
    while (z - a > 1) {
      const uint64_t mid = a + (z - a) / 2;
      double x;
      std::memcpy(&x, &mid, sizeof x);
      if (enough(x)) z = mid; else a = mid;
    }
    std::memcpy(&lam, &z, sizeof lam);
  }

  std::vector<int64_t> out(n);
  std::vector<double> frac(n);
  int64_t placed = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double x = share(lam, i);
    out[i] = std::min(std::max(static_cast<int64_t>(std::floor(x)), lo[i]), hi[i]);
    frac[i] = x - static_cast<double>(out[i]);
    placed += out[i];
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  // Rounding error can leave the floors a little off either way; both loops are bounded by n rounds.
  while (placed < total) {
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return frac[p] > frac[q]; });
    for (int64_t i : order) {
      if (placed == total) break;
      if (out[i] < hi[i]) { ++out[i]; frac[i] -= 1.0; ++placed; }
    }
  }
  while (placed > total) {
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return frac[p] < frac[q]; });
    for (int64_t i : order) {
      if (placed == total) break;
      if (out[i] > lo[i]) { --out[i]; frac[i] += 1.0; --placed; }
    }
  }
  return out;
}

}  // namespace hetlb
