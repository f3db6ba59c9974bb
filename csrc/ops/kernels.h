// Argument checks and layout helpers shared by the CPU (csrc/ops/cpu) and CUDA (csrc/ops/cuda)
// kernels of the torch.ops.hetlb tensor ops. Host-only code, but included from .cu files, so it
// must stay nvcc-clean: no CPU vector headers here.
#pragma once
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <sstream>
#include <string>
#include <optional>
#include <utility>
#include <vector>

namespace hetlb::kernels {
// Internal linkage: this header is compiled by nvcc and by the C++ compiler with different flags,
// and one shared inline copy of these helpers must not be picked for both.
namespace {

// Below this many elements per thread, at::parallel_for's fork/join costs more than it saves on
// a memory-bound loop.
constexpr int64_t kGrainSize = 32768;

// "Float[2, 3] cpu strides=[1, 2]": enough to tell which argument of a list is wrong and why.
inline std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << t.scalar_type() << t.sizes() << " on " << t.device();
  if (!t.is_contiguous()) s << " strides=" << t.strides();
  return s.str();
}

inline bool is_supported_dtype(at::ScalarType st) {
  return st == at::kFloat || st == at::kDouble || st == at::kHalf || st == at::kBFloat16;
}

inline void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is an undefined tensor");
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), op, ": ", name,
              " must be float32, float64, float16 or bfloat16, got ", describe(t));
}

// Every tensor of a call must match the first one: mixed dtypes would need a cast per element and
// mixed devices cannot be reached by one kernel. The message names the offending index. The
// names are built only for a message: a model's 400 tensors are checked on every call.
inline bool same_kind(const at::Tensor& t, const at::Tensor& ref) {
  return t.defined() && t.scalar_type() == ref.scalar_type() && t.device() == ref.device();
}

inline void check_same(const char* op, const char* name, const at::Tensor& t, const char* ref_name,
                       const at::Tensor& ref) {
  check_dtype(op, name, t);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type() && t.device() == ref.device(), op,
              ": all tensors must share dtype and device; ", ref_name, " is ", describe(ref),
              " but ", name, " is ", describe(t));
}

inline std::string indexed(const char* list_name, size_t i) {
  return std::string(list_name) + "[" + std::to_string(i) + "]";
}

inline void check_list(const char* op, const char* list_name, at::TensorList tensors) {
  if (tensors.empty()) return;
  check_dtype(op, indexed(list_name, 0).c_str(), tensors[0]);
  for (size_t i = 1; i < tensors.size(); ++i) {
    if (same_kind(tensors[i], tensors[0])) continue;
    check_same(op, indexed(list_name, i).c_str(), tensors[i], indexed(list_name, 0).c_str(),
               tensors[0]);
  }
}

inline int64_t total_numel(at::TensorList tensors) {
  int64_t n = 0;
  for (const auto& t : tensors) n += t.numel();
  return n;
}

inline void check_scale(at::TensorList tensors) { check_list("hetlb::scale_", "tensors", tensors); }

inline void check_flatten_scaled(at::TensorList tensors, const std::optional<at::Tensor>& extra) {
  const char* op = "hetlb::flatten_scaled";
  check_list(op, "tensors", tensors);
  if (extra.has_value() && extra->defined()) {
    TORCH_CHECK(extra->dim() == 1, op, ": extra must be 1-D, got ", describe(*extra));
    // extra is cast to the output dtype, so only its device has to agree.
    if (!tensors.empty())
      TORCH_CHECK(extra->device() == tensors[0].device(), op,
                  ": extra must be on the device of tensors[0] (", tensors[0].device(),
                  "), got ", describe(*extra));
  }
}

inline void check_unflatten(const at::Tensor& flat, at::TensorList tensors) {
  const char* op = "hetlb::unflatten_";
  check_dtype(op, "flat", flat);
  TORCH_CHECK(flat.dim() == 1, op, ": flat must be 1-D, got ", describe(flat));
  for (size_t i = 0; i < tensors.size(); ++i)
    if (!same_kind(tensors[i], flat))
      check_same(op, indexed("tensors", i).c_str(), tensors[i], "flat", flat);
  const int64_t need = total_numel(tensors);
  TORCH_CHECK(flat.numel() >= need, op, ": flat has ", flat.numel(),
              " elements but the tensors need ", need, " (", tensors.size(), " tensors)");
}

inline void check_delay_compensate(at::TensorList grads, at::TensorList params,
                                   at::TensorList prevs) {
  const char* op = "hetlb::delay_compensate_";
  TORCH_CHECK(params.size() == grads.size() && prevs.size() == grads.size(), op,
              ": grads, params and prev_params must have the same length, got ", grads.size(),
              ", ", params.size(), " and ", prevs.size());
  check_list(op, "grads", grads);
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor &g = grads[i], &p = params[i], &q = prevs[i];
    if (same_kind(p, g) && same_kind(q, g) && p.sizes() == g.sizes() && q.sizes() == g.sizes())
      continue;
    const std::string gn = indexed("grads", i), pn = indexed("params", i),
                      qn = indexed("prev_params", i);
    check_same(op, pn.c_str(), p, gn.c_str(), g);
    check_same(op, qn.c_str(), q, gn.c_str(), g);
    TORCH_CHECK(false, op, ": ", gn, ", ", pn, " and ", qn, " must have the same shape, got ", gn,
                " ", describe(g), ", ", pn, " ", describe(p), ", ", qn, " ", describe(q));
  }
}

// The output of flatten_scaled for an empty list: the (unscaled) extra alone, or an empty float32
// tensor when there is nothing at all. A copy, never extra itself: the schema returns a fresh tensor.
inline at::Tensor flatten_scaled_empty(const std::optional<at::Tensor>& extra) {
  if (extra.has_value() && extra->defined()) return extra->clone(at::MemoryFormat::Contiguous);
  return at::empty({0}, at::TensorOptions().dtype(at::kFloat));
}

// One "dst = src * w" span of a multi-tensor op; dst == src for in-place scaling.
struct Segment {
  void* dst;
  const void* src;
  int64_t numel;
};

// The device-specific part of scale_, flatten_scaled and unflatten_: run every segment.
using RunSegments = void (*)(at::ScalarType, const std::vector<Segment>&, double);

// The three multi-tensor ops differ per device only in how segments run, so their argument checks,
// layout and non-contiguous handling live here once. Non-contiguous tensors go through a
// contiguous copy (written back after the run, on the same stream for CUDA): gradients and
// parameters are contiguous in practice, and the kernels stay free of stride arithmetic.
inline void scale_with(at::TensorList tensors, double weight, RunSegments run) {
  check_scale(tensors);
  if (tensors.empty()) return;
  std::vector<Segment> segs;
  segs.reserve(tensors.size());
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
  run(tensors[0].scalar_type(), segs, weight);
  for (auto& [t, c] : write_back) t.copy_(c);
}

inline at::Tensor flatten_scaled_with(at::TensorList tensors, double weight,
                                      const std::optional<at::Tensor>& extra, RunSegments run) {
  check_flatten_scaled(tensors, extra);
  if (tensors.empty()) return flatten_scaled_empty(extra);
  const bool has_extra = extra.has_value() && extra->defined();
  const int64_t body = total_numel(tensors);
  at::Tensor out = at::empty({body + (has_extra ? extra->numel() : 0)}, tensors[0].options());
  std::vector<Segment> segs;
  std::vector<at::Tensor> keep;  // contiguous copies must outlive the run
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
  run(out.scalar_type(), segs, weight);
  // extra (telemetry: sizes, times) is short and unscaled: copy_ handles the cast.
  if (has_extra && extra->numel() > 0) out.narrow(0, body, extra->numel()).copy_(*extra);
  return out;
}

inline void unflatten_with(const at::Tensor& flat, at::TensorList tensors, double scale,
                           RunSegments run) {
  check_unflatten(flat, tensors);
  if (tensors.empty()) return;
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
        c = at::empty(t.sizes(), t.options());  // every element is overwritten: no copy in
        write_back.emplace_back(t, c);
      }
      segs.push_back({c.data_ptr(), base + off * elem, t.numel()});
    }
    off += t.numel();
  }
  run(flat.scalar_type(), segs, scale);
  for (auto& [t, c] : write_back) t.copy_(c);
}

// One "g += lam * g * g * (p - q)" span of delay_compensate_.
struct Triple {
  void* g;
  const void* p;
  const void* q;
  int64_t numel;
};

// The device-specific part of delay_compensate_: run every triple.
using RunTriples = void (*)(at::ScalarType, const std::vector<Triple>&, double);

// Checks, empty tensors and non-contiguous staging once for both devices, as scale_with does.
inline void delay_compensate_with(at::TensorList grads, at::TensorList params,
                                  at::TensorList prevs, double lam, RunTriples run) {
  check_delay_compensate(grads, params, prevs);
  std::vector<Triple> triples;
  triples.reserve(grads.size());
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back;
  std::vector<at::Tensor> keep;  // contiguous copies of the inputs must outlive the run
  for (size_t i = 0; i < grads.size(); ++i) {
    if (grads[i].numel() == 0) continue;
    at::Tensor g = grads[i];
    if (!g.is_contiguous()) {
      g = g.contiguous();
      write_back.emplace_back(grads[i], g);
    }
    const void* in[2];
    for (int j = 0; j < 2; ++j) {
      const at::Tensor& t = j == 0 ? params[i] : prevs[i];
      if (t.is_contiguous()) {
        in[j] = t.const_data_ptr();
      } else {
        keep.push_back(t.contiguous());
        in[j] = keep.back().const_data_ptr();
      }
    }
    triples.push_back({g.data_ptr(), in[0], in[1], g.numel()});
  }
  if (triples.empty()) return;
  run(grads[0].scalar_type(), triples, lam);
  for (auto& [t, c] : write_back) t.copy_(c);
}

}  // namespace
}  // namespace hetlb::kernels
