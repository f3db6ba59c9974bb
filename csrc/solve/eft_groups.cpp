// The earliest-finish choice of CHRONICA's scheduler over related ranks, without scanning every
// rank for every sample.
//
// Rank r finishes a sample of size s at f_r(s) = c_r + a_r * s (c_r its time so far, a_r its
// slope); the scheduler takes the least (f, c, rank). Samples come largest first, so s only falls.
// The ranks, ordered by slope, are cut into groups of about sqrt(ranks). Each group keeps the
// member that wins it, with the least s down to which that member is certain to stay the winner
// (its expiry): for a member of larger slope the s where its line comes within a margin of the
// winner's, for one of equal slope never (same product, so the order of c decides), for one of
// smaller slope never once it is a margin behind. The margin (1e-12 of the magnitudes, against
// float errors of 4e-16) makes "certain" hold for the rounded values the plain scan compares.
// A sample then costs a look at every group's expiry, a rescan of the groups that expired and of
// the group whose rank took the previous sample (on the benchmark's clusters about one group a
// sample in all), and a pick among the groups' winners: about 3 sqrt(ranks) values instead of
// ranks. The picks are those of the plain scan, bit for bit (tests/test_schedule.py compares
// them), with or without the AVX2 variants below.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "solve/finish.h"
#include "solve/solve.h"

namespace hetlb {
namespace {

// Float errors of c + a * s are below 2 ulp of the magnitudes; the margin is far above them.
constexpr double kMargin = 1e-12;

// Of the entries whose time f[k] equals low, the least (f, c, rank) as its index (0 if none: all
// times NaN, which the plain scan never picks either).
int64_t resolve(const double* f, const double* c, const int64_t* rank, int64_t from, int64_t n,
                double low, Finish& best, int64_t at) {
  for (int64_t k = from; k < n; ++k) {
    if (f[k] != low) continue;
    const Finish x{f[k], c[k], rank[k]};
    if (x < best) {
      best = x;
      at = k;
    }
  }
  return at;
}

// The least (c + a * s, c, rank[k]) over k < n, as its index: the least time first (running
// minima, no branch), then the few entries that reach it compared in full. f: scratch of n.
int64_t least(const double* c, const double* a, const int64_t* rank, int64_t n, double s, double* f) {
  double m[4] = {INFINITY, INFINITY, INFINITY, INFINITY};
  for (int64_t k = 0; k < n; ++k) f[k] = c[k] + a[k] * s;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4)
    for (int j = 0; j < 4; ++j) m[j] = f[k + j] < m[j] ? f[k + j] : m[j];
  for (; k < n; ++k) m[0] = f[k] < m[0] ? f[k] : m[0];
  Finish best{INFINITY, INFINITY, INT64_MAX};
  return resolve(f, c, rank, 0, n, std::min(std::min(m[0], m[1]), std::min(m[2], m[3])), best, 0);
}

// The expiry of a group whose winner has time so far cw and slope aw, scanned at s: the largest
// s below which some member could catch it (-inf: none can; NaN from overflowed times: +inf).
double one_expiry(double c, double a, double cw, double aw, double s) {
  const double da = a - aw, dc = c - cw;
  const double margin = kMargin * (c + cw + (a + aw) * s);
  // Larger slope: down to t it stays a margin behind. Smaller: its lead only grows as s falls,
  // certain once a margin behind. Equal (the winner too): the order of c, then of rank, decides
  // for good.
  const double t = da > 0.0 ? (margin - dc) / da : da < 0.0 ? (dc + da * s >= margin ? -INFINITY : s)
                                                            : -INFINITY;
  return std::isnan(t) ? INFINITY : t;
}

double expiry(const double* c, const double* a, int64_t n, double cw, double aw, double s) {
  double e = -INFINITY;
  for (int64_t k = 0; k < n; ++k) e = std::max(e, one_expiry(c[k], a[k], cw, aw, s));
  return e;
}

#if defined(__x86_64__) && defined(__GNUC__)
// The same, four values at a time: the same operations on each value, so the same results.
__attribute__((target("avx2"))) double hmin(__m256d v) {
  const __m128d h = _mm_min_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
  return std::min(_mm_cvtsd_f64(h), _mm_cvtsd_f64(_mm_unpackhi_pd(h, h)));
}

__attribute__((target("avx2"))) int64_t least_avx2(const double* c, const double* a, const int64_t* rank,
                                                   int64_t n, double s, double* f) {
  const __m256d vs = _mm256_set1_pd(s);
  __m256d m = _mm256_set1_pd(INFINITY);
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256d x = _mm256_add_pd(_mm256_loadu_pd(c + k), _mm256_mul_pd(_mm256_loadu_pd(a + k), vs));
    _mm256_storeu_pd(f + k, x);
    m = _mm256_min_pd(x, m);  // (a NaN x keeps m, as the scalar minimum does)
  }
  double low = hmin(m);
  const int64_t tail = k;
  for (; k < n; ++k) {
    f[k] = c[k] + a[k] * s;
    low = f[k] < low ? f[k] : low;
  }
  // Which entries reach the least time, as bits (groups have at most 64 entries a word); one
  // entry, the common case, is the answer without comparing c and rank.
  const __m256d vl = _mm256_set1_pd(low);
  uint64_t hits = 0;
  for (k = 0; k < tail; k += 4)
    hits |= static_cast<uint64_t>(_mm256_movemask_pd(_mm256_cmp_pd(_mm256_loadu_pd(f + k), vl, _CMP_EQ_OQ))) << (k & 63);
  for (k = tail; k < n; ++k) hits |= static_cast<uint64_t>(f[k] == low) << (k & 63);
  if (n <= 64 && __builtin_popcountll(hits) == 1) return __builtin_ctzll(hits);
  Finish best{INFINITY, INFINITY, INT64_MAX};
  return resolve(f, c, rank, 0, n, low, best, 0);
}

// Bits of the entries of e[0..n) above s (n <= 64).
__attribute__((target("avx2"))) uint64_t above_avx2(const double* e, int64_t n, double s) {
  const __m256d vs = _mm256_set1_pd(s);
  uint64_t bits = 0;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4)
    bits |= static_cast<uint64_t>(_mm256_movemask_pd(_mm256_cmp_pd(vs, _mm256_loadu_pd(e + k), _CMP_LT_OQ))) << k;
  for (; k < n; ++k) bits |= static_cast<uint64_t>(s < e[k]) << k;
  return bits;
}

__attribute__((target("avx2"))) double expiry_avx2(const double* c, const double* a, int64_t n,
                                                   double cw, double aw, double s) {
  const __m256d vcw = _mm256_set1_pd(cw), vaw = _mm256_set1_pd(aw), vs = _mm256_set1_pd(s);
  const __m256d vm = _mm256_set1_pd(kMargin), zero = _mm256_setzero_pd();
  const __m256d ninf = _mm256_set1_pd(-INFINITY), pinf = _mm256_set1_pd(INFINITY);
  __m256d e = ninf;
  int64_t k = 0;
  for (; k + 4 <= n; k += 4) {
    const __m256d vc = _mm256_loadu_pd(c + k), va = _mm256_loadu_pd(a + k);
    const __m256d da = _mm256_sub_pd(va, vaw), dc = _mm256_sub_pd(vc, vcw);
    const __m256d margin = _mm256_mul_pd(vm, _mm256_add_pd(_mm256_add_pd(vc, vcw),
                                                           _mm256_mul_pd(_mm256_add_pd(va, vaw), vs)));
    const __m256d up = _mm256_div_pd(_mm256_sub_pd(margin, dc), da);
    const __m256d ahead = _mm256_cmp_pd(_mm256_add_pd(dc, _mm256_mul_pd(da, vs)), margin, _CMP_GE_OQ);
    const __m256d down = _mm256_blendv_pd(vs, ninf, ahead);
    __m256d t = _mm256_blendv_pd(ninf, down, _mm256_cmp_pd(da, zero, _CMP_LT_OQ));
    t = _mm256_blendv_pd(t, up, _mm256_cmp_pd(da, zero, _CMP_GT_OQ));
    t = _mm256_blendv_pd(t, pinf, _mm256_cmp_pd(t, t, _CMP_UNORD_Q));
    e = _mm256_max_pd(e, t);
  }
  const __m128d h = _mm_max_pd(_mm256_castpd256_pd128(e), _mm256_extractf128_pd(e, 1));
  double out = std::max(_mm_cvtsd_f64(h), _mm_cvtsd_f64(_mm_unpackhi_pd(h, h)));
  return std::max(out, expiry(c + k, a + k, n - k, cw, aw, s));
}
#else
uint64_t above_avx2(const double* e, int64_t n, double s) {
  uint64_t bits = 0;
  for (int64_t k = 0; k < n; ++k) bits |= static_cast<uint64_t>(s < e[k]) << k;
  return bits;
}
int64_t least_avx2(const double* c, const double* a, const int64_t* rank, int64_t n, double s, double* f) {
  return least(c, a, rank, n, s, f);
}
double expiry_avx2(const double* c, const double* a, int64_t n, double cw, double aw, double s) {
  return expiry(c, a, n, cw, aw, s);
}
#endif

class Groups {
 public:
  Groups(const double* slope, const double* now, int64_t ranks, bool simd)
      : ranks_(ranks), simd_(simd && schedule_simd_available()) {
    size_ = std::max<int64_t>(8, static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(ranks)))));
    count_ = (ranks + size_ - 1) / size_;
    order_.resize(ranks);
    std::iota(order_.begin(), order_.end(), 0);
    std::stable_sort(order_.begin(), order_.end(), [&](int64_t p, int64_t q) { return slope[p] < slope[q]; });
    pos_.resize(ranks);
    c_.resize(ranks);
    a_.resize(ranks);
    for (int64_t p = 0; p < ranks; ++p) {
      pos_[order_[p]] = p;
      c_[p] = now[order_[p]];
      a_[p] = slope[order_[p]];
    }
    wc_.assign(count_, INFINITY);
    wa_.assign(count_, 0.0);
    wr_.assign(count_, ranks);
    expiry_.assign(count_, INFINITY);  // no winner yet: every group is scanned first
    f_.resize(std::max(size_, count_));
  }

  // The rank that finishes a sample of size s first. The expiries hold for falling s; a size above
  // the previous one (the scheduler's first pivot) has every group scanned again.
  int64_t choose(double s) {
    if (s > last_) std::fill(expiry_.begin(), expiry_.end(), INFINITY);
    last_ = s;
    if (dirty_ >= 0) scan(dirty_, s);
    dirty_ = -1;
    if (simd_ && count_ <= 64) {
      for (uint64_t due = above_avx2(expiry_.data(), count_, s); due; due &= due - 1)
        scan(__builtin_ctzll(due), s);
    } else {
      for (int64_t g = 0; g < count_; ++g)
        if (s < expiry_[g]) scan(g, s);
    }
    const int64_t w = simd_ ? least_avx2(wc_.data(), wa_.data(), wr_.data(), count_, s, f_.data())
                            : least(wc_.data(), wa_.data(), wr_.data(), count_, s, f_.data());
    return wr_[w];
  }

  // Rank r's time so far is now c; its group is scanned again at the next sample (kept apart from
  // the expiries, which are read four at a time: a load of a value just stored would wait).
  void set(int64_t r, double c) {
    const int64_t p = pos_[r];
    c_[p] = c;
    dirty_ = p / size_;
  }

 private:
  void scan(int64_t g, double s) {
    const int64_t from = g * size_, n = std::min(ranks_, from + size_) - from;
    const double* c = c_.data() + from;
    const double* a = a_.data() + from;
    const int64_t w = simd_ ? least_avx2(c, a, order_.data() + from, n, s, f_.data())
                            : least(c, a, order_.data() + from, n, s, f_.data());
    wc_[g] = c[w];
    wa_[g] = a[w];
    wr_[g] = order_[from + w];
    expiry_[g] = simd_ ? expiry_avx2(c, a, n, c[w], a[w], s) : expiry(c, a, n, c[w], a[w], s);
  }

  int64_t ranks_;
  bool simd_;
  int64_t size_ = 0, count_ = 0;
  std::vector<int64_t> order_, pos_;  // slope order: position -> rank, rank -> position
  std::vector<double> c_, a_;         // by position
  std::vector<double> wc_, wa_;       // each group's winner: its c and slope, and its rank
  std::vector<int64_t> wr_;
  std::vector<double> expiry_, f_;    // f_: scratch
  double last_ = INFINITY;
  int64_t dirty_ = -1;  // the group of the rank that took the previous sample
};

}  // namespace

void place_eft_grouped(const double* sizes, const std::vector<int64_t>& order, const double* slope,
                       const double* intercept, const double* now, int64_t ranks,
                       std::vector<double>& load, std::vector<int64_t>& dest, bool simd) {
  Groups groups(slope, now, ranks, simd);
  for (int64_t i : order) {
    const double s = sizes[i];
    const int64_t r = groups.choose(s);
    dest[i] = r;
    load[r] += s;
    groups.set(r, intercept[r] + slope[r] * load[r]);
  }
}

}  // namespace hetlb
