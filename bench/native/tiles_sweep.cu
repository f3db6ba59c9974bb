// The CUDA kernels' tiling (csrc/ops/cuda/tiles.cuh) measured in other shapes, side by side in one
// process: items per launch (the small batches' 48 and 36, or the large ones' 512),
// blocks per SM, and, through the HETLB_TILE_* macros this file is built with, the tile, threads
// and loads in flight. Built and run by bench/bench_tiles.py, one binary per tile shape.
//
// The data is bench/bench_kernels.py's: float32 tensors shaped like a transformer's parameters
// (about 50 M elements, 407 tensors), each its own allocation. scale_ runs in place (w = -1: exact
// when repeated), delay_compensate_ on (grad, param, prev). Every figure is the median of 9 samples
// of 20 back-to-back launches of the whole op, timed by CUDA events: the device's time, not the
// host's (bench_kernels.py times the op as Python calls it). Prints one line per case:
//   tiles TILE THREADS UNROLL | op ITEMS BLOCKS_PER_SM | ms GB/s pct_of_copy
#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ops/cuda/tiles.cuh"

using namespace hetlb::kernels;

namespace {

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

template <bool kReadsOut, typename F>
struct TileOp {
  F f;
  template <typename Batch>
  __device__ void operator()(const Batch& b, int k, int64_t begin, int64_t end, int lane,
                             int lanes) const {
    tile_elements<float, kReadsOut>(b, k, begin, end, lane, lanes, f);
  }
};

// csrc/ops/cuda/kernels.cu's tiled_kernel, built here with this file's tile shape.
template <typename Batch, typename Op>
__global__ void __launch_bounds__(kThreads) sweep_kernel(Batch batch, Op op) {
  const int64_t ntiles = batch.tile_start[batch.count];
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x)
    run_tile(batch, op, tile, threadIdx.x, blockDim.x);
}

struct Item {
  int64_t numel;
  float* g;
  float* p;
  float* q;
};

// bench_kernels.model_shapes(numel) as element counts, in the same order.
std::vector<int64_t> model_sizes(int64_t numel) {
  std::vector<int64_t> small, mats, out;
  for (int i = 0; i < 100; ++i) small.insert(small.end(), {4096, 1024, 4096, 256});
  int64_t rest = numel;
  for (int64_t s : small) rest -= s;
  rest = std::max<int64_t>(rest, 0);
  while (rest >= 4096LL * 4096) { mats.push_back(4096LL * 4096); rest -= 4096LL * 4096; }
  while (rest >= 1024LL * 4096) { mats.push_back(1024LL * 4096); rest -= 1024LL * 4096; }
  if (rest >= 4096) { mats.push_back(rest / 4096 * 4096); rest %= 4096; }
  if (rest) mats.push_back(rest);
  size_t k = 0;
  const size_t per = small.size() / std::max<size_t>(mats.size(), 1);
  for (int64_t m : mats) {
    out.push_back(m);
    for (size_t j = 0; j < per; ++j) out.push_back(small[k++]);
  }
  while (k < small.size()) out.push_back(small[k++]);
  return out;
}

float* random_buffer(int64_t n, unsigned seed) {
  std::vector<float> host(static_cast<size_t>(n));
  unsigned x = seed * 2654435761u + 1;
  for (auto& v : host) {
    x = x * 1664525u + 1013904223u;
    v = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  }
  float* d = nullptr;
  CHECK(cudaMalloc(&d, n * sizeof(float)));
  CHECK(cudaMemcpy(d, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  return d;
}

int sms() {
  int device = 0, n = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
  return n;
}

// Median ms of one call of fn (9 samples of 20 calls, after 5 warm-up calls).
template <typename Fn>
double median_ms(Fn fn) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 5; ++i) fn();
  std::vector<double> ms;
  for (int s = 0; s < 9; ++s) {
    CHECK(cudaEventRecord(a));
    for (int i = 0; i < 20; ++i) fn();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float t = 0;
    CHECK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t / 20.0);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

template <int kMax>
double time_scale(const std::vector<Item>& items, int blocks_per_sm) {
  using B = ItemBatch<2, kMax>;
  const int max_blocks = sms() * blocks_per_sm;
  TileOp<false, ScaleOp<float>> op{ScaleOp<float>{-1.0f}};
  return median_ms([&] {
    for_each_batch<B>(items, [](const Item& it) { return std::array<const void*, 2>{it.g, it.g}; },
                      [&](const B& b) {
                        const int64_t t = b.tile_start[b.count];
                        const int blocks = static_cast<int>(std::min<int64_t>(t, max_blocks));
                        sweep_kernel<<<blocks, kThreads>>>(b, op);
                      });
  });
}

template <int kMax>
double time_delay(const std::vector<Item>& items, int blocks_per_sm) {
  using B = ItemBatch<3, kMax>;
  const int max_blocks = sms() * blocks_per_sm;
  TileOp<true, DelayCompensateOp<float>> op{DelayCompensateOp<float>{0.1f}};
  return median_ms([&] {
    for_each_batch<B>(items,
                      [](const Item& it) { return std::array<const void*, 3>{it.g, it.p, it.q}; },
                      [&](const B& b) {
                        const int64_t t = b.tile_start[b.count];
                        const int blocks = static_cast<int>(std::min<int64_t>(t, max_blocks));
                        sweep_kernel<<<blocks, kThreads>>>(b, op);
                      });
  });
}

// The 512-item rows, where the build allows arguments over 4 KB (tiles.cuh).
template <bool kLarge, typename Row>
void large_rows(const std::vector<Item>& items, int bps, const Row& row) {
  if constexpr (kLarge) {
    row("scale", 512, bps, time_scale<512>(items, bps), 2);
    row("delay", 512, bps, time_delay<512>(items, bps), 4);
  }
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t numel = argc > 1 ? std::atoll(argv[1]) : 50000000;
  const std::vector<int64_t> sizes = model_sizes(numel);
  std::vector<Item> items;
  int64_t n = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const auto s = static_cast<unsigned>(i);
    items.push_back({sizes[i], random_buffer(sizes[i], 3 * s), random_buffer(sizes[i], 3 * s + 1),
                     nullptr});
    items.back().q = random_buffer(sizes[i], 3 * s + 2);
    n += sizes[i];
  }
  float *src = random_buffer(n, 7), *dst = random_buffer(n, 8);
  const double copy = median_ms([&] { CHECK(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToDevice)); });
  const double copy_gbs = 2.0 * n * 4 / copy / 1e6;
  const char* tiles_fmt = "tiles %lld %d %d | ";
  std::printf(tiles_fmt, static_cast<long long>(kTile), kThreads, kUnroll);
  std::printf("copy %zu 0 | %.4f %.1f 100.0\n", sizes.size(), copy, copy_gbs);
  auto row = [&](const char* op, int items_max, int bps, double ms, int bytes) {
    const double gbs = static_cast<double>(bytes) * n * 4 / ms / 1e6;
    std::printf(tiles_fmt, static_cast<long long>(kTile), kThreads, kUnroll);
    std::printf("%s %d %d | %.4f %.1f %.1f\n", op, items_max, bps, ms, gbs,
                100.0 * gbs / copy_gbs);
  };
  for (int bps : {2, 4, 8, 16, 32}) {
    if (bps * kThreads > 2048) continue;  // more threads than an SM holds: the rest wait
    row("scale", 48, bps, time_scale<48>(items, bps), 2);
    row("delay", 36, bps, time_delay<36>(items, bps), 4);
    large_rows<large_arguments_built()>(items, bps, row);
  }
  return 0;
}
