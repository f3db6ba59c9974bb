// The order in which hetlb.schedule's earliest-finish placement picks a rank, shared by the plain
// scan (schedule.cpp) and the grouped one (eft_groups.cpp), whose picks must be the same.
#pragma once

#include <cstdint>

namespace hetlb {

// A rank's time now is c = intercept + slope * load, and with the sample f = c + slope * s. The
// earliest finish is the least (f, c, rank): f first, then c, then rank. Written this way f is
// monotone in c for equal slopes, so with uniform slopes the least (c, rank) is the answer and a
// heap finds it; every path computes c and f with exactly these operations, so all agree bit for
// bit with hetlb.reference.schedule.
struct Finish {
  double f, c;
  int64_t r;
  bool operator<(const Finish& o) const {
    return f < o.f || (f == o.f && (c < o.c || (c == o.c && r < o.r)));
  }
};

}  // namespace hetlb
