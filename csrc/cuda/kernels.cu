// CUDA kernels of the torch.ops.hetlb tensor ops (schemas in csrc/hetlb.cpp).
//
// scale_, flatten_scaled and unflatten_ are "dst = src * w" over a list of segments. They use the
// multi-tensor-apply pattern: up to kMaxSegments (dst, src, numel) triples travel by value in the
// kernel argument (no host->device copy of a pointer table, no sync), and the segments are cut into
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
#include <vector>

#include "kernels.h"

namespace hetlb::kernels {
namespace {

// 48 segments keep the by-value argument (~1.6 KB) well under the classic 4 KB parameter limit.
constexpr int kMaxSegments = 48;
constexpr int64_t kTile = 8192;  // elements per block per step: 32 per thread at 256 threads
constexpr int kThreads = 256;

struct SegmentBatch {
  void* dst[kMaxSegments];
  const void* src[kMaxSegments];
  int64_t numel[kMaxSegments];
  int64_t tile_start[kMaxSegments + 1];  // prefix sum of tiles per segment
  int count;
};

template <typename scalar_t>
__global__ void scale_segments_kernel(SegmentBatch batch, at::opmath_type<scalar_t> w) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t ntiles = batch.tile_start[batch.count];
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    // At most kMaxSegments steps, uniform across the block: cheaper than a per-element search.
    int k = 0;
    while (batch.tile_start[k + 1] <= tile) ++k;
    const int64_t begin = (tile - batch.tile_start[k]) * kTile;
    const int64_t end = ::min(begin + kTile, batch.numel[k]);
    auto* dst = static_cast<scalar_t*>(batch.dst[k]);
    const auto* src = static_cast<const scalar_t*>(batch.src[k]);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x)
      dst[i] = static_cast<scalar_t>(static_cast<opmath_t>(src[i]) * w);
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

template <typename scalar_t>
void launch_batch(SegmentBatch& batch, double weight, cudaStream_t stream) {
  const int64_t ntiles = batch.tile_start[batch.count];
  if (ntiles == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ntiles, max_blocks()));
  scale_segments_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
      batch, static_cast<at::opmath_type<scalar_t>>(weight));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// One launch per kMaxSegments non-empty segments.
void run_segments(at::ScalarType st, const std::vector<Segment>& segs, double weight) {
  if (segs.empty()) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_scale_segments_cuda", [&] {
    SegmentBatch batch{};
    batch.count = 0;
    batch.tile_start[0] = 0;
    for (const auto& s : segs) {
      const int k = batch.count;
      batch.dst[k] = s.dst;
      batch.src[k] = s.src;
      batch.numel[k] = s.numel;
      batch.tile_start[k + 1] = batch.tile_start[k] + (s.numel + kTile - 1) / kTile;
      if (++batch.count == kMaxSegments) {
        launch_batch<scalar_t>(batch, weight, stream);
        batch.count = 0;
      }
    }
    if (batch.count > 0) launch_batch<scalar_t>(batch, weight, stream);
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

// grad += lam * grad * grad * (param - prev): 3 reads + 1 write per element, no temporaries.
// The evaluation order matches eager `grad + lam * grad * grad * (param - prev)`. Multi-tensor as
// above: one launch covers up to kMaxTriples tensors (a model's 400 gradients take 12 launches,
// not 400), the triples passed by value.
constexpr int kMaxTriples = 36;  // 4 words per triple + tile prefix: ~1.5 KB of kernel argument

struct TripleBatch {
  void* g[kMaxTriples];
  const void* p[kMaxTriples];
  const void* q[kMaxTriples];
  int64_t numel[kMaxTriples];
  int64_t tile_start[kMaxTriples + 1];
  int count;
};

template <typename scalar_t>
__global__ void delay_compensate_kernel(TripleBatch batch, at::opmath_type<scalar_t> lam) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t ntiles = batch.tile_start[batch.count];
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    int k = 0;
    while (batch.tile_start[k + 1] <= tile) ++k;
    const int64_t begin = (tile - batch.tile_start[k]) * kTile;
    const int64_t end = ::min(begin + kTile, batch.numel[k]);
    auto* __restrict__ g = static_cast<scalar_t*>(batch.g[k]);
    const auto* __restrict__ p = static_cast<const scalar_t*>(batch.p[k]);
    const auto* __restrict__ q = static_cast<const scalar_t*>(batch.q[k]);
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
      const opmath_t gv = static_cast<opmath_t>(g[i]);
      const opmath_t d = static_cast<opmath_t>(p[i]) - static_cast<opmath_t>(q[i]);
      g[i] = static_cast<scalar_t>(gv + lam * gv * gv * d);
    }
  }
}

template <typename scalar_t>
void launch_triples(TripleBatch& batch, double lam, cudaStream_t stream) {
  const int64_t ntiles = batch.tile_start[batch.count];
  if (ntiles == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>(ntiles, max_blocks()));
  delay_compensate_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
      batch, static_cast<at::opmath_type<scalar_t>>(lam));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void run_triples(at::ScalarType st, const std::vector<Triple>& triples, double lam) {
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_delay_compensate_cuda", [&] {
    TripleBatch batch{};
    batch.count = 0;
    batch.tile_start[0] = 0;
    for (const auto& t : triples) {
      const int k = batch.count;
      batch.g[k] = t.g;
      batch.p[k] = t.p;
      batch.q[k] = t.q;
      batch.numel[k] = t.numel;
      batch.tile_start[k + 1] = batch.tile_start[k] + (t.numel + kTile - 1) / kTile;
      if (++batch.count == kMaxTriples) {
        launch_triples<scalar_t>(batch, lam, stream);
        batch.count = 0;
      }
    }
    if (batch.count > 0) launch_triples<scalar_t>(batch, lam, stream);
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
