// The deferred hook (hetlb.aggregate.BackwardWatch): the end of a backward of a DDP model that
// runs without a communication hook.
//
// A hook on the model's output (it runs as the backward starts) checks that a step is open and
// queues an autograd final callback, which runs when the backward's compute is done and before
// DDP's own (queued when its last bucket is ready) waits for the all-reduces: it ends the step's
// compute and queues a second callback, which runs after DDP's and issues the side all-reduce of
// the table (the gradient is reduced by then: nothing to compete with). All of it native and on
// the backward's thread, without the GIL. A pass for given inputs (torch.autograd.grad,
// backward(inputs=)) is not the step's backward: DDP reduces nothing in it, and it is skipped.
// Deferral is for CPU models only, whose hooks and callbacks all run on the thread that called
// backward.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>

#include "hook/step_core.h"

namespace hetlb {

// Watches the backward through `out`, a forward output of the model; `side` is the group of the
// table's all-reduce, held weakly.
void watch_output(const std::shared_ptr<StepCore>& core, const at::Tensor& out,
                  const c10::weak_intrusive_ptr<c10d::ProcessGroup>& side);

}  // namespace hetlb
