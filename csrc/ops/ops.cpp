// The torch.ops.hetlb tensor ops: schemas here, kernels per dispatch key in csrc/ops/cpu and
// csrc/ops/cuda (TORCH_LIBRARY_IMPL), fake implementations in hetlb/ops.py (torch.compile).
// Weights are host floats: batch sizes are decided on the host, so no device sync is needed.
#include <torch/library.h>

TORCH_LIBRARY(hetlb, m) {
  m.def("scale_(Tensor(a!)[] tensors, float weight) -> ()");
  m.def("flatten_scaled(Tensor[] tensors, float weight, Tensor? extra=None) -> Tensor");
  m.def("unflatten_(Tensor flat, Tensor(a!)[] tensors, float scale) -> ()");
  m.def("delay_compensate_(Tensor(a!)[] grads, Tensor[] params, Tensor[] prev_params, float lam) -> ()");
}
