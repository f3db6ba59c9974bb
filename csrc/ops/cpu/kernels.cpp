// CPU kernels of the torch.ops.hetlb tensor ops (schemas in csrc/ops/ops.cpp).
//
// scale_, flatten_scaled and unflatten_ are all "dst = src * w" over a list of (dst, src, numel)
// segments, so they share one multi-segment loop: a single at::parallel_for over the total element
// count of the list, so that a model with hundreds of small biases is split among threads as one
// buffer instead of paying a fork/join per tensor.
//
// Inner loops: with a vector ISA enabled at build time (CPU_CAPABILITY_AVX2/AVX512, as ATen's own
// kernels are built) they use at::vec::map / map3, which widen half/bfloat16 to float32 lanes.
// A plain extension build has no such define, and then at::vec falls back to its generic
// array-of-scalars Vectorized, which measured 2-3x slower than torch's own kernels for float32 and
// ~15-30x slower for float16 on one core. There, plain loops that GCC auto-vectorises at -O3 are
// used instead; they are memory-bound like torch's kernels.
//
// Argument checks, layout and non-contiguous handling are shared with CUDA (csrc/ops/kernels.h).
#include <ATen/ATen.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HETLB_F16C_PATH 1
#endif

#include "ops/kernels.h"

namespace hetlb::kernels {
namespace {

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
constexpr bool kUseAtenVec = true;
#else
constexpr bool kUseAtenVec = false;
#endif

// Compute type: float for half/bfloat16 (and float), double for double.
template <typename scalar_t>
using opmath_t = at::opmath_type<scalar_t>;

#ifdef HETLB_F16C_PATH
// float16 <-> float32 in software (c10::Half's scalar path) costs ~15x a memory-bound pass, and a
// baseline x86-64 build cannot emit F16C. These self-contained functions are compiled for AVX+F16C
// only and picked at run time; they touch no inline library code, so nothing built for F16C can be
// merged into code that runs on older CPUs. Rounding is IEEE nearest-even, like c10::Half.
bool cpu_has_f16c() {
  static const bool ok = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return ok;
}

__attribute__((target("avx,f16c"))) void scale_half_f16c(uint16_t* dst, const uint16_t* src,
                                                         int64_t n, float w) {
  const __m256 vw = _mm256_set1_ps(w);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_mul_ps(x, vw), _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) dst[i] = _cvtss_sh(_cvtsh_ss(src[i]) * w, _MM_FROUND_TO_NEAREST_INT);
}

__attribute__((target("avx,f16c"))) inline __m256 load_half8(const uint16_t* a) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a)));
}

__attribute__((target("avx,f16c"))) void delay_half_f16c(uint16_t* g, const uint16_t* p,
                                                         const uint16_t* q, int64_t n, float lam) {
  const __m256 vl = _mm256_set1_ps(lam);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = load_half8(g + i);
    const __m256 d = _mm256_sub_ps(load_half8(p + i), load_half8(q + i));
    const __m256 r = _mm256_add_ps(gv, _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(vl, gv), gv), d));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(g + i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
  }
  for (; i < n; ++i) {
    const float gv = _cvtsh_ss(g[i]);
    const float d = _cvtsh_ss(p[i]) - _cvtsh_ss(q[i]);
    g[i] = _cvtss_sh(gv + lam * gv * gv * d, _MM_FROUND_TO_NEAREST_INT);
  }
}
#endif

// dst[i] = src[i] * w; dst == src is allowed (in-place), so no __restrict__.
template <typename scalar_t>
inline void scale_span(scalar_t* dst, const scalar_t* src, int64_t n, opmath_t<scalar_t> w) {
#ifdef HETLB_F16C_PATH
  if constexpr (std::is_same_v<scalar_t, at::Half>) {
    if (!kUseAtenVec && cpu_has_f16c()) {
      scale_half_f16c(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t*>(src), n,
                      w);
      return;
    }
  }
#endif
  if constexpr (kUseAtenVec) {
    using Vec = at::vec::Vectorized<opmath_t<scalar_t>>;
    at::vec::map([w](Vec x) { return x * Vec(w); }, dst, src, n);
  } else {
    for (int64_t i = 0; i < n; ++i)
      dst[i] = static_cast<scalar_t>(static_cast<opmath_t<scalar_t>>(src[i]) * w);
  }
}

// g[i] += lam * g[i] * g[i] * (p[i] - q[i]), in the order of the eager expression
// `g + lam * g * g * (p - q)` (and -ffp-contract=off: no FMA), so float32 matches eager.
template <typename scalar_t>
inline void delay_span(scalar_t* g, const scalar_t* p, const scalar_t* q, int64_t n,
                       opmath_t<scalar_t> lam) {
  using opmath = opmath_t<scalar_t>;
#ifdef HETLB_F16C_PATH
  if constexpr (std::is_same_v<scalar_t, at::Half>) {
    if (!kUseAtenVec && cpu_has_f16c()) {
      delay_half_f16c(reinterpret_cast<uint16_t*>(g), reinterpret_cast<const uint16_t*>(p),
                      reinterpret_cast<const uint16_t*>(q), n, lam);
      return;
    }
  }
#endif
  if constexpr (kUseAtenVec) {
    using Vec = at::vec::Vectorized<opmath>;
    const Vec l(lam);
    at::vec::map3([l](Vec gv, Vec pv, Vec qv) { return gv + l * gv * gv * (pv - qv); }, g, g, p,
                  q, n);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const opmath gv = static_cast<opmath>(g[i]);
      const opmath d = static_cast<opmath>(p[i]) - static_cast<opmath>(q[i]);
      g[i] = static_cast<scalar_t>(gv + lam * gv * gv * d);
    }
  }
}

// dst[i] = src[i] * w over every segment; dst == src is allowed (in-place scale).
template <typename scalar_t>
void scale_segments(const std::vector<Segment>& segs, double weight) {
  const auto w = static_cast<opmath_t<scalar_t>>(weight);
  // start[k] = first global element of segment k; start.back() = total.
  std::vector<int64_t> start(segs.size() + 1, 0);
  for (size_t k = 0; k < segs.size(); ++k) start[k + 1] = start[k] + segs[k].numel;
  const int64_t total = start.back();
  if (total == 0) return;

  at::parallel_for(0, total, kGrainSize, [&](int64_t begin, int64_t end) {
    // Segment holding `begin`: the last start <= begin (empty segments were never added).
    size_t k = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t i = begin; i < end; ++k) {
      const int64_t lo = i - start[k];
      const int64_t hi = std::min(end, start[k + 1]) - start[k];
      auto* dst = static_cast<scalar_t*>(segs[k].dst) + lo;
      const auto* src = static_cast<const scalar_t*>(segs[k].src) + lo;
      scale_span<scalar_t>(dst, src, hi - lo, w);
      i = start[k] + hi;
    }
  });
}

void run_segments(at::ScalarType st, const std::vector<Segment>& segs, double weight) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_scale_segments",
                                  [&] { scale_segments<scalar_t>(segs, weight); });
}

void scale_cpu(at::TensorList tensors, double weight) { scale_with(tensors, weight, run_segments); }

at::Tensor flatten_scaled_cpu(at::TensorList tensors, double weight,
                              const std::optional<at::Tensor>& extra) {
  return flatten_scaled_with(tensors, weight, extra, run_segments);
}

void unflatten_cpu(const at::Tensor& flat, at::TensorList tensors, double scale) {
  unflatten_with(flat, tensors, scale, run_segments);
}

// grad += lam * grad * grad * (param - prev): one read of each input, one write, no temporaries.
template <typename scalar_t>
void delay_compensate_kernel(scalar_t* g, const scalar_t* p, const scalar_t* q, int64_t n,
                             double lam) {
  const auto l = static_cast<opmath_t<scalar_t>>(lam);
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    delay_span<scalar_t>(g + begin, p + begin, q + begin, end - begin, l);
  });
}

void run_triples(at::ScalarType st, const std::vector<Triple>& triples, double lam) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "hetlb_delay_compensate", [&] {
    for (const auto& t : triples)
      delay_compensate_kernel<scalar_t>(static_cast<scalar_t*>(t.g),
                                        static_cast<const scalar_t*>(t.p),
                                        static_cast<const scalar_t*>(t.q), t.numel, lam);
  });
}

void delay_compensate_cpu(at::TensorList grads, at::TensorList params, at::TensorList prevs,
                          double lam) {
  delay_compensate_with(grads, params, prevs, lam, run_triples);
}

}  // namespace
}  // namespace hetlb::kernels

TORCH_LIBRARY_IMPL(hetlb, CPU, m) {
  m.impl("scale_", &hetlb::kernels::scale_cpu);
  m.impl("flatten_scaled", &hetlb::kernels::flatten_scaled_cpu);
  m.impl("unflatten_", &hetlb::kernels::unflatten_cpu);
  m.impl("delay_compensate_", &hetlb::kernels::delay_compensate_cpu);
}
