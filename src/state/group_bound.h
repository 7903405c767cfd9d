// State tied to the membership of its process group: what ddp::ft::Manager re-forms in process
// (Note [Per-step fault tolerance] in ddp/fault_tolerance.h). The library's adapters of
// DistributedDataParallel and DistributedSampler implement it beside Stateful; a user's own
// Stateful does not need to (the manager heals it as a whole when it must).
#pragma once

#include <memory>
#include <vector>

namespace ddp {

class ProcessGroup;
class TrainingState;

namespace state {

class GroupBound {
 public:
  virtual ~GroupBound() = default;
  // A step committed on every replica: the point that a dropped step returns to.
  virtual void committed() = 0;
  // The replicas re-formed into `group`, on every member, before any healing: back to the last
  // committed point, then onto the new group (this replica is its rank of its size).
  virtual void regroup(const std::shared_ptr<ProcessGroup>& group) = 0;
};

// The objects registered in `state` that are GroupBound, in registration order.
std::vector<GroupBound*> group_bound(TrainingState& state);

}  // namespace state
}  // namespace ddp
