// Who may be in a job's rounds, and how they get there: the fixed and the elastic membership of
// the one round protocol (Note [Restart rounds] in rounds.h).
//
// Note [Membership policy]
// A fixed job (--nnodes N with --node-rank K) is an elastic job whose rounds need MIN = MAX = N
// nodes and whose node ranks are given. Every other difference between the two is one field of
// MembershipPolicy, read where the protocol takes that decision:
//   node_rank    how node ranks are given. Fixed: --node-rank K, the same in every round; a
//                node claims its rank in each round it enters ("<R>/node/<K>") and its id is its
//                rank. Elastic: given out at each round, by the order of the round's entries
//                (Note [Elastic rounds] in elastic.h); its id is "<host>:<pid>:<random>".
//   arrivals     what a ddprun that arrives while a round runs is. Fixed: that node's ddprun
//                started again (its rank is claimed twice): its workers of the round are gone,
//                so it ends the round (or, when the other ddprun of its rank is alive, refuses to
//                run) and every node meets it in the next; with --ft it takes its earlier
//                ddprun's place in the round instead, and only its own workers start again (the
//                others' replicas heal them: Note [Per-step fault tolerance] in
//                ddp/fault_tolerance.h); a node that finished a round then
//                keeps every node from restarting (the job cannot go on without it). Elastic: a
//                new node, which waits to be admitted when the job next re-forms (at once below
//                MAX); a round closes only once the round before is over, and a job that
//                finishes meanwhile ends the wait (JobEnded), a success.
//   store_host   who hosts the job's store. Fixed: node 0's ddprun, for the whole run (its host
//                dying takes the store; node 0's ddprun started again hosts a fresh one, which
//                the other nodes, retrying until the join timeout, find). Elastic: the first
//                ddprun on the rendezvous endpoint's host.
//   store_moves  whether the store can move. Fixed: no. Elastic: every other node keeps a
//                standby store, and the nodes move to one when the store stops answering (Note
//                [Moving the store] in elastic.cpp). On etcd (either kind) nobody hosts the
//                rounds' store and nothing moves (Note [etcd backend] in etcd.h).
//   majority     whether a round needs a majority of the last round's nodes: only where the
//                store moves, so that two copies of it never both form rounds (Note [Never
//                two groups] in quorum.h).
//   restarts     what --max-restarts counts. Fixed: rounds (every round after the first is a
//                restart: TORCHELASTIC_RESTART_COUNT). Elastic: failures ("failures"), as
//                torchrun does: nodes leaving or arriving re-form the job without a restart.
// The texts that name these (the round, this node, --nnodes) differ with them, and the tests and
// the users' scripts read them: they are here too.
#pragma once

#include <optional>
#include <string>

#include "launch_config.h"

namespace ddp::launcher {

struct MembershipPolicy {
  enum class Arrivals { kEndTheRound, kWaitToBeAdmitted };
  enum class StoreHost { kNodeZero, kEndpointHost, kEtcd };
  enum class Restarts { kRounds, kFailures };

  // The policy `config` asks for: elastic (config.elastic) or fixed.
  static MembershipPolicy of(const LaunchConfig& config);

  int min_nodes = 1;             // a round needs at least this many nodes
  int max_nodes = 1;             // and admits at most this many
  std::optional<int> node_rank;  // fixed: this node's rank in every round; nullopt: given out
  Arrivals arrivals = Arrivals::kEndTheRound;
  StoreHost store_host = StoreHost::kNodeZero;
  bool store_moves = false;
  // Whether a round must hold a majority of the last round's nodes (Note [Never two groups] in
  // quorum.h): where the store can be in two places at once (it moves). Fixed: every node is in
  // every round anyway; etcd: one store, kept consistent by Raft.
  bool majority = false;
  Restarts restarts = Restarts::kRounds;

  bool fixed_ranks() const { return node_rank.has_value(); }
  // Whether a round may also end by re-forming (a node leaves, or one waits to be admitted), not
  // only by a failure or a success. Fixed: every node is in every round, and a signal to one
  // ddprun ends the whole job.
  bool reforms() const { return arrivals == Arrivals::kWaitToBeAdmitted; }
  // --nnodes as the user gave it: "2", "1:3".
  std::string nnodes() const;
  // "restart round", "elastic round": what the messages call a round.
  const char* round_name() const;
  // This node in messages: "node 1 (h1)" (fixed), "node h1 (ddprun pid 4711)" (elastic).
  std::string where(const std::string& host, int pid) const;
};

}  // namespace ddp::launcher
