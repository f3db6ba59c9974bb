// CHRONICA's data scheduler (per step) and data shuffler (per epoch).
//
// Time of rank r holding samples S: intercept_r + slope_r * sum(size of S). The scheduler is
// first-fit-decreasing: samples largest first (ties: lower index), each to the rank with the
// earliest predicted finish after taking it (ties: lower rank). For uniform slopes that is LPT with
// a heap; for related ranks the best rank depends on the sample's size, so all ranks are scanned.
#include <algorithm>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
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
  // Sorting (key, index) pairs keeps the comparisons in cache.
  std::vector<std::pair<double, int64_t>> keyed(items.size());
  for (size_t k = 0; k < items.size(); ++k) keyed[k] = {-sizes[items[k]], items[k]};
  std::sort(keyed.begin(), keyed.end());
  std::vector<int64_t> order(items.size());
  for (size_t k = 0; k < keyed.size(); ++k) order[k] = keyed[k].second;
  return order;
}

// Rank in [from, to) with the least intercept + slope * (load + s); lowest rank on ties.
int64_t argmin_finish(const double* intercept, const double* slope, const double* load, double s,
                      int64_t from, int64_t to) {
  double best = INFINITY;
  int64_t who = to;
  for (int64_t r = from; r < to; ++r) {
    const double f = intercept[r] + slope[r] * (load[r] + s);
    if (f < best) { best = f; who = r; }
  }
  return who;
}

#if defined(__x86_64__) && defined(__GNUC__)
bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}

// The same scan four ranks at a time, chosen at run time on CPUs with AVX2 (the build targets
// baseline x86-64). Separate multiplies and adds, as in the scalar loop, so the times and the
// choice are bit-identical to it and to hetlb.reference.schedule.
__attribute__((target("avx2"))) int64_t argmin_finish_avx2(const double* intercept,
                                                           const double* slope, const double* load,
                                                           double s, int64_t ranks) {
  const __m256d vs = _mm256_set1_pd(s);
  __m256d best = _mm256_set1_pd(INFINITY);
  __m256d who = _mm256_set1_pd(static_cast<double>(ranks));  // rank indices are exact in doubles
  __m256d idx = _mm256_setr_pd(0, 1, 2, 3);
  const __m256d four = _mm256_set1_pd(4);
  int64_t r = 0;
  for (; r + 4 <= ranks; r += 4) {
    const __m256d f = _mm256_add_pd(_mm256_loadu_pd(intercept + r),
                                    _mm256_mul_pd(_mm256_loadu_pd(slope + r),
                                                  _mm256_add_pd(_mm256_loadu_pd(load + r), vs)));
    const __m256d lt = _mm256_cmp_pd(f, best, _CMP_LT_OQ);
    best = _mm256_blendv_pd(best, f, lt);
    who = _mm256_blendv_pd(who, idx, lt);
    idx = _mm256_add_pd(idx, four);
  }
  double b[4], w[4];
  _mm256_storeu_pd(b, best);
  _mm256_storeu_pd(w, who);
  int64_t pick = argmin_finish(intercept, slope, load, s, r, ranks);
  double fb = pick < ranks ? intercept[pick] + slope[pick] * (load[pick] + s) : INFINITY;
  for (int l = 0; l < 4; ++l) {
    const int64_t k = static_cast<int64_t>(w[l]);
    if (b[l] < fb || (b[l] == fb && k < pick)) { fb = b[l]; pick = k; }
  }
  return pick;
}
#else
bool cpu_has_avx2() { return false; }
int64_t argmin_finish_avx2(const double*, const double*, const double*, double, int64_t) { return 0; }
#endif

// Places `order` (already largest first) on ranks with current loads `load`, each sample on the
// rank with the earliest finish after taking it (ties: lower rank).
void place_eft(const double* sizes, const std::vector<int64_t>& order, const double* slope,
               const double* intercept, int64_t ranks, std::vector<double>& load,
               std::vector<int64_t>& dest) {
  const bool uniform = std::all_of(slope, slope + ranks, [&](double a) { return a == slope[0]; });
  if (uniform) {
    // Equal slopes: earliest finish is the rank that is free first (LPT), a heap by (time, rank).
    using Entry = std::pair<double, int64_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    for (int64_t r = 0; r < ranks; ++r) heap.push({intercept[r] + slope[r] * load[r], r});
    for (int64_t i : order) {
      const int64_t r = heap.top().second;
      heap.pop();
      dest[i] = r;
      load[r] += sizes[i];
      heap.push({intercept[r] + slope[r] * load[r], r});
    }
    return;
  }
  // Related ranks: the best rank depends on the sample's size, so scan them all; the scan is a
  // branch-light loop over contiguous arrays (256 ranks: a few hundred nanoseconds a sample).
  const bool avx2 = cpu_has_avx2();
  for (int64_t i : order) {
    const double s = sizes[i];
    const int64_t r = avx2 ? argmin_finish_avx2(intercept, slope, load.data(), s, ranks)
                           : argmin_finish(intercept, slope, load.data(), s, 0, ranks);
    dest[i] = r;
    load[r] += s;
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
