#include "hook/weighted_hook.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <utility>
#include <vector>

#include "hook/no_python.h"

namespace hetlb {
namespace {

using FuturePtr = c10::intrusive_ptr<c10::ivalue::Future>;

// hetlb::scale_ (csrc/ops/cpu, csrc/ops/cuda) through the dispatcher like any op, so this hook and
// the Python reference run exactly the same arithmetic.
bool has_hetlb_kernel(const at::Tensor& t) {
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("hetlb::scale_", "");
  return handle.hasKernelForDispatchKey(c10::computeDispatchKey(std::nullopt, t.layout(), t.device()));
}

void scale_(const at::Tensor& buf, double w) {
  if (!has_hetlb_kernel(buf)) {  // e.g. CUDA tensors with an extension built without CUDA
    buf.mul_(w);
    return;
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("hetlb::scale_", "")
                       .typed<void(at::TensorList, double)>();
  op.call(at::TensorList(buf), w);
}

// NCCL: the weight rides in the reduction (PREMUL_SUM).
FuturePtr allreduce_nccl(StepCore& core, at::Tensor& buf, double w, bool weigh,
                         c10d::ProcessGroup& pg) {
  c10d::AllreduceOptions opts;
  if (weigh) {
    if (buf.scalar_type() == at::kBFloat16) {
      // c10d reads a bfloat16 PREMUL_SUM factor through a float (a tensor factor is refused, a
      // host one arrives as zero): scale the bucket here and sum, one pass on the device.
      buf.mul_(w);
    } else {
      // Built by hand: torch < 2.12 names the helper makeNCCLPreMulSum, later ones
      // makePreMulSum; the supplement's old name is an alias in both.
      c10d::ReduceOp op;
      op.op_ = c10d::ReduceOp::PREMUL_SUM;
      op.supplement_ = c10::make_intrusive<c10d::NCCLPreMulSumSupplement>(core.premul_factor(buf));
      opts.reduceOp = std::move(op);
    }
    core.count_scaled();
  }
  std::vector<at::Tensor> tensors{buf};
  return pg.allreduce(tensors, opts)->getFuture();
}

// Carry: the bucket and this rank's slots in one persistent buffer, one all-reduce.
FuturePtr allreduce_carry(StepCore& core, const at::Tensor& buf, double w, bool weigh,
                          c10d::ProcessGroup& pg) {
  TORCH_CHECK(buf.device().is_cpu() &&
                  (buf.scalar_type() == at::kFloat || buf.scalar_type() == at::kDouble),
              "hetlb comm hook: the carry transport needs CPU float32/float64 buckets, got ",
              buf.scalar_type(), " on ", buf.device(),
              " (was the model changed after the Balancer was made?)");
  const int64_t n = buf.numel(), rows = core.table_rows(), fields = core.fields();
  const int64_t nslots = rows * fields;
  // A fresh buffer each step would cost page faults. The scaled gradient is written into it in
  // one pass (which replaces the scaling pass), and the hook returns a view of it, so DDP's own
  // copy out of the result is the only one. It holds a whole block's slots, so a shorter block
  // (an epoch's end, the first step) sends a prefix of it.
  at::Tensor flat = core.carry_region(buf, nslots);
  at::Tensor head = flat.narrow(0, 0, n);
  if (weigh) {
    at::mul_out(head, buf, at::scalar_tensor(w, at::kDouble));
    core.count_scaled();
  } else {
    head.copy_(buf);  // (a weight-0 bucket is zero already)
  }
  flat.narrow(0, n, nslots).copy_(core.slots());
  std::vector<at::Tensor> packed{flat};
  FuturePtr fut = pg.allreduce(packed)->getFuture();
  std::shared_ptr<TableSlot> slot = core.slot();
  return fut->then(
      [slot, flat, n, nslots, rows, fields](c10::ivalue::Future& done) -> c10::IValue {
        // A failed all-reduce (a peer died) must fail the bucket: reading the buffer instead
        // would hand DDP this rank's own unreduced gradient as the sum.
        done.value();
        slot->deliver(flat.narrow(0, n, nslots).to(at::kDouble).view({rows, fields}).clone());
        return c10::IValue(flat.narrow(0, 0, n));
      },
      c10::TensorType::get());
}

// Gloo without carry: scale (hetlb::scale_) and SUM.
FuturePtr allreduce_scaled(StepCore& core, const at::Tensor& buf, double w, bool weigh,
                           c10d::ProcessGroup& pg) {
  if (weigh) {
    scale_(buf, w);
    core.count_scaled();
  }
  std::vector<at::Tensor> tensors{buf};
  return pg.allreduce(tensors)->getFuture();
}

// The side all-reduce issued once `fut` (the last bucket's all-reduce) has finished, from its
// continuation on the Gloo thread; the slots are taken now. A failed bucket issues nothing (DDP
// raises, the step is dropped). The group is held weakly: whoever owns it decides its life.
FuturePtr side_after(const StepCore& core, FuturePtr fut,
                     const c10::intrusive_ptr<c10d::ProcessGroup>& side) {
  at::Tensor buffer = core.slots();
  std::shared_ptr<TableSlot> slot = core.slot();
  c10::weak_intrusive_ptr<c10d::ProcessGroup> weak(side);
  return fut->then(
      [slot, buffer, weak](c10::ivalue::Future& done) -> c10::IValue {
        c10::IValue value = done.value();
        if (auto group = weak.lock()) slot->issue_side(*group, buffer);
        return value;
      },
      fut->elementType());
}

// The hook DDP calls per bucket.
class WeightedHook : public c10d::CommHookInterface {
 public:
  WeightedHook(std::shared_ptr<StepCore> core, c10::intrusive_ptr<c10d::ProcessGroup> pg,
               c10::intrusive_ptr<c10d::ProcessGroup> side, bool attached)
      : core_(std::move(core)), pg_(std::move(pg)), side_(std::move(side)), attached_(attached) {}

  FuturePtr runHook(c10d::GradBucket& bucket) override {
    const bool last = bucket.isLast() && !attached_;
    FuturePtr fut = reduce_bucket(*core_, bucket.getBufferRef(), last, pg_, side_);
    if (last) {
      // (runs on the thread that completes the all-reduce; an atomic store only)
      fut->addCallback([core = core_](c10::ivalue::Future&) { core->mark_reduced(); });
    }
    return fut;
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    return c10d::detail::parseCppCommHookResult(result);
  }

 private:
  std::shared_ptr<StepCore> core_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_, side_;
  const bool attached_;
};

}  // namespace

FuturePtr reduce_bucket(StepCore& core, at::Tensor buf, bool last,
                        const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                        const c10::intrusive_ptr<c10d::ProcessGroup>& side) {
  core.require_open();
  TORCH_CHECK(!buf.is_sparse(), "hetlb comm hook: got a sparse gradient bucket (layout ",
              buf.layout(), "); the Balancer weighs dense gradients only: build the model's "
              "embeddings with sparse=False");
  TORCH_CHECK(buf.is_contiguous(), "hetlb comm hook: bucket buffer is not contiguous (sizes ",
              buf.sizes(), ", strides ", buf.strides(), ")");
  NoPythonState no_python;
  const double w = core.enter_bucket();
  // A bucket needs the weight applied here unless it is 0 (zeroed below), 1, or already in it.
  const bool weigh = !core.prescaled() && w != 0.0 && w != 1.0;
  const int64_t nbytes = buf.numel() * buf.element_size();
  // A rank without samples may hold NaN gradients (the mean over an empty batch), and
  // 0 * NaN = NaN would poison every rank: zero the bucket on every path.
  if (w == 0.0) buf.zero_();
  if (last) core.end_compute(true);
  const bool send = last && core.ship();  // only a block's shipping step sends the table
  const bool side_transport = send && !core.carry();
  // Issued from a continuation, a collective on the gradient group itself could be ordered
  // differently on two ranks against DDP's own (find_unused_parameters' all-reduce): there (and
  // under NCCL, or when asked) the table goes first.
  const bool table_first = core.side_first() || core.nccl() || side.get() == pg.get();
  if (side_transport && table_first) core.issue_side(*side);
  FuturePtr fut;
  if (core.nccl()) {
    fut = allreduce_nccl(core, buf, w, weigh, *pg);
  } else if (send && core.carry()) {
    fut = allreduce_carry(core, buf, w, weigh, *pg);
  } else {
    fut = allreduce_scaled(core, buf, w, weigh, *pg);
    if (side_transport && !table_first) fut = side_after(core, std::move(fut), side);
  }
  const Emulation* emulation = core.emulation_if_any();
  return emulation != nullptr ? emulation->delay(std::move(fut), nbytes) : fut;
}

void register_weighted_hook(c10d::Reducer& reducer, std::shared_ptr<StepCore> core,
                            c10::intrusive_ptr<c10d::ProcessGroup> pg,
                            c10::intrusive_ptr<c10d::ProcessGroup> side, bool attached) {
  TORCH_CHECK(core && pg && side, "hetlb register_comm_hook: need a core, a process group and a "
              "side group (the gradient group itself under Gloo), got None");
  TORCH_CHECK(core->world() == pg->getSize() && core->rank() == pg->getRank(),
              "hetlb register_comm_hook: StepCore has rank ", core->rank(), " of ", core->world(),
              " but the process group has rank ", pg->getRank(), " of ", pg->getSize());
  TORCH_CHECK(side->getSize() == pg->getSize(), "hetlb register_comm_hook: the side group has ",
              side->getSize(), " ranks, the gradient group ", pg->getSize());
  reducer.register_comm_hook(
      std::make_unique<WeightedHook>(std::move(core), std::move(pg), std::move(side), attached));
}

}  // namespace hetlb
