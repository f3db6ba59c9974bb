// Host algorithms of hetlb: exact min-max batch allocation, proportional rounding, size-aware
// step scheduling and epoch rebalancing. Plain C++ on raw arrays; csrc/solve/bindings.cpp binds
// them to NumPy. Every routine has a plain Python twin in hetlb/reference.py that the tests
// compare against.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace hetlb {

// One time model T(b) for b >= 1 in a packed form (see hetlb/models.py, `_native`):
//   kind 0 linear    params = {a0, a1}
//   kind 1 poly      params = coefficients, highest degree first (numpy.polyval order)
//   kind 2 piecewise params = {x_0..x_{k-1}, t_0..t_{k-1}} with x strictly increasing
// `cands` are the integer points where the running maximum of T can be attained besides 1 and b
// (floor/ceil of the real critical points or knots), sorted ascending.
struct ModelSpec {
  int kind;
  const double* params;
  int64_t nparams;
  const int64_t* cands;
  int64_t ncands;
};

// The allocations' arguments beyond their own checks: a total whose sums over the workers (at most
// n terms of up to total + 1) stay exact in int64, and lower bounds within it (a lower bound above
// the total cannot be met; summing such bounds could overflow).
inline void check_counts(const std::string& who, int64_t n, int64_t total,
                         const std::vector<int64_t>& lower) {
  if (total >= (int64_t{1} << 62) / (n + 1))
    throw std::invalid_argument(who + ": total=" + std::to_string(total) + " is too large for " +
                                std::to_string(n) + " workers (n * (total + 1) must stay below 2^62)");
  for (int64_t i = 0; i < n; ++i)
    if (lower[i] > total)
      throw std::invalid_argument(who + ": lower bound " + std::to_string(lower[i]) + " of worker " +
                                  std::to_string(i) + " exceeds total " + std::to_string(total));
}

// Minimal integer makespan allocation (LBB Eq. 3 with memory limits); see allocate.cpp.
std::vector<int64_t> allocate(const std::vector<ModelSpec>& models, int64_t total,
                              const std::vector<int64_t>& lower, const std::vector<int64_t>& upper);

// Effective (non-decreasing, non-negative) time of model m at batch sizes b; tau(0) = 0.
std::vector<double> effective_time(const ModelSpec& m, const std::vector<int64_t>& b);

// LB-BSP CPU rule: shares proportional to speed inside [lower, upper], largest-remainder rounding.
std::vector<int64_t> allocate_proportional(const std::vector<double>& speeds, int64_t total,
                                           const std::vector<int64_t>& lower,
                                           const std::vector<int64_t>& upper);

// CHRONICA step scheduler: rank of every sample (largest first, earliest predicted finish).
// Related ranks (slopes not all equal) are placed by groups of ranks from kGroupedRanks ranks on
// (grouped=false: by scanning every rank); simd=false forces the scalar scan (the AVX2 one is
// chosen at run time otherwise). All give bit-identical results, which ranks on different CPUs
// rely on. first >= 0 places that sample before the others (CHRONICA's random first pivot); cap
// (or nullptr) bounds each rank's summed size.
constexpr int64_t kGroupedRanks = 64;
std::vector<int64_t> schedule(const double* sizes, int64_t n, const double* slope,
                              const double* intercept, int64_t ranks, bool simd = true,
                              int64_t first = -1, const double* cap = nullptr, bool grouped = true);

// schedule's earliest-finish placement of `order` (sizes falling, but for a first pivot) on related
// ranks, scanning groups of ranks instead of every rank (see eft_groups.cpp); the same choices.
// now: every rank's time so far, intercept + slope * load (read only to start the groups).
void place_eft_grouped(const double* sizes, const std::vector<int64_t>& order, const double* slope,
                       const double* intercept, const double* now, int64_t ranks,
                       std::vector<double>& load, std::vector<int64_t>& dest, bool simd);

// Whether schedule's vector (AVX2) scan runs on this CPU.
bool schedule_simd_available();

// CHRONICA epoch shuffler: new owner of every sample (owner -1: held by no rank, must be placed),
// every rank's predicted time within tolerance (seconds; < 0: the largest sample on the slowest
// rank) of the equal-time level, moving the fewest samples that achieves it.
std::vector<int64_t> rebalance(const int64_t* owner, const double* sizes, int64_t n,
                               const double* slope, const double* intercept, int64_t ranks,
                               double tolerance = -1.0);

}  // namespace hetlb
