// A collective of a shared-memory group, waited for: the shm and hierarchy transports'.
#pragma once

#include <memory>

#include "process_group/shm/group.h"
#include "process_group/transport/transport.h"

namespace ddp {

class ShmPending final : public Pending {
 public:
  ShmPending(std::shared_ptr<shm::Group> group, std::shared_ptr<shm::Op> op)
      : group_(std::move(group)), op_(std::move(op)) {}
  void wait(const detail::WorkState& s) override;
  bool is_completed() const override;

 private:
  const std::shared_ptr<shm::Group> group_;
  const std::shared_ptr<shm::Op> op_;
};

}  // namespace ddp
