// CUDA kernels of the torch.ops.hetlb tensor ops (schemas in csrc/ops/ops.cpp).
//
// scale_, flatten_scaled and unflatten_ are "dst = src * w" over a list of segments, and
// delay_compensate_ an element-wise update over (grad, param, prev) triples. Both use the
// multi-tensor-apply pattern in one kernel template: a batch of items' pointers travels by value in
// the kernel argument (no host->device copy of a pointer table, no sync), and the items are cut into
// fixed tiles so that one launch covers a whole group of tensors with every block busy, however
// uneven the sizes (a 4096x4096 weight next to a 10-element bias). Blocks grid-stride over tiles;
// in a tile each thread keeps several 16-byte loads in flight. The batching, tiles and element
// loops are in tiles.cuh, written for host and device so that a test runs them on the host.
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

#include "ops/cuda/tiles.cuh"
#include "ops/kernels.h"

namespace hetlb::kernels {
namespace {

// One kernel for every op: blocks grid-stride over the tiles of all items (tiles.cuh).
template <typename Batch, typename Op>
__global__ void __launch_bounds__(kThreads) tiled_kernel(Batch batch, Op op) {
  const int64_t ntiles = batch.tile_start[batch.count];
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x)
    run_tile(batch, op, tile, threadIdx.x, blockDim.x);
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

constexpr bool kLargeArgumentsBuilt = large_arguments_built();

// Whether launches may carry more than 4 KB of argument (tiles.cuh, SegmentBatch): the build
// allows it and the driver supports it (CUDA >= 12.1).
bool large_arguments() {
  static const bool ok = [] {
    int version = 0;
    return kLargeArgumentsBuilt && cudaDriverGetVersion(&version) == cudaSuccess && version >= 12010;
  }();
  return ok;
}

template <typename Batch, typename Item, typename Pointers, typename Op>
void run_batched(const std::vector<Item>& items, Pointers pointers, const Op& op) {
  if (items.empty()) return;
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  for_each_batch<Batch>(items, pointers, [&](const Batch& batch) { launch(batch, op, stream); });
}

// run_batched with the large batch for lists longer than a small one where launches can carry
// it, else the small one.
template <typename Large, typename Small, typename Item, typename Pointers, typename Op>
void run_items(const std::vector<Item>& items, Pointers pointers, const Op& op) {
  if constexpr (kLargeArgumentsBuilt) {
    if (items.size() > static_cast<size_t>(Small::kCapacity) && large_arguments())
      return run_batched<Large>(items, pointers, op);
  }
  run_batched<Small>(items, pointers, op);
}

void run_segments(at::ScalarType st, const std::vector<Segment>& segs, double weight) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_scale_segments_cuda", [&] {
    run_items<SegmentBatch, SmallSegmentBatch>(
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

void run_triples(at::ScalarType st, const std::vector<Triple>& triples, double lam) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_delay_compensate_cuda", [&] {
    run_items<TripleBatch, SmallTripleBatch>(
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
