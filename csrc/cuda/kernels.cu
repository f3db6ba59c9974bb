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

struct Segment {
  void* dst;
  const void* src;
  int64_t numel;
};

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

void scale_cuda(at::TensorList tensors, double weight) {
  check_scale(tensors);
  if (tensors.empty()) return;
  const at::cuda::OptionalCUDAGuard guard(tensors[0].device());
  std::vector<Segment> segs;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  for (const auto& t : tensors) {
    if (t.numel() == 0) continue;
    at::Tensor c = t;
    if (!t.is_contiguous()) {
      c = t.contiguous();
      write_back.emplace_back(t, c);
    }
    segs.push_back({c.data_ptr(), c.data_ptr(), c.numel()});
  }
  run_segments(tensors[0].scalar_type(), segs, weight);
  // Same stream as the kernel, so ordered after it; the caching allocator keeps c alive until then.
  for (auto& [t, c] : write_back) t.copy_(c);
}

at::Tensor flatten_scaled_cuda(at::TensorList tensors, double weight,
                               const std::optional<at::Tensor>& extra) {
  check_flatten_scaled(tensors, extra);
  if (tensors.empty()) return flatten_scaled_empty(extra);
  const at::cuda::OptionalCUDAGuard guard(tensors[0].device());
  const bool has_extra = extra.has_value() && extra->defined();
  const int64_t body = total_numel(tensors);
  at::Tensor out = at::empty({body + (has_extra ? extra->numel() : 0)}, tensors[0].options());

  std::vector<Segment> segs;
  std::vector<at::Tensor> keep;  // contiguous copies; freed to the stream-ordered allocator
  const auto elem = out.element_size();
  auto* base = static_cast<char*>(out.data_ptr());
  int64_t off = 0;
  for (const auto& t : tensors) {
    if (t.numel() > 0) {
      at::Tensor c = t.contiguous();
      segs.push_back({base + off * elem, c.const_data_ptr(), c.numel()});
      keep.push_back(std::move(c));
    }
    off += t.numel();
  }
  run_segments(out.scalar_type(), segs, weight);
  if (has_extra && extra->numel() > 0) out.narrow(0, body, extra->numel()).copy_(*extra);
  return out;
}

void unflatten_cuda(const at::Tensor& flat, at::TensorList tensors, double scale) {
  check_unflatten(flat, tensors);
  if (tensors.empty()) return;
  const at::cuda::OptionalCUDAGuard guard(flat.device());
  const at::Tensor src = flat.contiguous();
  const auto elem = src.element_size();
  const auto* base = static_cast<const char*>(src.const_data_ptr());
  std::vector<Segment> segs;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  int64_t off = 0;
  for (const auto& t : tensors) {
    if (t.numel() > 0) {
      at::Tensor c = t;
      if (!t.is_contiguous()) {
        c = at::empty(t.sizes(), t.options());  // fully overwritten: no copy in
        write_back.emplace_back(t, c);
      }
      segs.push_back({c.data_ptr(), base + off * elem, t.numel()});
    }
    off += t.numel();
  }
  run_segments(flat.scalar_type(), segs, scale);
  for (auto& [t, c] : write_back) t.copy_(c);
}

// grad += lam * grad * grad * (param - prev): 3 reads + 1 write per element, no temporaries.
// The evaluation order matches eager `grad + lam * grad * grad * (param - prev)`.
template <typename scalar_t>
__global__ void delay_compensate_kernel(scalar_t* __restrict__ g, const scalar_t* __restrict__ p,
                                        const scalar_t* __restrict__ q, int64_t n,
                                        at::opmath_type<scalar_t> lam) {
  using opmath_t = at::opmath_type<scalar_t>;
  const int64_t stride = static_cast<int64_t>(blockDim.x) * gridDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const opmath_t gv = static_cast<opmath_t>(g[i]);
    const opmath_t d = static_cast<opmath_t>(p[i]) - static_cast<opmath_t>(q[i]);
    g[i] = static_cast<scalar_t>(gv + lam * gv * gv * d);
  }
}

void delay_compensate_cuda(const at::Tensor& grad, const at::Tensor& param,
                           const at::Tensor& prev_param, double lam) {
  check_delay_compensate(grad, param, prev_param);
  if (grad.numel() == 0) return;
  const at::cuda::OptionalCUDAGuard guard(grad.device());
  at::Tensor g = grad.contiguous();
  const at::Tensor p = param.contiguous();
  const at::Tensor q = prev_param.contiguous();
  const int64_t n = g.numel();
  const int blocks =
      static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, max_blocks()));
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, g.scalar_type(), "hetlb_delay_compensate_cuda", [&] {
        delay_compensate_kernel<scalar_t><<<blocks, kThreads, 0, stream>>>(
            g.data_ptr<scalar_t>(), p.const_data_ptr<scalar_t>(), q.const_data_ptr<scalar_t>(), n,
            static_cast<at::opmath_type<scalar_t>>(lam));
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
  if (!g.is_same(grad)) grad.copy_(g);
}

}  // namespace
}  // namespace hetlb::kernels

TORCH_LIBRARY_IMPL(hetlb, CUDA, m) {
  m.impl("scale_", &hetlb::kernels::scale_cuda);
  m.impl("flatten_scaled", &hetlb::kernels::flatten_scaled_cuda);
  m.impl("unflatten_", &hetlb::kernels::unflatten_cuda);
  m.impl("delay_compensate_", &hetlb::kernels::delay_compensate_cuda);
}
