// CHRONICA's data scheduler (per step) and data shuffler (per epoch).
//
// Time of rank r holding samples S: intercept_r + slope_r * sum(size of S). The scheduler is
// first-fit-decreasing: samples largest first (ties: lower index), each to the rank with the
// earliest predicted finish after taking it (ties: the rank free first, then the lower rank). For
// uniform slopes that is LPT with a heap; for a few related ranks all ranks are scanned, for many
// groups of them (eft_groups.cpp).
#include <algorithm>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <numeric>
#include <queue>
#include <stdexcept>
#include <string>

#include "solve/finish.h"
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

// `items` by size, largest first, ties by lower index (sizes finite and >= 0). Many items in
// increasing order (the scheduler's): a radix sort of the sizes' bit patterns (ordered like the
// values for non-negative doubles; complemented for largest first), stable, so ties keep the
// order of the indices; no comparison to mispredict.
std::vector<int64_t> decreasing(const double* sizes, const std::vector<int64_t>& items) {
  const size_t n = items.size();
  std::vector<int64_t> order(n);
  if (n < 256 || !std::is_sorted(items.begin(), items.end())) {
    // Sorting (key, index) pairs keeps the comparisons in cache.
    std::vector<std::pair<double, int64_t>> keyed(n);
    for (size_t k = 0; k < n; ++k) keyed[k] = {-sizes[items[k]], items[k]};
    std::sort(keyed.begin(), keyed.end());
    for (size_t k = 0; k < n; ++k) order[k] = keyed[k].second;
    return order;
  }
  constexpr int kBits = 11, kDigits = 6;  // 6 digits of 11 bits cover 64
  constexpr uint64_t kMask = (uint64_t{1} << kBits) - 1;
  std::vector<uint64_t> key(n), key2(n);
  std::vector<int64_t> order2(n);
  std::vector<uint32_t> count(kDigits << kBits, 0);
  uint64_t all_and = ~uint64_t{0}, all_or = 0;
  for (size_t k = 0; k < n; ++k) {
    const double v = sizes[items[k]] + 0.0;  // (-0.0 becomes +0.0: equal values, equal patterns)
    uint64_t u;
    std::memcpy(&u, &v, sizeof u);
    key[k] = ~u;
    order[k] = items[k];
    all_and &= key[k];
    all_or |= key[k];
    for (int d = 0; d < kDigits; ++d) ++count[(d << kBits) + ((key[k] >> (kBits * d)) & kMask)];
  }
  for (int d = 0; d < kDigits; ++d) {
    if (!(((all_and ^ all_or) >> (kBits * d)) & kMask)) continue;  // the same digit everywhere
    uint32_t* c = count.data() + (d << kBits);
    uint32_t sum = 0;
    for (uint64_t b = 0; b <= kMask; ++b) {
      const uint32_t t = c[b];
      c[b] = sum;
      sum += t;
    }
    for (size_t k = 0; k < n; ++k) {
      const uint32_t at = c[(key[k] >> (kBits * d)) & kMask]++;
      key2[at] = key[k];
      order2[at] = order[k];
    }
    key.swap(key2);
    order.swap(order2);
  }
  return order;
}

Finish argmin_finish(const double* now, const double* slope, double s, int64_t from, int64_t to) {
  Finish best{INFINITY, INFINITY, to};
  for (int64_t r = from; r < to; ++r) {
    const Finish x{now[r] + slope[r] * s, now[r], r};
    if (x < best) best = x;
  }
  return best;
}

#if defined(__x86_64__) && defined(__GNUC__)
bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2");
  return ok;
}

// The same scan four ranks at a time, chosen at run time on CPUs with AVX2 (the build targets
// baseline x86-64). A separate multiply and add, as in the scalar loop, so the times and the
// choice are bit-identical to it.
__attribute__((target("avx2"))) int64_t argmin_finish_avx2(const double* now, const double* slope,
                                                           double s, int64_t ranks) {
  // Two independent sets of running minima (ranks 8k..8k+3 and 8k+4..8k+7) halve the
  // loop-carried compare-and-blend chain; each lane sees its ranks in increasing order, so a strict
  // (f, c) comparison keeps the lowest rank, and the merge compares (f, c, rank).
  const __m256d vs = _mm256_set1_pd(s);
  __m256d best[2], bestc[2], who[2];
  __m256d idx[2] = {_mm256_setr_pd(0, 1, 2, 3), _mm256_setr_pd(4, 5, 6, 7)};
  for (int k = 0; k < 2; ++k) {
    best[k] = bestc[k] = _mm256_set1_pd(INFINITY);
    who[k] = _mm256_set1_pd(static_cast<double>(ranks));  // rank indices are exact in doubles
  }
  const __m256d eight = _mm256_set1_pd(8);
  int64_t r = 0;
  for (; r + 8 <= ranks; r += 8) {
    for (int k = 0; k < 2; ++k) {
      const __m256d c = _mm256_loadu_pd(now + r + 4 * k);
      const __m256d f = _mm256_add_pd(c, _mm256_mul_pd(_mm256_loadu_pd(slope + r + 4 * k), vs));
      const __m256d lt = _mm256_or_pd(
          _mm256_cmp_pd(f, best[k], _CMP_LT_OQ),
          _mm256_and_pd(_mm256_cmp_pd(f, best[k], _CMP_EQ_OQ), _mm256_cmp_pd(c, bestc[k], _CMP_LT_OQ)));
      best[k] = _mm256_blendv_pd(best[k], f, lt);
      bestc[k] = _mm256_blendv_pd(bestc[k], c, lt);
      who[k] = _mm256_blendv_pd(who[k], idx[k], lt);
      idx[k] = _mm256_add_pd(idx[k], eight);
    }
  }
  Finish pick = argmin_finish(now, slope, s, r, ranks);
  for (int k = 0; k < 2; ++k) {
    double b[4], bc[4], w[4];
    _mm256_storeu_pd(b, best[k]);
    _mm256_storeu_pd(bc, bestc[k]);
    _mm256_storeu_pd(w, who[k]);
    for (int l = 0; l < 4; ++l) {
      const Finish x{b[l], bc[l], static_cast<int64_t>(w[l])};
      if (x.r < ranks && x < pick) pick = x;
    }
  }
  // A lane records a rank only below its start (inf, inf): where the least time and time so far
  // overflowed to inf, the lanes recorded none of the ranks tied there, and the scalar scan's
  // order (the lowest rank) decides.
  const bool overflowed = pick.r >= ranks || (pick.f == INFINITY && pick.c == INFINITY);
  return overflowed ? argmin_finish(now, slope, s, 0, ranks).r : pick.r;
}
#else
bool cpu_has_avx2() { return false; }
int64_t argmin_finish_avx2(const double*, const double*, double, int64_t) { return 0; }
#endif

// With per-rank caps on the summed size: the earliest finish among the ranks the sample still
// fits in (a plain scan; the caps make the heap and vector paths inapplicable).
void place_capped(const double* sizes, const std::vector<int64_t>& order, const double* slope,
                  const double* intercept, int64_t ranks, const double* cap,
                  std::vector<double>& load, std::vector<int64_t>& dest) {
  std::vector<double> now(ranks);
  for (int64_t r = 0; r < ranks; ++r) now[r] = intercept[r] + slope[r] * load[r];
  for (int64_t i : order) {
    const double s = sizes[i];
    Finish best{INFINITY, INFINITY, -1};
    for (int64_t r = 0; r < ranks; ++r) {
      if (load[r] + s > cap[r]) continue;
      const Finish x{now[r] + slope[r] * s, now[r], r};
      if (best.r < 0 || x < best) best = x;
    }
    if (best.r < 0)
      throw std::invalid_argument("schedule: sample " + std::to_string(i) + " (size " +
                                  std::to_string(s) + ") fits in no rank's cap; raise the caps or "
                                  "lower the global batch");
    dest[i] = best.r;
    load[best.r] += s;
    now[best.r] = intercept[best.r] + slope[best.r] * load[best.r];
  }
}

// Places `order` (already largest first) on ranks with current loads `load`, each sample on the
// rank with the earliest finish after taking it.
void place_eft(const double* sizes, const std::vector<int64_t>& order, const double* slope,
               const double* intercept, int64_t ranks, std::vector<double>& load,
               std::vector<int64_t>& dest, bool simd, bool grouped) {
  // now[r] = c, the rank's time before the next sample; only the chosen rank's changes.
  std::vector<double> now(ranks);
  auto take = [&](int64_t i, int64_t r) {
    if (r < 0 || r >= ranks)  // (every time NaN: loads overflowed on ranks of slope 0)
      throw std::invalid_argument("schedule: the ranks' predicted times overflow; the sizes, "
                                  "slopes and intercepts are too large to add up");
    dest[i] = r;
    load[r] += sizes[i];
    now[r] = intercept[r] + slope[r] * load[r];
  };
  for (int64_t r = 0; r < ranks; ++r) now[r] = intercept[r] + slope[r] * load[r];
  if (std::all_of(slope, slope + ranks, [&](double a) { return a == slope[0]; })) {
    // Equal slopes: the least (f, c, rank) is the least (c, rank), a heap's top (LPT).
    using Entry = std::pair<double, int64_t>;
    std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
    for (int64_t r = 0; r < ranks; ++r) heap.push({now[r], r});
    for (int64_t i : order) {
      const int64_t r = heap.top().second;
      heap.pop();
      take(i, r);
      heap.push({now[r], r});
    }
    return;
  }
  // Related ranks: the best rank depends on the sample's size. Many ranks: by groups; few: scan
  // them all.
  if (grouped && ranks >= kGroupedRanks) {
    place_eft_grouped(sizes, order, slope, intercept, now.data(), ranks, load, dest, simd);
    return;
  }
  const bool avx2 = simd && cpu_has_avx2();
  for (int64_t i : order) {
    const double s = sizes[i];
    take(i, avx2 ? argmin_finish_avx2(now.data(), slope, s, ranks)
                 : argmin_finish(now.data(), slope, s, 0, ranks).r);
  }
}

}  // namespace

bool schedule_simd_available() { return cpu_has_avx2(); }

std::vector<int64_t> schedule(const double* sizes, int64_t n, const double* slope,
                              const double* intercept, int64_t ranks, bool simd, int64_t first,
                              const double* cap, bool grouped) {
  check_rates(slope, intercept, ranks, false, "schedule");
  check_sizes(sizes, n, "schedule");
  if (first >= n || first < -1)
    throw std::invalid_argument("schedule: first sample " + std::to_string(first) +
                                " outside [0, " + std::to_string(n) + ")");
  if (cap != nullptr)
    for (int64_t r = 0; r < ranks; ++r)
      if (!(cap[r] >= 0))
        throw std::invalid_argument("schedule: cap of rank " + std::to_string(r) +
                                    " must be >= 0, got " + std::to_string(cap[r]));
  std::vector<int64_t> items(n);
  std::iota(items.begin(), items.end(), 0);
  std::vector<double> load(ranks, 0.0);
  std::vector<int64_t> dest(n, -1);
  std::vector<int64_t> order = decreasing(sizes, items);
  if (first >= 0) {  // CHRONICA's random first pivot: placed before the decreasing order
    order.erase(std::find(order.begin(), order.end(), first));
    order.insert(order.begin(), first);
  }
  if (cap != nullptr)
    place_capped(sizes, order, slope, intercept, ranks, cap, load, dest);
  else
    place_eft(sizes, order, slope, intercept, ranks, load, dest, simd, grouped);
  return dest;
}

std::vector<int64_t> rebalance(const int64_t* owner, const double* sizes, int64_t n,
                               const double* slope, const double* intercept, int64_t ranks,
                               double tolerance) {
  check_rates(slope, intercept, ranks, true, "rebalance");
  check_sizes(sizes, n, "rebalance");
  if (std::isnan(tolerance))
    throw std::invalid_argument("rebalance: tolerance must be a number of seconds >= 0 (or < 0 for "
                                "the default), got nan");
  std::vector<std::vector<int64_t>> held(ranks);
  std::vector<int64_t> storage;  // samples to place: unowned ones, then those given up
  std::vector<double> load(ranks, 0.0);
  double total = 0.0, largest = 0.0, slowest = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    if (owner[i] < -1 || owner[i] >= ranks)
      throw std::invalid_argument("rebalance: owner of sample " + std::to_string(i) + " is " +
                                  std::to_string(owner[i]) + ", outside [0, " + std::to_string(ranks) +
                                  ") (or -1 for a sample no rank holds)");
    if (owner[i] < 0) {
      storage.push_back(i);
    } else {
      held[owner[i]].push_back(i);
      load[owner[i]] += sizes[i];
    }
    total += sizes[i];
    largest = std::max(largest, sizes[i]);
  }
  for (int64_t r = 0; r < ranks; ++r) slowest = std::max(slowest, slope[r]);
  const double tol = tolerance < 0 ? slowest * largest : tolerance;
  const double eps = 1e-12 * total;
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
  // A rank above level + tol must give up samples; the fewest that bring it under are its largest.
  // Every rank must give up at least that many in any assignment within level + tol, so this count
  // is the least possible.
  for (int64_t r = 0; r < ranks; ++r) {
    const double bound = std::max(0.0, (level - intercept[r]) / slope[r]) + tol / slope[r] + eps;
    if (!(load[r] > bound)) continue;
    for (int64_t i : decreasing(sizes, held[r])) {
      if (!(load[r] > bound)) break;
      storage.push_back(i);
      load[r] -= sizes[i];
    }
  }
  // Largest first, each to the rank predicted to finish first now (ties: lower rank). That rank is
  // below the level while samples remain, so it ends within one sample of it: within tol when tol
  // covers the largest sample on the slowest rank (the default).
  using Slot = std::pair<double, int64_t>;
  std::priority_queue<Slot, std::vector<Slot>, std::greater<Slot>> heap;
  for (int64_t r = 0; r < ranks; ++r) heap.push({intercept[r] + slope[r] * load[r], r});
  std::vector<int64_t> dest(owner, owner + n);
  for (int64_t i : decreasing(sizes, storage)) {
    const int64_t r = heap.top().second;
    heap.pop();
    dest[i] = r;
    load[r] += sizes[i];
    heap.push({intercept[r] + slope[r] * load[r], r});
  }
  return dest;
}

}  // namespace hetlb
