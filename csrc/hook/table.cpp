#include "hook/table.h"

#include <utility>
#include <vector>

namespace hetlb {

void TableSlot::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  table_ = at::Tensor();
  side_work_.reset();
  side_buffer_ = at::Tensor();
}

void TableSlot::deliver(at::Tensor table) {
  std::lock_guard<std::mutex> lock(mu_);
  table_ = std::move(table);
}

void TableSlot::adopt_side(c10::intrusive_ptr<c10d::Work> work, at::Tensor buffer) {
  std::lock_guard<std::mutex> lock(mu_);
  side_work_ = std::move(work);
  side_buffer_ = std::move(buffer);
}

void TableSlot::issue_side(c10d::ProcessGroup& group, at::Tensor buffer) {
  std::vector<at::Tensor> tensors{buffer};
  adopt_side(group.allreduce(tensors), std::move(buffer));
}

TableSlot::Taken TableSlot::take() {
  std::lock_guard<std::mutex> lock(mu_);
  Taken out;
  if (side_work_) {
    out.side_work = std::move(side_work_);
    out.side_buffer = std::move(side_buffer_);
    side_work_.reset();
    side_buffer_ = at::Tensor();
  } else if (table_.defined()) {
    out.table = std::move(table_);
    table_ = at::Tensor();
  }
  return out;
}

}  // namespace hetlb
