// The weighted all-reduce communication hook of a DDP model.
//
// Per bucket the hook multiplies the gradient by this rank's weight (hetlb::scale_, or NCCL's
// PREMUL_SUM) and SUM all-reduces it. DDP copies gradients into buckets without averaging once a
// hook is registered, so this pass is what every communication hook pays; NCCL's PREMUL_SUM
// fuses it into the reduction; Balancer.backward skips it by scaling the loss instead, which
// sets the core's `prescaled`. When the last bucket is ready the hook ends the step's compute
// (StepCore::end_compute) and ships the table with one of two transports, agreed by all ranks at
// start-up:
//   carry: the row rides in a zeroed [world, fields] region appended to the last bucket in a
//          persistent buffer (the scaled gradient is written into it in the pass that would
//          otherwise scale the bucket; DDP copies the result out of it), so the gradient's own
//          all-reduce delivers the table;
//   side:  a separate small float64 all-reduce on a Gloo side group. Under Gloo it is issued
//          when the last bucket's all-reduce has finished (from that bucket's continuation): a
//          Gloo thread issuing it beside the gradient's transfer competes with that transfer for
//          the core (bench/RESULTS.md, "Homogeneous overhead"). Under NCCL (the gradient on the
//          device, nothing to compete with), when the side group is the gradient group, or with
//          the core's `side_first` (for bench/bench_overhead.py's comparison) it is issued just
//          before the last bucket's. The step's end waits for it, normally long done.
// With a block of k steps (Balancer(exchange_every=k)) only the block's last step ships: its
// table holds the rows of every step of the block (carry's slot region or the side buffer grows
// to k tables); the other steps send nothing but the gradient.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <memory>

#include "hook/step_core.h"

namespace hetlb {

// Runs one gradient bucket through the hook: the one path of every bucket, from DDP
// (WeightedHook) and from StepCore.reduce. `last`: the balanced model's last bucket of the
// backward, which ends the step's compute and ships the table. `side`: the side transport's
// group (the gradient group itself under Gloo without one). Returns the reduced bucket's future.
c10::intrusive_ptr<c10::ivalue::Future> reduce_bucket(
    StepCore& core, at::Tensor buf, bool last, const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
    const c10::intrusive_ptr<c10d::ProcessGroup>& side);

// Registers the weighted hook on a DDP model's reducer (once per model). `attached`: the hook of
// another DDP model trained on the same batches (Balancer.attach): the same weight, but its last
// bucket neither ends the step's compute nor sends the table, which the balanced model's hook
// does once per step.
void register_weighted_hook(c10d::Reducer& reducer, std::shared_ptr<StepCore> core,
                            c10::intrusive_ptr<c10d::ProcessGroup> pg,
                            c10::intrusive_ptr<c10d::ProcessGroup> side, bool attached);

}  // namespace hetlb
