// The index arithmetic of the CUDA kernels (kernels.cu), written for host and device alike so that
// tests/native/cuda_tiles_host.cpp runs it on the host, block by block and thread by thread, where
// no GPU is present: the packing of items into launches, the tiles, the vector and scalar loops.
//
// A launch takes a batch of items (kPtrs pointers each: the first is written, and read where the op
// reads it; the rest read) cut into tiles of kTile elements; blocks stride over the tiles. In a tile
// each thread keeps kUnroll independent loads in flight before it stores: one 4-byte load per thread
// at a time leaves about half of an H100's bandwidth unused (too few bytes in flight per SM to cover
// the memory latency). Where every pointer of an item is 16-byte aligned the loads are 16-byte
// vectors (4 floats, 8 halves), the tile's last partial vector element by element; otherwise (a
// segment packed after an odd-sized one in flatten_scaled) the same loop runs on single elements.
// Each element is read and written by one thread only, so an output that is also an input (scale_
// in place, delay_compensate_'s gradient) needs no ordering between threads.
#pragma once

#include <ATen/OpMathType.h>

#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define HETLB_HD __host__ __device__ __forceinline__
#define HETLB_UNROLL _Pragma("unroll")
#else
#define HETLB_HD inline
#define HETLB_UNROLL
#endif

namespace hetlb::kernels {

// The HETLB_TILE_* macros exist for bench/bench_tiles.py, which builds the kernels with other
// shapes to measure them side by side; the extension never sets them.
#ifndef HETLB_TILE_ELEMENTS
#define HETLB_TILE_ELEMENTS 8192
#endif
#ifndef HETLB_TILE_THREADS
#define HETLB_TILE_THREADS 256
#endif
#ifndef HETLB_TILE_UNROLL
#define HETLB_TILE_UNROLL 4
#endif
constexpr int64_t kTile = HETLB_TILE_ELEMENTS;  // elements per block per step (32 a thread at 256)
constexpr int kThreads = HETLB_TILE_THREADS;
constexpr int kUnroll = HETLB_TILE_UNROLL;       // loads in flight per thread and input
constexpr int kVectorBytes = 16;

// Up to kMax items of kPtrs pointers each, cut into tiles; travels by value in the kernel argument.
template <int kPtrs, int kMax>
struct ItemBatch {
  static constexpr int kCapacity = kMax;
  static constexpr int kPointers = kPtrs;
  void* ptr[kPtrs][kMax];
  int64_t numel[kMax];
  int64_t tile_start[kMax + 1];  // prefix sum of tiles per item
  int count;
};

// The item that tile `tile` (< the batch's tiles) belongs to: the last whose first tile is at or
// before it (an empty item shares its first tile with the next one, so it is never the last). A
// binary search, uniform across a block: a launch carries up to 512 items.
template <typename Batch>
HETLB_HD int item_of(const Batch& batch, int64_t tile) {
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

// Elements [first, first + V * count) of `out` from `in` in vectors of V elements (V = 1: single
// elements), as thread `lane` of `lanes`, kUnroll loads in flight per input before the stores.
template <int V, int kIn, typename T, typename F>
HETLB_HD void run_vectors(T* out, const T* const* in, int64_t first, int64_t count, int lane,
                          int lanes, const F& f) {
  using W = Vec<T, V>;
  const int64_t base = first / V;
  W* o = reinterpret_cast<W*>(out);
  for (int64_t j0 = lane; j0 < count; j0 += static_cast<int64_t>(lanes) * kUnroll) {
    W x[kUnroll][kIn];
    HETLB_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + static_cast<int64_t>(u) * lanes;
      if (j < count) {
        HETLB_UNROLL
        for (int a = 0; a < kIn; ++a) x[u][a] = reinterpret_cast<const W*>(in[a])[base + j];
      }
    }
    HETLB_UNROLL
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t j = j0 + static_cast<int64_t>(u) * lanes;
      if (j < count) {
        W y;
        HETLB_UNROLL
        for (int e = 0; e < V; ++e) {
          T vals[kIn];
          HETLB_UNROLL
          for (int a = 0; a < kIn; ++a) vals[a] = x[u][a].v[e];
          y.v[e] = f(vals);
        }
        o[base + j] = y;
      }
    }
  }
}

// Elements [begin, end) of item k of `batch` (begin a multiple of kTile), as thread `lane` of
// `lanes`: out[i] = f(in) with in[j] = ptr[j + 1 - kReadsOut][k][i], where kReadsOut says whether
// ptr[0] (the output) is also the op's first input. f takes the kIn = kPtrs - 1 + kReadsOut input
// values of one element and returns the output's. Aligned items go in 16-byte vectors, the tile's
// last partial vector element by element; others element by element throughout.
template <typename T, bool kReadsOut, typename Batch, typename F>
HETLB_HD void tile_elements(const Batch& batch, int k, int64_t begin, int64_t end, int lane,
                            int lanes, const F& f) {
  constexpr int kPtrs = Batch::kPointers;
  constexpr int kIn = kPtrs - 1 + (kReadsOut ? 1 : 0);
  constexpr int V = kVectorBytes / static_cast<int>(sizeof(T)) > 0 ? kVectorBytes / static_cast<int>(sizeof(T)) : 1;
  T* out = static_cast<T*>(batch.ptr[0][k]);
  const T* in[kIn];
  bool aligned = reinterpret_cast<uintptr_t>(out) % kVectorBytes == 0;
  for (int j = 0; j < kIn; ++j) {
    in[j] = static_cast<const T*>(batch.ptr[j + 1 - (kReadsOut ? 1 : 0)][k]);
    aligned = aligned && reinterpret_cast<uintptr_t>(in[j]) % kVectorBytes == 0;
  }
  int64_t i0 = begin;
  if (aligned && begin % V == 0) {
    const int64_t vectors = (end - begin) / V;
    run_vectors<V, kIn>(out, in, begin, vectors, lane, lanes, f);
    i0 = begin + vectors * V;
  }
  run_vectors<1, kIn>(out, in, i0, end - i0, lane, lanes, f);
}

// One block's work at `tile` of `batch`: the tile's item and element range, then op(batch, k,
// begin, end, lane, lanes).
template <typename Batch, typename Op>
HETLB_HD void run_tile(const Batch& batch, const Op& op, int64_t tile, int lane, int lanes) {
  const int k = item_of(batch, tile);
  const int64_t begin = (tile - batch.tile_start[k]) * kTile;
  const int64_t end = begin + kTile < batch.numel[k] ? begin + kTile : batch.numel[k];
  op(batch, k, begin, end, lane, lanes);
}

// Packs the items into batches of Batch::kCapacity and calls launch(batch) for each full batch
// and the last: a model's 400 gradients take a dozen launches, not 400. `pointers(item)` lists an
// item's pointers in the batch's order.
template <typename Batch, typename Item, typename Pointers, typename Launch>
void for_each_batch(const std::vector<Item>& items, Pointers pointers, const Launch& launch) {
  if (items.empty()) return;
  Batch batch{};
  batch.count = 0;
  batch.tile_start[0] = 0;
  for (const auto& item : items) {
    const int k = batch.count;
    const auto ptrs = pointers(item);
    for (size_t j = 0; j < ptrs.size(); ++j) batch.ptr[j][k] = const_cast<void*>(ptrs[j]);
    batch.numel[k] = item.numel;
    batch.tile_start[k + 1] = batch.tile_start[k] + (item.numel + kTile - 1) / kTile;
    if (++batch.count == Batch::kCapacity) {
      launch(batch);
      batch.count = 0;
    }
  }
  if (batch.count > 0) launch(batch);
}

// Items a launch carries in its argument. A model's 400 tensors in one launch instead of a
// dozen: each launch's ramp and tail cost about 4 us on an H200, a third of a 50 M-element
// scale_ (bench/RESULTS.md, "CUDA, H200"). 512 items take 16 KB (pairs) and 20 KB (triples) of
// argument, which CUDA 12.1's 32 KB kernel parameters allow on Volta (sm_70) and newer; the
// Small batches fit the 4 KB of older toolkits, drivers and GPUs, and carry short lists (a
// launch copies its whole argument).
using SegmentBatch = ItemBatch<2, 512>;     // (dst, src)
using TripleBatch = ItemBatch<3, 512>;      // (grad, param, prev)
using SmallSegmentBatch = ItemBatch<2, 48>;  // about 1.5 KB of argument
using SmallTripleBatch = ItemBatch<3, 36>;

#if defined(__CUDACC__)
// Whether this build may launch the large batches: a CUDA >= 12.1 compiler, and every
// architecture it compiles for (nvcc's __CUDA_ARCH_LIST__, in the host pass too) sm_70 or newer
// (ptxas refuses more than 4 KB of parameters below). The driver is checked at run time.
constexpr bool large_arguments_built() {
#if defined(__CUDACC_VER_MAJOR__) && defined(__CUDA_ARCH_LIST__) && \
    (__CUDACC_VER_MAJOR__ > 12 || (__CUDACC_VER_MAJOR__ == 12 && __CUDACC_VER_MINOR__ >= 1))
  constexpr int archs[] = {__CUDA_ARCH_LIST__};
  for (int a : archs)
    if (a < 700) return false;
  return true;
#else
  return false;
#endif
}
#endif

// dst = src * w, in the op math type (float for half and bfloat16).
template <typename scalar_t>
struct ScaleOp {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t w;
  HETLB_HD scalar_t operator()(const scalar_t* x) const {
    return static_cast<scalar_t>(static_cast<opmath_t>(x[0]) * w);
  }
  template <int kMax>
  HETLB_HD void operator()(const ItemBatch<2, kMax>& b, int k, int64_t begin, int64_t end, int lane,
                           int lanes) const {
    tile_elements<scalar_t, false>(b, k, begin, end, lane, lanes, *this);
  }
};

// grad += lam * grad * grad * (param - prev): 3 reads + 1 write per element, no temporaries.
// The evaluation order matches eager `grad + lam * grad * grad * (param - prev)`.
template <typename scalar_t>
struct DelayCompensateOp {
  using opmath_t = at::opmath_type<scalar_t>;
  opmath_t lam;
  HETLB_HD scalar_t operator()(const scalar_t* x) const {
    const opmath_t gv = static_cast<opmath_t>(x[0]);
    const opmath_t d = static_cast<opmath_t>(x[1]) - static_cast<opmath_t>(x[2]);
    return static_cast<scalar_t>(gv + lam * gv * gv * d);
  }
  template <int kMax>
  HETLB_HD void operator()(const ItemBatch<3, kMax>& b, int k, int64_t begin, int64_t end, int lane,
                           int lanes) const {
    tile_elements<scalar_t, true>(b, k, begin, end, lane, lanes, *this);
  }
};

}  // namespace hetlb::kernels
