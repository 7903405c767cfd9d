// Elastic rounds: the round protocol of every multi-node job (Note [Restart rounds] in rounds.h)
// over its agent store. A job of MIN to MAX nodes re-forms whenever one leaves or arrives; a
// fixed job of N nodes is one with MIN = MAX = N and given node ranks (Note [Membership policy]
// in membership_policy.h).
//
// Note [Elastic rounds]
// torchrun's --nnodes MIN:MAX with the c10d rendezvous, on our agent store (src/store: bounded,
// admitting only holders of the job's key). The ddprun on the rendezvous endpoint's host hosts
// the store (the first to bind it there); every ddprun, that one included, is a client. A node
// is one ddprun, named by "<host>:<pid>:<random>"; a ddprun started again is a new node. The
// keys: Note [Round store keys] in round_store.h. What is particular to an elastic round:
// Closing: R admits MAX as soon as MAX have arrived; else, once MIN have, the count once no node
// of the last round is still on its way: one that has neither arrived nor left and whose ddprun
// showed a sign of life within kDeadAfter (a node checkpointing its workers may take longer than
// the last call; a dead one is not waited for, nor, past the join timeout, a live one that never
// comes). The job's first round also waits last_call_timeout (measured by each waiting node from
// when it saw MIN: the first to close wins) for nodes still starting; a round after a loss or a
// leave does not: nobody new is on its way unless already here. Either way the admitted nodes
// must hold a majority of the last round's (Note [Never two groups] in quorum.h), else the round
// waits, and fails at the join timeout naming the nodes it lacks. A round closes only when the
// round before it is over: failed, regroup or
// finished is set, or none of its nodes' alive counts has moved for kStaleAfter (they all
// vanished). While it is not, the join timeout does not run: waiting to be admitted while the
// job runs at its maximum is not a rendezvous that failed.
// Node ranks: R's nodes sorted by the round they last ran in (newest first), then by their node
// rank there, then newcomers by arrival: a node keeps its rank while the nodes before it stay,
// and rank 0 (and with it the checkpoint writer) moves only when its node leaves.
// Running: every node polls (kPollInterval) for R's failure and for a regroup; a node that sees
// a node waiting in R + 1 while R has fewer than MAX nodes writes R's regroup. On a regroup each
// ddprun sends its workers SIGTERM: ddp-train then stops every rank after the same step with a
// checkpoint (Note [Preemption] in tools/ddp_train/preemption.h), and every node joins R + 1,
// where the workers resume from that checkpoint at the new size (the sampler re-splits the rest
// of the epoch: Note [Sampler position and resume]). The writer of a regroup writes it before
// signalling its workers, so a node whose workers exit first finds it and does not take their
// exit for a failure.
// Leaving: a ddprun that receives SIGTERM writes R's regroup ("node ... leaves"), forwards the
// signal to its workers (they checkpoint with everyone else), and exits; the others go on.
// The node hosting the store can go too, once the others have read the regroup (at most
// kFailureLinger): the others move the store (Note [Moving the store] in elastic.cpp), where
// torchrun's c10d backend loses the job with that node.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "agent_store.h"  // HostedStores
#include "ddp/env.h"      // ddp::EnvMap
#include "launch_config.h"
#include "membership_policy.h"
#include "quorum.h"
#include "round_store.h"
#include "rounds.h"

namespace ddp::launcher {

// How long no sign of life from any node of a round makes it over for a node waiting to start
// the next one (its nodes all vanished: killed with their hosts).
inline constexpr std::chrono::milliseconds kStaleAfter{10'000};
// A node of the last round whose ddprun shows no sign of life for this long is not waited for
// when the next round closes (its host died); a live one is, past the last call.
inline constexpr std::chrono::milliseconds kDeadAfter{3000};
// How long the store must not answer before the nodes move it (Note [Moving the store]).
inline constexpr std::chrono::milliseconds kStoreLost{3000};

// The rounds of one node of a multi-node job. Used by one thread (the launcher's).
class ElasticRounds final : public Rounds {
 public:
  // Hosts the stores `config`'s membership policy gives this node (host_stores) and connects to
  // the job's. Throws ddp::Error when it cannot host what it must.
  ElasticRounds(const LaunchConfig& config, const EnvMap& base_env, const std::string& run_id,
                const std::string& secret);

  // On etcd the workers rendezvous at their rank 0's store (Note [etcd backend] in etcd.h).
  bool agent_store() const override { return !on_etcd(); }
  std::optional<Membership> join(int next, const std::function<bool()>& stop) override;
  std::optional<std::string> regroup(int round, bool now) override;
  bool announce_leaving(int round, const std::string& why) override;
  std::optional<std::string> failure_elsewhere(int round) override;
  std::optional<std::string> report_failure(int round, const std::string& what,
                                            bool final) override;
  bool final_failure(int round) override;
  void leave(int round, bool failed, const std::function<bool()>& stop) override;

 private:
  using Clock = store::Clock;
  using Deadline = Clock::time_point;
  using milliseconds = std::chrono::milliseconds;

  // What one join() carries from step to step.
  struct Join {
    int next = 0;     // the lowest round this node may run
    int round = -1;   // the round it is entering; -1: none yet (or the store just moved)
    int index = -1;   // its arrival index in `round`; -1: not counted in yet
    bool shape_checked = false;
    bool said_waiting = false;  // that the round before still runs, said once
    Clock::time_point end;      // the join timeout (pushed back while the round before runs)
    std::optional<Clock::time_point> min_seen;  // when `round` was first seen with MIN nodes
    std::optional<int> short_of;  // `round`'s count at the join timeout, below MIN
    std::optional<Quorum> lacking;  // why `round` could not close: no majority (at the timeout)
    std::string last_error;       // why the store did not answer this step ("": it did)
  };

  // --- joining (round_join.cpp), in the order of one step: Note [Restart rounds]
  std::optional<Membership> join_step(Join& j);
  void check_shape(Join& j, Deadline deadline);
  void find_round(Join& j, Deadline deadline);
  void check_round_before(int round, Deadline deadline);
  void check_restarts(int round, Deadline deadline);
  bool enter(Join& j, Deadline deadline);
  void end_predecessors_round(Join& j, Deadline deadline);
  bool take_predecessors_place(Join& j, Deadline deadline);
  void refuse_if_alive(Deadline deadline);
  std::optional<int> close(Join& j, Clock::time_point now, Deadline deadline);
  std::optional<int> admissible(Join& j, int count, Clock::time_point now, Deadline deadline);
  // Whether the first `admitted` arrivals of j.round hold a majority of the newest round known
  // (Note [Never two groups]); an arrival whose entry cannot be read abandons the round.
  bool majority(Join& j, int admitted, Deadline deadline);
  // The newest round the store or the entries `here` know of (a conflict throws).
  KnownRound known_last(int round, const std::vector<RoundEntry>& here, Deadline deadline);
  std::optional<Membership> admit_or_wait(Join& j, int closed, Deadline deadline);
  Membership admit(int round, int n, int index, Deadline deadline);
  // On etcd: where the workers of `round` rendezvous; node rank 0 (`rank`) picks and writes it.
  std::pair<std::string, int> workers_store(int round, int rank, Deadline deadline);
  void store_silent(Join& j, const RendezvousError& e);
  // A failure report the store did not take (it did not answer: an etcd leader election, a slow
  // store) is written once it answers again: until then the round it ended looks alive to every
  // node, this one included. A store that moved carries the count instead.
  void report_again(Deadline deadline);
  [[noreturn]] void too_few(int round, int count, Deadline deadline);
  [[noreturn]] void no_majority(int round, const Quorum& q);
  [[noreturn]] void missing_ranks(int round, Deadline deadline);
  [[noreturn]] void unreachable(const std::string& error) const;

  // --- the rounds' ends and the nodes' signs of life (elastic.cpp)
  // `round` is over: failed, re-forming, finished, or all its nodes gone silent.
  bool over(int round, Deadline deadline);
  // Whether a node of `last` (the newest round known) may still come: it is not among `here`
  // (the arrivals), has not left, and its ddprun still shows signs of life (within kDeadAfter).
  bool awaited(const KnownRound& last, const std::vector<RoundEntry>& here, Deadline deadline);
  // Records the signs of life of this round's other nodes now, as the round ends: a dead node
  // is then known dead kDeadAfter from here, not from when the next round starts to close.
  void watch_members(Deadline deadline);
  // Whether node `id`, whose alive count is `beats` now, moved it within `window` (as far as this
  // node has watched it; a count seen for the first time counts as moving).
  bool shows_life(const std::string& id, int64_t beats, milliseconds window);

  // --- the store's place (elastic.cpp: Note [Moving the store])
  bool on_etcd() const { return policy_.store_host == MembershipPolicy::StoreHost::kEtcd; }
  // Where the rounds are kept at first: etcd, or the agent store (node 0 of a fixed job reaches
  // the one it hosts where it listens).
  std::unique_ptr<KeyValue> first_store() const;
  store::ClientOptions client_options(const std::string& host, int port) const;
  void connect_to(const std::string& host, int port);
  // The store stopped answering, or its host leaves (`why` says which): the next node of the
  // last round takes it over (this one, or the one this connects to). False when no node is
  // left to take it.
  bool move_store(const std::string& why);
  // On the store just moved to: the last round is over there, the failures so far carried.
  void settle_moved_store(Deadline deadline);
  // Back to the endpoint, where a node waits (go_home_).
  void return_home();
  // While the store is moved: a node waiting at the rendezvous endpoint (its host came back).
  std::optional<std::string> waiting_at_home(int round);
  // The store moved, and one answers at the endpoint with a node in its newest round (asked at
  // most every 4 kPollInterval).
  bool someone_at_home();
  bool moved() const { return store_host_ != c_.master_addr; }
  // Whether this node's ddprun hosts the job's store now (at the endpoint, or moved here).
  bool hosts_job_store() const;

  // --- leaving (elastic.cpp)
  void linger_for_readers(int round, const std::function<bool()>& stop);
  void linger_for_others(int round, bool failed, const std::function<bool()>& stop);

  std::string where() const { return policy_.where(host_, pid_); }
  // The last round this node ran and its nodes' ids (round -1: none).
  KnownRound known_round() const;

  // Constant after construction.
  const LaunchConfig& c_;
  const MembershipPolicy policy_;
  const std::string job_key_;
  const std::string run_id_;
  const std::string host_;
  const int pid_;
  const std::string id_;  // fixed: the node rank; elastic: "<host>:<pid>:<random>"
  const milliseconds join_timeout_;  // --rdzv-timeout, else the workers' rendezvous timeout
  const milliseconds last_call_;
  const HostedStores hosted_;  // the job's store (when this node hosts it), or a standby

  // Where the job's store is (Note [Moving the store]).
  std::string store_host_;  // --master-addr / --rdzv-endpoint, or where the store moved
  int store_port_ = 0;
  RoundStore store_;                 // its keys
  std::set<std::string> lost_;       // store addresses that stopped answering
  std::optional<Clock::time_point> unreachable_since_;
  std::string moved_note_;           // set by a move until settle_moved_store() writes it
  int known_failures_ = 0;           // the failure count last read
  std::string lineage_;              // the store's lineage once admitted; a drawn one before
  bool unreported_failure_ = false;  // a failure report that did not reach the store
  struct Report {
    int round = -1;
    std::string line;
    bool final = false;
  };
  Report unreported_;  // that report, written when the store answers again (report_again)
  bool go_home_ = false;             // the next join moves the store back to the endpoint
  bool go_away_ = false;             // the next join moves the store on: its host leaves
  Clock::time_point next_home_poll_{};

  // The last round this node ran: its number, this node's rank there, its nodes in rank order.
  int last_round_ = -1;
  int last_rank_ = -1;
  std::vector<RoundEntry> members_;
  bool leaving_ = false;
  StorePoll poll_;  // failure_elsewhere()
  Clock::time_point next_regroup_poll_{};
  // Signs of life seen: id -> (alive count, when it last moved).
  std::map<std::string, std::pair<int64_t, Clock::time_point>> seen_alive_;
};

// The rounds of a multi-node job, of the membership `config` asks for.
std::unique_ptr<Rounds> make_elastic_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                            const std::string& run_id, const std::string& secret);

}  // namespace ddp::launcher
