// Where a step's telemetry table arrives: written by an all-reduce's continuation (on a Gloo
// thread) or by the Python reference hook, taken once by the step core after backward. Separate
// from the step core so that a continuation holds nothing else.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mutex>
#include <optional>

namespace hetlb {

class TableSlot {
 public:
  // What take() found: the delivered table, or a pending side all-reduce and its buffer (whose
  // result is the table once the work is done), or neither.
  struct Taken {
    std::optional<at::Tensor> table;
    c10::intrusive_ptr<c10d::Work> side_work;
    at::Tensor side_buffer;
  };

  // Forgets whatever the previous step left.
  void clear();

  // The carry transport: the table itself, arrived with the gradient.
  void deliver(at::Tensor table);

  // The side transport: the all-reduce whose buffer becomes the table.
  void adopt_side(c10::intrusive_ptr<c10d::Work> work, at::Tensor buffer);

  // Issues the side transport's SUM all-reduce of `buffer` (this rank's slots) on `group` and
  // adopts it. A caller on a thread that may hold Python objects clears them first
  // (hook/no_python.h).
  void issue_side(c10d::ProcessGroup& group, at::Tensor buffer);

  // Empties the slot and returns what it held (the side all-reduce before a table).
  Taken take();

 private:
  std::mutex mu_;
  at::Tensor table_;
  c10::intrusive_ptr<c10d::Work> side_work_;
  at::Tensor side_buffer_;
};

}  // namespace hetlb
