// Runs the CUDA kernels' index arithmetic (csrc/ops/cuda/tiles.cuh) on the host: every launch of a
// random list of items is executed block by block and thread by thread, as the kernel's grid would,
// and each output is compared bit for bit with the op applied element by element; the elements
// around every array must stay untouched. Pointers are offset from 16-byte alignment one at a time
// (the scalar path), items sized around the vector width and the tile, lists longer than a launch
// of either batch size (512 items, and the small batches of 48 and 36).
// Prints "ok <cases>" and exits 0, or the first failures and exits 1. Built and run by
// tests/test_cuda_tiles.py.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ops/cuda/tiles.cuh"

using namespace hetlb::kernels;

namespace {

constexpr int kGuard = 24;  // elements of canary before and after every array
int failures = 0;

template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

// An array of n elements at `offset` elements past a 64-byte boundary, with canaries around it.
template <typename T>
struct Array {
  std::vector<unsigned char> bytes;
  T* data;
  int64_t n;
  Array(int64_t n_, int offset, std::mt19937_64& rng) : n(n_) {
    bytes.assign((n + 2 * kGuard + offset) * sizeof(T) + 128, 0xA5);
    auto base = reinterpret_cast<uintptr_t>(bytes.data());
    base = (base + 63) / 64 * 64;
    data = reinterpret_cast<T*>(base) + kGuard + offset;
    std::normal_distribution<double> normal;
    for (int64_t i = 0; i < n; ++i) data[i] = static_cast<T>(normal(rng));
  }
  bool guards_intact() const {
    const auto* lo = reinterpret_cast<const unsigned char*>(data - kGuard);
    const auto* hi = reinterpret_cast<const unsigned char*>(data + n);
    for (size_t b = 0; b < kGuard * sizeof(T); ++b)
      if (lo[b] != 0xA5 || hi[b] != 0xA5) return false;
    return true;
  }
};

// Every launch of for_each_batch, run as a grid of `blocks` blocks of `lanes` threads; each block's
// threads run its tile one after another (they touch disjoint elements), in the order given.
template <typename Batch, typename Item, typename Pointers, typename Op>
int emulate(const std::vector<Item>& items, Pointers pointers, const Op& op, int blocks, int lanes,
            bool reverse) {
  int launches = 0;
  for_each_batch<Batch>(items, pointers, [&](const Batch& batch) {
    ++launches;
    const int64_t ntiles = batch.tile_start[batch.count];
    for (int b = 0; b < blocks; ++b)
      for (int64_t tile = b; tile < ntiles; tile += blocks)
        for (int l = 0; l < lanes; ++l) run_tile(batch, op, tile, reverse ? lanes - 1 - l : l, lanes);
  });
  return launches;
}

struct Seg {
  void* dst;
  const void* src;
  int64_t numel;
};
struct Tri {
  void* g;
  const void* p;
  const void* q;
  int64_t numel;
};

int64_t draw_size(std::mt19937_64& rng, int V) {
  const int64_t picks[] = {0, 1, 2, V - 1, V, V + 1, 3 * V + 2, kThreads * V * kUnroll - 1,
                           kThreads * V * kUnroll + 3, kTile - 1, kTile, kTile + 1,
                           2 * kTile + V + 1, 3 * kTile - 5};
  std::uniform_int_distribution<int> any(0, 19);
  const int i = any(rng);
  if (i < 14) return picks[i] < 0 ? 0 : picks[i];
  return std::uniform_int_distribution<int64_t>(0, 3 * kTile)(rng);
}

const char* name_of(float) { return "float32"; }
const char* name_of(double) { return "float64"; }
const char* name_of(c10::Half) { return "float16"; }
const char* name_of(c10::BFloat16) { return "bfloat16"; }

// scale: out of place (flatten_scaled) or in place (scale_), offsets per pointer.
template <typename T, typename Batch>
void scale_case(std::mt19937_64& rng, int items, bool in_place, int misalign, int blocks, int lanes,
                bool reverse, int& cases) {
  constexpr int V = kVectorBytes / sizeof(T);
  std::vector<Array<T>> dst, src;
  std::vector<Seg> segs;
  dst.reserve(items);
  src.reserve(items);
  std::uniform_int_distribution<int> off(0, V - 1), coin(0, 3);
  for (int i = 0; i < items; ++i) {
    const int64_t n = draw_size(rng, V);
    const bool skew = misalign > 0 && coin(rng) == 0;
    src.emplace_back(n, skew ? off(rng) : 0, rng);
    dst.emplace_back(n, skew && !in_place ? off(rng) : 0, rng);
  }
  const ScaleOp<T> op{static_cast<at::opmath_type<T>>(0.37)};
  std::vector<std::vector<T>> want(items);
  for (int i = 0; i < items; ++i) {
    Array<T>& out = in_place ? src[i] : dst[i];
    for (int64_t e = 0; e < src[i].n; ++e) want[i].push_back(op(&src[i].data[e]));
    segs.push_back({out.data, src[i].data, src[i].n});
  }
  emulate<Batch>(segs, [](const Seg& s) { return std::array<const void*, 2>{s.dst, s.src}; },
                        op, blocks, lanes, reverse);
  for (int i = 0; i < items; ++i) {
    const Array<T>& out = in_place ? src[i] : dst[i];
    bool ok = out.guards_intact() && src[i].guards_intact();
    int64_t bad = -1;
    for (int64_t e = 0; e < out.n && ok; ++e)
      if (!same_bits(out.data[e], want[i][e])) ok = false, bad = e;
    if (!ok && failures++ < 10)
      std::printf("scale %s item %d of %d (n=%lld, in_place=%d, blocks=%d, lanes=%d): %s%lld\n",
                  name_of(T{}), i, items, static_cast<long long>(out.n), in_place, blocks, lanes,
                  bad < 0 ? "canary overwritten " : "wrong element ", static_cast<long long>(bad));
  }
  ++cases;
}

// delay compensation: grad updated in place from (grad, param, prev).
template <typename T, typename Batch>
void triple_case(std::mt19937_64& rng, int items, int misalign, int blocks, int lanes, bool reverse,
                 int& cases) {
  constexpr int V = kVectorBytes / sizeof(T);
  std::vector<Array<T>> g, p, q;
  std::vector<Tri> tris;
  g.reserve(items);
  p.reserve(items);
  q.reserve(items);
  std::uniform_int_distribution<int> off(0, V - 1), which(0, 5);
  for (int i = 0; i < items; ++i) {
    const int64_t n = draw_size(rng, V);
    const int skew = misalign > 0 ? which(rng) : 5;  // 0..2: that pointer off alignment
    g.emplace_back(n, skew == 0 ? off(rng) : 0, rng);
    p.emplace_back(n, skew == 1 ? off(rng) : 0, rng);
    q.emplace_back(n, skew == 2 ? off(rng) : 0, rng);
  }
  const DelayCompensateOp<T> op{static_cast<at::opmath_type<T>>(0.5)};
  std::vector<std::vector<T>> want(items);
  for (int i = 0; i < items; ++i) {
    for (int64_t e = 0; e < g[i].n; ++e) {
      const T x[3] = {g[i].data[e], p[i].data[e], q[i].data[e]};
      want[i].push_back(op(x));
    }
    tris.push_back({g[i].data, p[i].data, q[i].data, g[i].n});
  }
  emulate<Batch>(tris, [](const Tri& t) { return std::array<const void*, 3>{t.g, t.p, t.q}; },
                       op, blocks, lanes, reverse);
  for (int i = 0; i < items; ++i) {
    bool ok = g[i].guards_intact() && p[i].guards_intact() && q[i].guards_intact();
    int64_t bad = -1;
    for (int64_t e = 0; e < g[i].n && ok; ++e)
      if (!same_bits(g[i].data[e], want[i][e])) ok = false, bad = e;
    if (!ok && failures++ < 10)
      std::printf("delay_compensate %s item %d of %d (n=%lld, blocks=%d, lanes=%d): %s%lld\n",
                  name_of(T{}), i, items, static_cast<long long>(g[i].n), blocks, lanes,
                  bad < 0 ? "canary overwritten " : "wrong element ", static_cast<long long>(bad));
  }
  ++cases;
}

template <typename T>
void dtype_cases(std::mt19937_64& rng, int rounds, int& cases) {
  const int shapes[][2] = {{256, 7}, {256, 1}, {32, 3}, {256, 1000}};  // (lanes, blocks)
  for (int r = 0; r < rounds; ++r) {
    const auto& s = shapes[r % 4];
    // 100 items: longer than a small launch; 530: longer than a large one.
    const int items = r == 9 ? 530 : r % 5 == 4 ? 100 : 1 + static_cast<int>(rng() % 12);
    if (items == 530 || (items != 100 && r % 2 == 0)) {
      scale_case<T, SegmentBatch>(rng, items, r % 4 == 0, r % 3, s[1], s[0], r % 7 == 3, cases);
      triple_case<T, TripleBatch>(rng, items, r % 3, s[1], s[0], r % 7 == 5, cases);
    } else {
      scale_case<T, SmallSegmentBatch>(rng, items, r % 4 == 1, r % 3, s[1], s[0], r % 7 == 3, cases);
      triple_case<T, SmallTripleBatch>(rng, items, r % 3, s[1], s[0], r % 7 == 5, cases);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 40;
  std::mt19937_64 rng(argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 1);
  int cases = 0;
  dtype_cases<float>(rng, rounds, cases);
  dtype_cases<double>(rng, rounds, cases);
  dtype_cases<c10::Half>(rng, rounds, cases);
  dtype_cases<c10::BFloat16>(rng, rounds, cases);
  if (failures) {
    std::printf("FAILED: %d items wrong in %d cases\n", failures, cases);
    return 1;
  }
  std::printf("ok %d\n", cases);
  return 0;
}
