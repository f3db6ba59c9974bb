// pybind11 bindings of the host algorithms (csrc/solve): NumPy in, NumPy out, the GIL released
// while a solver runs.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings.h"
#include "solve/solve.h"

namespace py = pybind11;
using f64_array = py::array_t<double, py::array::c_style | py::array::forcecast>;
using i64_array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

namespace {

py::array_t<int64_t> to_numpy(const std::vector<int64_t>& v) {
  py::array_t<int64_t> out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

std::vector<int64_t> to_vec(const i64_array& a) { return {a.data(), a.data() + a.size()}; }

void require_1d(const py::array& a, const char* name) {
  if (a.ndim() != 1) {
    std::ostringstream msg;
    msg << name << " must be 1-D, got " << a.ndim() << " dimensions";
    throw std::invalid_argument(msg.str());
  }
}

void require_same_length(const py::array& a, const py::array& b, const char* what) {
  if (a.size() != b.size())
    throw std::invalid_argument(std::string(what) + " differ in length: " + std::to_string(a.size()) +
                                " vs " + std::to_string(b.size()));
}

// Models arrive packed: kinds[n], params (flat) with offsets[n+1], cands (flat) with cand_offsets[n+1].
std::vector<hetlb::ModelSpec> unpack_models(const i64_array& kinds, const f64_array& params,
                                            const i64_array& offsets, const i64_array& cands,
                                            const i64_array& cand_offsets) {
  const int64_t n = kinds.size();
  if (offsets.size() != n + 1 || cand_offsets.size() != n + 1)
    throw std::invalid_argument("packed models: offsets must have n+1 entries");
  std::vector<hetlb::ModelSpec> out(n);
  const int64_t* off = offsets.data();
  const int64_t* coff = cand_offsets.data();
  for (int64_t i = 0; i < n; ++i) {
    if (off[i] < 0 || off[i + 1] < off[i] || off[i + 1] > params.size() || coff[i] < 0 ||
        coff[i + 1] < coff[i] || coff[i + 1] > cands.size())
      throw std::invalid_argument("packed models: offsets out of range");
    out[i] = {static_cast<int>(kinds.data()[i]), params.data() + off[i], off[i + 1] - off[i],
              cands.data() + coff[i], coff[i + 1] - coff[i]};
  }
  return out;
}

}  // namespace

namespace hetlb {

void bind_solve(py::module& m) {
  // The solvers report bad arguments as std::invalid_argument: Python sees ValueError.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::invalid_argument& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def(
      "allocate",
      [](const i64_array& kinds, const f64_array& params, const i64_array& offsets,
         const i64_array& cands, const i64_array& cand_offsets, int64_t total, const i64_array& lower,
         const i64_array& upper) {
        auto models = unpack_models(kinds, params, offsets, cands, cand_offsets);
        std::vector<int64_t> lo = to_vec(lower), hi = to_vec(upper), out;
        {
          py::gil_scoped_release nogil;
          out = hetlb::allocate(models, total, lo, hi);
        }
        return to_numpy(out);
      },
      py::arg("kinds"), py::arg("params"), py::arg("offsets"), py::arg("cands"),
      py::arg("cand_offsets"), py::arg("total"), py::arg("lower"), py::arg("upper"),
      "Exact integer min-max allocation over packed time models (use hetlb.allocate).");

  m.def(
      "effective_time",
      [](int64_t kind, const f64_array& params, const i64_array& cands, const i64_array& b) {
        hetlb::ModelSpec spec{static_cast<int>(kind), params.data(), params.size(), cands.data(),
                              cands.size()};
        auto t = hetlb::effective_time(spec, to_vec(b));
        py::array_t<double> out(static_cast<py::ssize_t>(t.size()));
        std::copy(t.begin(), t.end(), out.mutable_data());
        return out;
      },
      py::arg("kind"), py::arg("params"), py::arg("cands"), py::arg("b"),
      "Running maximum of one packed model at integer batch sizes, as the solvers see it.");

  m.def(
      "allocate_proportional",
      [](const f64_array& speeds, int64_t total, const i64_array& lower, const i64_array& upper) {
        require_1d(speeds, "speeds");
        std::vector<double> v(speeds.data(), speeds.data() + speeds.size());
        std::vector<int64_t> lo = to_vec(lower), hi = to_vec(upper), out;
        {
          py::gil_scoped_release nogil;
          out = hetlb::allocate_proportional(v, total, lo, hi);
        }
        return to_numpy(out);
      },
      py::arg("speeds"), py::arg("total"), py::arg("lower"), py::arg("upper"),
      "Shares proportional to speed with largest-remainder rounding inside bounds.");

  m.def(
      "schedule",
      [](const f64_array& sizes, const f64_array& slope, const f64_array& intercept, bool simd,
         int64_t first, std::optional<f64_array> cap, bool grouped) {
        require_1d(sizes, "sizes");
        require_1d(slope, "slope");
        require_1d(intercept, "intercept");
        require_same_length(slope, intercept, "slope and intercept");
        if (cap) {
          require_1d(*cap, "cap");
          require_same_length(slope, *cap, "slope and cap");
        }
        const double* capp = cap ? cap->data() : nullptr;
        std::vector<int64_t> out;
        {
          py::gil_scoped_release nogil;
          out = hetlb::schedule(sizes.data(), sizes.size(), slope.data(), intercept.data(),
                                slope.size(), simd, first, capp, grouped);
        }
        return to_numpy(out);
      },
      py::arg("sizes"), py::arg("slope"), py::arg("intercept"), py::arg("simd") = true,
      py::arg("first") = -1, py::arg("cap") = py::none(), py::arg("grouped") = true,
      "Rank of each sample of one step (CHRONICA data scheduler); grouped=False scans every rank "
      "for every sample and simd=False forces the scalar scan (all bit-identical).");
  m.def("schedule_simd_available", &hetlb::schedule_simd_available,
        "Whether schedule's AVX2 scan runs on this CPU.");

  m.def(
      "rebalance",
      [](const i64_array& owner, const f64_array& sizes, const f64_array& slope,
         const f64_array& intercept, double tolerance) {
        require_1d(owner, "owner");
        require_1d(sizes, "sizes");
        require_1d(slope, "slope");
        require_1d(intercept, "intercept");
        require_same_length(owner, sizes, "owner and sizes");
        require_same_length(slope, intercept, "slope and intercept");
        std::vector<int64_t> out;
        {
          py::gil_scoped_release nogil;
          out = hetlb::rebalance(owner.data(), sizes.data(), sizes.size(), slope.data(),
                                 intercept.data(), slope.size(), tolerance);
        }
        return to_numpy(out);
      },
      py::arg("owner"), py::arg("sizes"), py::arg("slope"), py::arg("intercept"),
      py::arg("tolerance") = -1.0,
      "New owner of each sample of a sharded dataset (CHRONICA data shuffler); owner -1: held by "
      "no rank; tolerance < 0: the largest sample on the slowest rank.");
}

}  // namespace hetlb
