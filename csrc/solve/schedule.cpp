// CHRONICA's data scheduler (per step) and data shuffler (per epoch).
//
// Time of rank r holding samples S: intercept_r + slope_r * sum(size of S). The scheduler is
// first-fit-decreasing: samples largest first (ties: lower index), each to the rank with the
// earliest predicted finish after taking it (ties: lower rank). For uniform slopes that is LPT; for
// related machines the "earliest finish" rule needs more than the least-loaded rank, so ranks sit in
// a heap by current time and are popped until no remaining rank could finish earlier (branch and
// bound with the smallest slope), which keeps a step of 4096 samples over 256 ranks well under 1 ms.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>

#include "solve/solve.h"

namespace hetlb {
namespace {

void check_rates(const double* slope, const double* intercept, int64_t ranks, bool positive,
                 const char* who) {
  if (ranks == 0) throw std::invalid_argument(std::string(who) + ": no ranks (empty slope)");
  for (int64_t r = 0; r < ranks; ++r) {
    if (!std::isfinite(slope[r]) || slope[r] < 0 || (positive && slope[r] == 0))
      throw std::invalid_argument(std::string(who) + ": slope of rank " + std::to_string(r) +
                                  (positive ? " must be finite and > 0" : " must be finite and >= 0") +
                                  ", got " + std::to_string(slope[r]));
    if (!std::isfinite(intercept[r]) || intercept[r] < 0)
      throw std::invalid_argument(std::string(who) + ": intercept of rank " + std::to_string(r) +
                                  " must be finite and >= 0, got " + std::to_string(intercept[r]));
  }
}

void check_sizes(const double* sizes, int64_t n, const char* who) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(sizes[i]) || sizes[i] < 0)
      throw std::invalid_argument(std::string(who) + ": size of sample " + std::to_string(i) +
                                  " must be finite and >= 0, got " + std::to_string(sizes[i]));
}

std::vector<int64_t> decreasing(const double* sizes, const std::vector<int64_t>& items) {
  std::vector<int64_t> order(items);
  std::sort(order.begin(), order.end(), [&](int64_t p, int64_t q) {
    return sizes[p] > sizes[q] || (sizes[p] == sizes[q] && p < q);
  });
  return order;
}

// Places `order` (already largest first) on ranks with current loads `load`, earliest finish first.
void place_eft(const double* sizes, const std::vector<int64_t>& order, const double* slope,
               const double* intercept, int64_t ranks, std::vector<double>& load,
               std::vector<int64_t>& dest) {
  const double min_slope = *std::min_element(slope, slope + ranks);
  using Entry = std::pair<double, int64_t>;  // (current time, rank)
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (int64_t r = 0; r < ranks; ++r) heap.push({intercept[r] + slope[r] * load[r], r});
  std::vector<Entry> popped;
  for (int64_t i : order) {
    const double s = sizes[i];
    double best = INFINITY;
    int64_t who = -1;
    popped.clear();
    while (!heap.empty()) {
      const Entry e = heap.top();
      // Nobody left can finish before `best`; the slack absorbs rounding in the bound.
      if (who >= 0 && e.first + min_slope * s > best * (1 + 1e-12) + 1e-300) break;
      heap.pop();
      popped.push_back(e);
      const int64_t r = e.second;
      const double f = intercept[r] + slope[r] * (load[r] + s);
      if (f < best || (f == best && r < who)) { best = f; who = r; }
    }
    dest[i] = who;
    load[who] += s;
    for (const Entry& e : popped)
      heap.push({e.second == who ? intercept[who] + slope[who] * load[who] : e.first, e.second});
  }
}

}  // namespace

std::vector<int64_t> schedule(const double* sizes, int64_t n, const double* slope,
                              const double* intercept, int64_t ranks) {
  check_rates(slope, intercept, ranks, false, "schedule");
  check_sizes(sizes, n, "schedule");
  std::vector<int64_t> items(n);
  std::iota(items.begin(), items.end(), 0);
  std::vector<double> load(ranks, 0.0);
  std::vector<int64_t> dest(n, -1);
  place_eft(sizes, decreasing(sizes, items), slope, intercept, ranks, load, dest);
  return dest;
}

std::vector<int64_t> rebalance(const int64_t* owner, const double* sizes, int64_t n,
                               const double* slope, const double* intercept, int64_t ranks) {
  check_rates(slope, intercept, ranks, true, "rebalance");
  check_sizes(sizes, n, "rebalance");
  std::vector<std::vector<int64_t>> held(ranks);
  std::vector<double> load(ranks, 0.0);
  double total = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (owner[i] < 0 || owner[i] >= ranks)
      throw std::invalid_argument("rebalance: owner of sample " + std::to_string(i) + " is " +
                                  std::to_string(owner[i]) + ", outside [0, " + std::to_string(ranks) + ")");
    held[owner[i]].push_back(i);
    load[owner[i]] += sizes[i];
    total += sizes[i];
  }
  // Continuous target: the level T with sum_r max(0, (T - b_r) / a_r) = total, ranks by intercept.
  std::vector<int64_t> by_b(ranks);
  std::iota(by_b.begin(), by_b.end(), 0);
  std::stable_sort(by_b.begin(), by_b.end(), [&](int64_t p, int64_t q) { return intercept[p] < intercept[q]; });
  double inv = 0.0, wsum = 0.0, level = intercept[by_b[0]];
  for (int64_t k = 0; k < ranks; ++k) {
    const int64_t r = by_b[k];
    inv += 1.0 / slope[r];
    wsum += intercept[r] / slope[r];
    level = (total + wsum) / inv;
    if (k + 1 == ranks || level <= intercept[by_b[k + 1]]) break;
  }
  std::vector<int64_t> dest(owner, owner + n), storage;
  for (int64_t r = 0; r < ranks; ++r) {
    const double target = std::max(0.0, (level - intercept[r]) / slope[r]);
    double excess = load[r] - target;
    if (!(excess > 0)) continue;
    // Zero-size samples cost nothing anywhere: never worth a move.
    std::vector<int64_t> mine;
    for (int64_t i : held[r]) if (sizes[i] > 0) mine.push_back(i);
    std::stable_sort(mine.begin(), mine.end(), [&](int64_t p, int64_t q) { return sizes[p] < sizes[q]; });
    // Largest sample that still fits in the excess first: fewest moves. Excess only shrinks, so one
    // downward sweep finds them all; the smallest sample may overshoot if that halves |excess|.
    std::vector<char> taken(mine.size(), 0);
    int64_t p = static_cast<int64_t>(mine.size()) - 1;
    while (excess > 0) {
      while (p >= 0 && sizes[mine[p]] > excess) --p;
      if (p >= 0) {
        taken[p] = 1;
        storage.push_back(mine[p]);
        excess -= sizes[mine[p]];
        load[r] -= sizes[mine[p]];
        --p;
        continue;
      }
      const auto it = std::find(taken.begin(), taken.end(), 0);
      if (it != taken.end()) {
        const int64_t i = mine[it - taken.begin()];
        if (sizes[i] < 2 * excess) {
          storage.push_back(i);
          load[r] -= sizes[i];
        }
      }
      break;
    }
  }
  place_eft(sizes, decreasing(sizes, storage), slope, intercept, ranks, load, dest);
  return dest;
}

}  // namespace hetlb
