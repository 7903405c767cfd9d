// Fixed and elastic membership (see Note [Membership policy] in membership_policy.h).
#include "membership_policy.h"

#include <fmt/format.h>

namespace ddp::launcher {

MembershipPolicy MembershipPolicy::of(const LaunchConfig& config) {
  const bool etcd = config.rdzv_backend == RdzvBackend::kEtcd;
  if (!config.elastic) {
    return MembershipPolicy{.min_nodes = config.nnodes,
                            .max_nodes = config.nnodes,
                            .node_rank = config.node_rank,
                            .arrivals = Arrivals::kEndTheRound,
                            .store_host = etcd ? StoreHost::kEtcd : StoreHost::kNodeZero,
                            .store_moves = false,
                            .majority = false,
                            .restarts = Restarts::kRounds};
  }
  return MembershipPolicy{.min_nodes = config.min_nodes,
                          .max_nodes = config.nnodes,
                          .node_rank = std::nullopt,
                          .arrivals = Arrivals::kWaitToBeAdmitted,
                          .store_host = etcd ? StoreHost::kEtcd : StoreHost::kEndpointHost,
                          .store_moves = !etcd,
                          .majority = !etcd,
                          .restarts = Restarts::kFailures};
}

std::string MembershipPolicy::nnodes() const {
  if (fixed_ranks()) return std::to_string(max_nodes);
  return fmt::format("{}:{}", min_nodes, max_nodes);
}

const char* MembershipPolicy::round_name() const {
  return fixed_ranks() ? "restart round" : "elastic round";
}

std::string MembershipPolicy::where(const std::string& host, int pid) const {
  if (node_rank) return fmt::format("node {} ({})", *node_rank, host);
  return fmt::format("node {} (ddprun pid {})", host, pid);
}

}  // namespace ddp::launcher
