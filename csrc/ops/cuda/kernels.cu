// CUDA kernels of the torch.ops.hetlb tensor ops (schemas in csrc/ops/ops.cpp).
//
// scale_, flatten_scaled and unflatten_ are "dst = src * w" over a list of segments, and
// delay_compensate_ an element-wise update over (grad, param, prev) triples. Both use the
// multi-tensor-apply pattern in one kernel template: a batch of items' pointers travels by value in
// the kernel argument (no host->device copy of a pointer table, no sync), and the items are cut into
// fixed tiles so that one launch covers a whole group of tensors with every block busy, however
// uneven the sizes (a 4096x4096 weight next to a 10-element bias). Blocks grid-stride over tiles.
//
// All launches go to the current stream under a device guard; non-contiguous tensors go through a
// contiguous copy (copied back for outputs) since gradients and parameters are contiguous in
// practice.
#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
// c10/cuda rather than ATen/cuda/CUDAContext.h: the latter pulls in cuBLAS/cuSPARSE headers that a
// minimal toolkit lacks. at::cuda::getCurrentCUDAStream and at::cuda::OptionalCUDAGuard still resolve
// (namespace at uses c10).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <vector>

#include "ops/kernels.h"

namespace hetlb::kernels {
namespace {

// Items travel by value in the kernel argument, kept near 1.5 KB, well under the classic 4 KB
// parameter limit: 48 (dst, src) segments or 36 (grad, param, prev) triples a launch.
constexpr int64_t kTile = 8192;  // elements per block per step: 32 per thread at 256 threads
constexpr int kThreads = 256;

// Up to kMax items of kPtrs pointers each (the first is written, the rest read), cut into tiles.
template <int kPtrs, int kMax>
struct ItemBatch {
  static constexpr int kCapacity = kMax;
  void* ptr[kPtrs][kMax];
  int64_t numel[kMax];
  int64_t tile_start[kMax + 1];  // prefix sum of tiles per item
  int count;
};

// One kernel for every op: blocks grid-stride over the tiles of all items; `op(batch, k, begin,
// end)` updates elements [begin, end) of item k, the block's threads striding over them (the op
// holds the loop so that it loads the item's pointers once, as restrict locals).
template <typename Batch, typename Op>
__global__ void tiled_kernel(Batch batch, Op op) {
  const int64_t ntiles = batch.tile_start[batch.count];
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    // At most kCapacity steps, uniform across the block: cheaper than a per-element search.
    int k = 0;
    while (batch.tile_start[k + 1] <= tile) ++k;
    const int64_t begin = (tile - batch.tile_start[k]) * kTile;
    const int64_t end = ::min(begin + kTile, batch.numel[k]);
    op(batch, k, begin, end);
  }
}

int max_blocks() {
  // A few waves of resident blocks is enough to saturate bandwidth with a grid-stride loop.
  // cudaDeviceGetAttribute is a cached driver query, cheap next to a launch.
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return std::max(sms, 1) * 8;
}

template <typename Batch, typename Op>
void launch(const Batch& batch, const Op& op, cudaStream_t stream) {
  const int64_t ntiles = batch.tile_start[batch.count];
  if (ntiles == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ntiles, max_blocks()));
  tiled_kernel<<<blocks, kThreads, 0, stream>>>(batch, op);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Packs the items into batches of Batch::kCapacity and launches each full batch and the last:
// a model's 400 gradients take a dozen launches, not 400. `pointers(item)` lists an item's
// pointers in the batch's order.
template <typename Batch, typename Item, typename Pointers, typename Op>
void run_batched(const std::vector<Item>& items, Pointers pointers, const Op& op) {
  if (items.empty()) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
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
      launch(batch, op, stream);
      batch.count = 0;
    }
  }
  if (batch.count > 0) launch(batch, op, stream);
}

using SegmentBatch = ItemBatch<2, 48>;

// dst = src * w
template <typename scalar_t>
struct ScaleOp {
  at::opmath_type<scalar_t> w;
  __device__ void operator()(const SegmentBatch& b, int k, int64_t begin, int64_t end) const {
    using opmath_t = at::opmath_type<scalar_t>;
    auto* dst = static_cast<scalar_t*>(b.ptr[0][k]);
    const auto* src = static_cast<const scalar_t*>(b.ptr[1][k]);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      dst[i] = static_cast<scalar_t>(static_cast<opmath_t>(src[i]) * w);
  }
};

void run_segments(at::ScalarType st, const std::vector<Segment>& segs, double weight) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_scale_segments_cuda", [&] {
    run_batched<SegmentBatch>(
        segs, [](const Segment& s) { return std::array<const void*, 2>{s.dst, s.src}; },
        ScaleOp<scalar_t>{static_cast<at::opmath_type<scalar_t>>(weight)});
  });
}

// The guard makes the tensors' device current, so the kernels and the write-back copies run on
// that device's current stream, in order.
void scale_cuda(at::TensorList tensors, double weight) {
  const at::cuda::OptionalCUDAGuard guard(at::device_of(tensors));
  scale_with(tensors, weight, run_segments);
}

at::Tensor flatten_scaled_cuda(at::TensorList tensors, double weight,
                               const std::optional<at::Tensor>& extra) {
  const at::cuda::OptionalCUDAGuard guard(tensors.empty() ? at::device_of(extra) : at::device_of(tensors));
  return flatten_scaled_with(tensors, weight, extra, run_segments);
}

void unflatten_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  const at::cuda::OptionalCUDAGuard guard(flat.device());
  unflatten_with(flat, tensors, scale, run_segments);
}

using TripleBatch = ItemBatch<3, 36>;

// grad += lam * grad * grad * (param - prev): 3 reads + 1 write per element, no temporaries.
// The evaluation order matches eager `grad + lam * grad * grad * (param - prev)`.
template <typename scalar_t>
struct DelayCompensateOp {
  at::opmath_type<scalar_t> lam;
  __device__ void operator()(const TripleBatch& b, int k, int64_t begin, int64_t end) const {
    using opmath_t = at::opmath_type<scalar_t>;
    auto* __restrict__ g = static_cast<scalar_t*>(b.ptr[0][k]);
    const auto* __restrict__ p = static_cast<const scalar_t*>(b.ptr[1][k]);
    const auto* __restrict__ q = static_cast<const scalar_t*>(b.ptr[2][k]);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const opmath_t gv = static_cast<opmath_t>(g[i]);
      const opmath_t d = static_cast<opmath_t>(p[i]) - static_cast<opmath_t>(q[i]);
      g[i] = static_cast<scalar_t>(gv + lam * gv * gv * d);
    }
  }
};

void run_triples(at::ScalarType st, const std::vector<Triple>& triples, double lam) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_delay_compensate_cuda", [&] {
    run_batched<TripleBatch>(
        triples, [](const Triple& t) { return std::array<const void*, 3>{t.g, t.p, t.q}; },
        DelayCompensateOp<scalar_t>{static_cast<at::opmath_type<scalar_t>>(lam)});
  });
}

void delay_compensate_cuda(at::TensorList grads, at::TensorList params, at::TensorList prevs,
                           double lam) {
  const at::cuda::OptionalCUDAGuard guard(at::device_of(grads));
  delay_compensate_with(grads, params, prevs, lam, run_triples);
}

}  // namespace
}  // namespace hetlb::kernels

TORCH_LIBRARY_IMPL(hetlb, CUDA, m) {
  m.impl("scale_", &hetlb::kernels::scale_cuda);
  m.impl("flatten_scaled", &hetlb::kernels::flatten_scaled_cuda);
  m.impl("unflatten_", &hetlb::kernels::unflatten_cuda);
  m.impl("delay_compensate_", &hetlb::kernels::delay_compensate_cuda);
}
