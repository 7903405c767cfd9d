// The round store: the keys of ddprun's round protocol (Note [Restart rounds] in rounds.h), each
// spelled once, behind accessors named after what they mean.
//
// Note [Round store keys]
// Every ddprun of a multi-node job, fixed or elastic (Note [Membership policy] in
// membership_policy.h), keeps the job's rounds in its agent store, or in etcd with
// --rdzv-backend etcd (key_value.h), under "ddprun/<run id>/".
// The keys, their values, and who writes them:
//   round            the newest round, a decimal number; it only grows (compare_set)
//   lineage          which instance of the job this store's rounds belong to: drawn by the first
//                    node to be admitted in a fresh store, carried by the nodes that move the
//                    store; the workers' DDP_RUN_LINEAGE (Note [Run folder lease] in
//                    ddp/run_lease.h: a fresh store at the endpoint while the job runs elsewhere
//                    is another lineage, and its workers never take the job's run folder)
//   shape            "--nnodes N, --nproc-per-node P" of the first node to join ("--nnodes
//                    MIN:MAX, ..." for an elastic job): every node must agree
//   alive/<id>       counts node <id>'s polls (each join step, each kPollInterval while its
//                    workers run, stopping included): its sign of life. <id>: its node rank
//                    (fixed), "<host>:<pid>:<random>" (elastic: a ddprun started again is a new
//                    node)
//   last_round       "<R> <ids>": the newest round that began in this store (or that the nodes
//                    moving it here last ran), its nodes' ids comma-separated; only raised
//   failures         how many rounds ended in a failure, counted by each round's first reporter
//                    (and carried when the store moves): what an elastic job's --max-restarts
//                    counts
//   <R>/node/<K>     fixed node ranks only: add(1) by node K's ddprun entering round R: 1 for the
//                    first, more when a ddprun of node K enters again (its scheduler started it
//                    again, or two were given that rank)
//   <R>/count        add(1) by each node entering round R: its arrival index i
//   <R>/member/<i>   that node's entry: "<id> <host> <address> <round it last ran> <its node
//                    rank there> <that round's node ids, comma-separated>" (the address: where
//                    its standby store listens, or "-"; "-" for no round): what a store just
//                    moved to learns the last round from (Note [Never two groups] in quorum.h)
//   <R>/closed       the number of nodes admitted to R, written once (compare_set): arrivals
//                    i < closed are R's nodes; later ones wait for R + 1
//   <R>/failed       R's first failure, one line ("node 1 (h): rank 3 failed (exit code 1)");
//                    the first writer wins
//   <R>/final        set (before <R>/failed) when that failure is final: no node restarts
//   <R>/finished     the first node whose workers all exited 0 in R
//   <R>/ended        how many of R's nodes are done with it
//   <R>/regroup      why R ends without a failure (elastic): a node leaves, a node waits to be
//                    admitted, the store moved, or none of R's nodes answers any more
//   <R>/regroup_seen how many nodes have read R's regroup (a leaving store host waits for them)
//   <R>/left/<id>    set by a node that leaves after R (nobody waits for it)
//   <R>/store_away   set with R's regroup when the node hosting the job's store leaves: the
//                    others move it before the next round, which must not begin in a store
//                    about to vanish
//   <R>/store_home   set with R's regroup when the job's store moves back to the endpoint
//                    (Note [Moving the store] in elastic.cpp)
//   <R>/workers_store  etcd only: "<address> <port>" where R's workers rendezvous (their rank
//                    0's store, on node rank 0), written by node rank 0's ddprun (Note [etcd
//                    backend] in etcd.h)
// Every call is bounded by the deadline its caller passes. A value that should be a number and
// is not means another program wrote to the job's keys: every such read says so the same way.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "key_value.h"
#include "store/client.h"

namespace ddp::launcher {

// One node's entry in a round ("<R>/member/<i>").
struct RoundEntry {
  std::string id;  // "?": unknown (its node died before writing it, or it is garbled)
  std::string host;
  std::string addr;     // its address toward the store ("-": none), where it would host one
  int last_round = -1;  // the round it last ran in; -1: none (a new node)
  int last_rank = -1;   // its node rank there
  std::vector<std::string> last_members;  // the ids of that round's nodes, in rank order
  int arrival = 0;      // its arrival index in this round (not stored: the key's <i>)

  std::string format() const;
  static RoundEntry parse(const std::string& text, int arrival);
};

// A round and its nodes' ids, as someone knows it (Note [Never two groups] in quorum.h).
struct KnownRound {
  int round = -1;  // -1: none (a job that never ran, as far as anyone here knows)
  std::vector<std::string> members;
};

// The number the store holds under `what` ("round", "failure count"); throws ddp::Error naming
// it when `text` is not one.
int parse_count(const std::string& text, const char* what);

class RoundStore {
 public:
  using Clock = store::Clock;
  using Deadline = Clock::time_point;

  // The keys of run `run_id`, in the agent store `options` reaches, or in `kv` (etcd).
  RoundStore(const std::string& run_id, const store::ClientOptions& options);
  RoundStore(const std::string& run_id, std::unique_ptr<KeyValue> kv);
  // From now on, the agent store `options` reaches (the job's store moved: Note [Moving the
  // store]).
  void connect(const store::ClientOptions& options);

  // --- the job
  // Raises "round" to at least `next`; returns its value.
  int raise_round(int next, Deadline deadline);
  // "round", nullopt while no node has joined.
  std::optional<int> round(Deadline deadline);
  // Sets "shape" unless a node set it first; returns the job's.
  std::string claim_shape(const std::string& shape, Deadline deadline);
  // Sets "lineage" unless a node set it first; returns the store's.
  std::string claim_lineage(const std::string& lineage, Deadline deadline);
  // alive/<id>: count one sign of life; how many so far (-1: none any more, its etcd lease
  // expired).
  void beat(const std::string& id, Deadline deadline);
  int64_t beats(const std::string& id, Deadline deadline);
  // "last_round": raised to `known` unless it holds a newer round; the newest round recorded.
  void record_round(const KnownRound& known, Deadline deadline);
  KnownRound last_round(Deadline deadline);
  // "failures": how many so far (0: none); count one more (returns the new count); raise it to at
  // least `count` (a store just moved to).
  int failures(Deadline deadline);
  int count_failure(Deadline deadline);
  void carry_failures(int count, Deadline deadline);

  // --- entering and closing round R
  // <R>/node/<K>: how many ddprun of node rank K have entered R, this one included.
  int64_t claim_rank(int round, int rank, Deadline deadline);
  bool rank_claimed(int round, int rank, Deadline deadline);
  // <R>/count: counts this node in, returns its arrival index; how many arrived so far.
  int count_in(int round, Deadline deadline);
  int arrivals(int round, Deadline deadline);
  void write_entry(int round, int index, const RoundEntry& entry, Deadline deadline);
  // The entries of R's first `n` arrivals, in arrival order; one not written within `wait` is
  // unknown ("?"). Each is written once, so each is read once.
  std::vector<RoundEntry> entries(int round, int n, std::chrono::milliseconds wait);
  // <R>/closed: how many R admits, once decided; `close` decides it unless a node did first,
  // and returns the decision.
  std::optional<int> closed(int round, Deadline deadline);
  int close(int round, int admitted, Deadline deadline);

  // --- how round R ends
  std::optional<std::string> failure(int round, Deadline deadline);
  bool failed(int round, Deadline deadline);
  // Writes `line` as R's failure unless another came first (then returns that one); <R>/final
  // first when `final`, so that whoever sees the failure sees whether it is final.
  std::optional<std::string> write_first_failure(int round, const std::string& line, bool final,
                                                 Deadline deadline);
  std::optional<std::string> final_failure(int round, Deadline deadline);
  // Whether R's failure is final; false also when the store does not answer.
  bool failure_is_final(int round, Deadline deadline);
  std::optional<std::string> finished(int round, Deadline deadline);
  void finish(int round, const std::string& who, Deadline deadline);
  void end(int round, Deadline deadline);
  int ended(int round, Deadline deadline);
  std::optional<std::string> regroup(int round, Deadline deadline);
  // Writes `why` as R's regroup unless another came first; returns the one that stands.
  std::string write_regroup(int round, const std::string& why, Deadline deadline);
  // Failed, re-forming or finished: a node of R said it is over.
  bool said_over(int round, Deadline deadline);
  void saw_regroup(int round, Deadline deadline);
  int regroup_readers(int round, Deadline deadline);
  void leave(int round, const std::string& id, Deadline deadline);
  bool left(int round, const std::string& id, Deadline deadline);
  void send_store_home(int round, Deadline deadline);
  bool store_goes_home(int round, Deadline deadline);
  void send_store_away(int round, Deadline deadline);
  bool store_goes_away(int round, Deadline deadline);

  // --- etcd: where R's workers rendezvous ("<address> <port>": their rank 0's store)
  void set_workers_store(int round, const std::string& address, int port, Deadline deadline);
  // Waits up to `wait` for node rank 0 to write it.
  std::pair<std::string, int> workers_store(int round, std::chrono::milliseconds wait);
  // Returns when one of the job's keys changes (signs of life aside), or after `timeout` (the
  // agent store: always after `timeout`).
  void wait_for_change(std::chrono::milliseconds timeout) {
    kv_->wait_for_change(prefix_, prefix_ + "alive/", timeout);
  }
  // Where this host reaches the store from ("-": unknown).
  std::string local_address() const { return kv_->local_address(); }

 private:
  std::string job_key(std::string_view what) const;
  std::string key(int round, std::string_view what) const;
  std::optional<std::string> get_if_set(const std::string& key, Deadline deadline);

  const std::string prefix_;  // "ddprun/<run id>/"
  std::unique_ptr<KeyValue> kv_;
  std::map<std::pair<int, int>, RoundEntry> entries_;  // (round, arrival) -> its entry, once read
};

}  // namespace ddp::launcher
