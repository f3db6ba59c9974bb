#include "hook/deferred_hook.h"

#include <c10/util/Exception.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "hook/no_python.h"

namespace hetlb {

void watch_output(const std::shared_ptr<StepCore>& core, const at::Tensor& out,
                  const c10::weak_intrusive_ptr<c10d::ProcessGroup>& side) {
  TORCH_CHECK(out.requires_grad(), "hetlb step watch(): the tensor does not require grad");
  core->unqueue_end();
  out.register_hook([core, side](const at::Tensor&) {
    const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
    if (exec_info != nullptr && !exec_info->empty()) return;
    if (core->quiet()) return;  // a micro-step before the step's last: the step goes on
    core->require_open();
    if (!core->queue_end()) return;
    torch::autograd::Engine::get_default_engine().queue_callback([core, side]() {
      core->unqueue_end();
      core->end_compute(true);
      torch::autograd::Engine::get_default_engine().queue_callback([core, side]() {
        core->mark_reduced();  // (after DDP's own end of backward, which waits for its buckets)
        if (!core->ship()) return;
        if (auto group = side.lock()) {
          NoPythonState no_python;
          core->issue_side(*group);
        }
      });
    });
  });
}

}  // namespace hetlb
