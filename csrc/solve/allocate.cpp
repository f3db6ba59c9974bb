// Exact integer min-max batch allocation (LBB Eq. 3, LB-BSP problem (3)).
//
// Each worker i has an effective time tau_i(b): 0 at b = 0 (a worker given nothing does not take
// part), otherwise the running maximum of its model over 1..b, clamped at 0. tau_i is
// non-decreasing, so "largest b with tau_i(b) <= X" is a monotone per-worker inverse and the
// problem becomes a parametric search over the makespan X. The optimum is always one of the values
// tau_i(b); a binary search over the bit patterns of non-negative doubles (ordered like the values)
// finds it exactly in at most 64 rounds, each costing O(n log B).
//
// Three searches, each over the same inverse:
//   1. M* = least makespan: least X with sum_i clip(cap_i(X), lo_i, hi_i) >= total.
//   2. L* = largest floor: largest L such that every worker that can take part (cap_i(M*) >= 1)
//      can reach tau >= L within its cap and the least such sizes still fit in `total`.
//      Together, M* - L* is the smallest spread among the min-makespan allocations.
//   3. Water-fill between those per-worker limits so the result is balanced and deterministic;
//      the last samples at the final level go to the lowest-indexed workers.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>
#include <stdexcept>

#include "solve/solve.h"

namespace hetlb {
namespace {

uint64_t bits_of(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}

double from_bits(uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// Raw model value at integer b >= 1; the same arithmetic as hetlb.reference.raw_time.
double raw_time(const ModelSpec& m, int64_t b) {
  const double x = static_cast<double>(b);
  switch (m.kind) {
    case 0:
      return m.params[0] + m.params[1] * x;
    case 1: {
      double y = 0.0;
      for (int64_t k = 0; k < m.nparams; ++k) y = y * x + m.params[k];
      return y;
    }
    default: {
      const int64_t k = m.nparams / 2;
      const double* xs = m.params;
      const double* ts = m.params + k;
      if (k == 1) return ts[0] * (x / xs[0]);
      // Segment j covers [xs[j], xs[j+1]]; beyond the ends the first/last segment extends.
      int64_t j = std::upper_bound(xs, xs + k, x) - xs - 1;
      j = std::min<int64_t>(std::max<int64_t>(j, 0), k - 2);
      return ts[j] + (ts[j + 1] - ts[j]) * ((x - xs[j]) / (xs[j + 1] - xs[j]));
    }
  }
}

// A model prepared for repeated evaluation: prefix maxima of the raw values at the candidates.
struct Worker {
  ModelSpec m;
  std::vector<int64_t> cand;    // candidate points in [1, hi], ascending
  std::vector<double> prefmax;  // max(0, raw(1), raw(cand[0..j]))
  double base;                  // max(0, raw(1))
  int64_t lo, hi;

  void prepare() {
    base = std::max(0.0, raw_time(m, 1));
    double run = base;
    for (int64_t j = 0; j < m.ncands; ++j) {
      const int64_t c = m.cands[j];
      if (c < 1 || c > hi) continue;
      run = std::max(run, raw_time(m, c));
      cand.push_back(c);
      prefmax.push_back(run);
    }
  }

  double tau(int64_t b) const {
    if (b <= 0) return 0.0;
    double t = std::max(base, raw_time(m, b));
    if (m.kind == 0) return t;  // validated a0, a1 >= 0: already non-decreasing
    const auto it = std::upper_bound(cand.begin(), cand.end(), b);
    if (it != cand.begin()) t = std::max(t, prefmax[it - cand.begin() - 1]);
    return t;
  }

  // Largest b in [0, hi] with tau(b) <= x (strict: < x).
  int64_t cap(double x, bool strict) const {
    auto ok = [&](int64_t b) { return strict ? tau(b) < x : tau(b) <= x; };
    if (hi == 0 || !ok(1)) return 0;
    int64_t a = 1, z = hi;  // ok(a) holds
    if (m.kind == 0 && m.params[1] > 0) {
      // Closed form guess, then exact correction on the same arithmetic as tau.
      const double g = std::floor((x - m.params[0]) / m.params[1]);
      const int64_t b0 = g >= static_cast<double>(hi) ? hi : g < 1.0 ? 1 : static_cast<int64_t>(g);
      int64_t b = b0;
      while (b < hi && ok(b + 1)) ++b;
      while (b > 1 && !ok(b)) --b;
      return b;
    }
    if (ok(z)) return z;
    while (z - a > 1) {  // ok(a), !ok(z)
      const int64_t mid = a + (z - a) / 2;
      if (ok(mid)) a = mid; else z = mid;
    }
    return a;
  }
};

void validate(const ModelSpec& m, int64_t i) {
  auto bad = [&](const std::string& why) {
    throw std::invalid_argument("allocate: worker " + std::to_string(i) + ": " + why);
  };
  for (int64_t k = 0; k < m.nparams; ++k)
    if (!std::isfinite(m.params[k])) bad("model has a non-finite (NaN or infinite) coefficient");
  if (m.kind == 0) {
    if (m.nparams != 2) bad("linear model needs 2 coefficients");
    if (m.params[0] < 0 || m.params[1] < 0) bad("linear model has a negative coefficient");
  } else if (m.kind == 1) {
    if (m.nparams < 1) bad("polynomial model has no coefficients");
  } else if (m.kind == 2) {
    if (m.nparams < 2 || m.nparams % 2) bad("piecewise model needs matching, non-empty points");
    const int64_t k = m.nparams / 2;
    for (int64_t j = 0; j < k; ++j) {
      if (m.params[j] <= 0) bad("piecewise batch sizes must be positive");
      if (j && m.params[j] <= m.params[j - 1]) bad("piecewise batch sizes must increase strictly");
    }
  } else {
    bad("unknown model kind " + std::to_string(m.kind));
  }
}

std::string describe(int64_t i, int64_t lo, int64_t hi) {
  std::ostringstream s;
  s << "worker " << i << ": lower=" << lo << " upper=" << hi;
  return s.str();
}

// Least double x in [bottom, top] with sum_i f(i, x) >= target, where every f(i, .) is a
// non-decreasing integer function and the sum reaches target at top. A search over the bit
// patterns of the bracket in which a worker whose f agrees at both ends is constant inside it and
// drops out, so only the workers near the answer are still evaluated. For the usual models the sum
// is close to linear in x, so probes interpolate the sums at the ends (regula falsi with the
// Illinois rule, which halves the weight of an end kept twice in a row): a few probes shrink the
// bracket to the workers next to the answer. Three probes in a row that do not halve the
// difference of the sums are followed by a bisection of the bit patterns, which bounds the search
// at 4 x 64 probes whatever the models.
template <class F>
double least_reaching(int64_t n, double bottom, double top, int64_t target, F f) {
  std::vector<int64_t> fa(n), fz(n), fm(n), active;
  int64_t fixed = 0, sa = 0, sz = 0;
  for (int64_t i = 0; i < n; ++i) {
    fa[i] = f(i, bottom);
    sa += fa[i];
  }
  if (sa >= target) return bottom;
  for (int64_t i = 0; i < n; ++i) {
    fz[i] = f(i, top);
    sz += fz[i];
    if (fa[i] == fz[i]) fixed += fa[i]; else active.push_back(i);
  }
  uint64_t a = bits_of(bottom), z = bits_of(top);  // sum sa < target at a, sz >= target at z
  // The sums measured from target - 1/2 (never 0, so an end that meets target exactly still
  // moves the probe): ga < 0 < gz.
  const double level = static_cast<double>(target) - 0.5;
  double ga = static_cast<double>(sa) - level, gz = static_cast<double>(sz) - level;
  int kept = 0, slow = 0;  // kept: +1 the upper end moved last, -1 the lower end
  while (z - a > 1) {
    uint64_t mid = a + (z - a) / 2;
    if (slow < 3) {
      const double xa = from_bits(a), xz = from_bits(z);
      const double x = xa + (xz - xa) * (-ga / (gz - ga));
      mid = std::min(std::max(bits_of(std::max(x, xa)), a + 1), z - 1);
    }
    const double x = from_bits(mid);
    int64_t s = fixed;
    for (int64_t i : active) s += (fm[i] = f(i, x));
    const bool reached = s >= target;
    const int64_t gap = sz - sa;
    if (reached) {
      z = mid;
      sz = s;
      gz = static_cast<double>(s) - level;
      if (kept > 0) ga *= 0.5;
      kept = 1;
    } else {
      a = mid;
      sa = s;
      ga = static_cast<double>(s) - level;
      if (kept < 0) gz *= 0.5;
      kept = -1;
    }
    slow = 2 * (sz - sa) <= gap ? 0 : slow < 3 ? slow + 1 : 0;
    size_t keep = 0;
    for (int64_t i : active) {
      (reached ? fz[i] : fa[i]) = fm[i];
      if (fa[i] == fz[i]) fixed += fa[i]; else active[keep++] = i;
    }
    active.resize(keep);
  }
  return from_bits(z);
}

}  // namespace

std::vector<double> effective_time(const ModelSpec& m, const std::vector<int64_t>& b) {
  validate(m, 0);
  int64_t top = 1;
  for (int64_t v : b) top = std::max(top, v);
  Worker w{m, {}, {}, 0.0, 0, top};
  w.prepare();
  std::vector<double> out(b.size());
  for (size_t i = 0; i < b.size(); ++i) out[i] = w.tau(b[i]);
  return out;
}

std::vector<int64_t> allocate(const std::vector<ModelSpec>& models, int64_t total,
                              const std::vector<int64_t>& lower, const std::vector<int64_t>& upper) {
  const int64_t n = static_cast<int64_t>(models.size());
  if (n == 0) throw std::invalid_argument("allocate: no workers (empty model list)");
  if (total < 0) throw std::invalid_argument("allocate: total must be >= 0, got " + std::to_string(total));
  if (static_cast<int64_t>(lower.size()) != n || static_cast<int64_t>(upper.size()) != n)
    throw std::invalid_argument("allocate: lower/upper must have one entry per worker (" +
                                std::to_string(n) + "), got " + std::to_string(lower.size()) +
                                " and " + std::to_string(upper.size()));
  check_counts("allocate", n, total, lower);
  std::vector<Worker> w(n);
  int64_t sum_lo = 0, sum_hi = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t lo = lower[i], hi = std::min(upper[i], total);
    if (lower[i] < 0 || lower[i] > upper[i])
      throw std::invalid_argument("allocate: need 0 <= lower <= upper, " + describe(i, lower[i], upper[i]));
    validate(models[i], i);
    w[i] = Worker{models[i], {}, {}, 0.0, lo, std::max(lo, hi)};
    w[i].prepare();
    sum_lo += lo;
    sum_hi += w[i].hi;
  }
  if (sum_lo > total)
    throw std::invalid_argument("allocate: lower bounds sum to " + std::to_string(sum_lo) +
                                " > total " + std::to_string(total));
  if (sum_hi < total)
    throw std::invalid_argument("allocate: upper bounds sum to " + std::to_string(sum_hi) +
                                " < total " + std::to_string(total) + ", cannot place every sample");
  std::vector<int64_t> out(n);
  if (total == 0) return out;

  auto clip = [](int64_t v, int64_t a, int64_t b) { return std::min(std::max(v, a), b); };
  double top = 0.0, floor_t = 0.0;
  for (const auto& x : w) {
    top = std::max(top, x.tau(x.hi));
    floor_t = std::max(floor_t, x.tau(x.lo));
  }
  if (!std::isfinite(top)) throw std::invalid_argument("allocate: a model's time overflows to infinity");

  // 1. least makespan.
  const double xstar = least_reaching(n, 0.0, top, total, [&](int64_t i, double x) {
    return clip(w[i].cap(x, false), w[i].lo, w[i].hi);
  });
  const double mstar = std::max(xstar, floor_t);
  std::vector<int64_t> c(n), l(n);
  for (int64_t i = 0; i < n; ++i) c[i] = clip(w[i].cap(mstar, false), w[i].lo, w[i].hi);

  // 2. largest floor over the workers that can take part. l_i(L) = least b in [lo, c] with
  // tau >= L; a worker that cannot reach L counts total + 1, so "the floors do not fit in total"
  // is one monotone sum and the least L where it happens is one search away.
  auto floor_of = [&](int64_t i, double L) -> int64_t {
    if (c[i] == 0) return 0;
    const int64_t b = std::max(w[i].lo, w[i].cap(L, true) + 1);
    return b > c[i] ? total + 1 : b;
  };
  const double tiny = from_bits(1);
  int64_t at_tiny = 0;
  for (int64_t i = 0; i < n; ++i) at_tiny += floor_of(i, tiny);
  if (at_tiny <= total) {
    // Above the least of the limits tau_i(c_i) some worker that takes part cannot reach L, so the
    // sum exceeds total there; up to it every worker can, and the sum is that of the least sizes
    // (close to linear in L for the usual models, which the search's interpolation needs).
    double reach = std::numeric_limits<double>::infinity();
    int64_t at_reach = 0;
    for (int64_t i = 0; i < n; ++i)
      if (c[i] > 0) reach = std::min(reach, w[i].tau(c[i]));
    for (int64_t i = 0; i < n; ++i) at_reach += floor_of(i, reach);
    const double bad = at_reach <= total ? std::nextafter(reach, std::numeric_limits<double>::infinity())
                                         : least_reaching(n, tiny, reach, total + 1, floor_of);
    const double lstar = from_bits(bits_of(bad) - 1);
    for (int64_t i = 0; i < n; ++i) l[i] = floor_of(i, lstar);
  } else {
    for (int64_t i = 0; i < n; ++i) l[i] = c[i] == 0 ? 0 : w[i].lo;
  }

  // 3. water-fill inside [l_i, c_i].
  const double xw = least_reaching(n, 0.0, mstar, total, [&](int64_t i, double x) {
    return clip(w[i].cap(x, false), l[i], c[i]);
  });
  int64_t placed = 0;
  for (int64_t i = 0; i < n; ++i) {
    out[i] = clip(w[i].cap(xw, true), l[i], c[i]);
    placed += out[i];
  }
  for (int64_t i = 0; i < n && placed < total; ++i) {
    const int64_t room = clip(w[i].cap(xw, false), l[i], c[i]) - out[i];
    const int64_t add = std::min(room, total - placed);
    out[i] += add;
    placed += add;
  }
  if (placed != total) throw std::logic_error("allocate: internal error, allocation does not sum to total");
  return out;
}

}  // namespace hetlb
