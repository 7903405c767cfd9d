// Restart rounds: how the ddprun of every node of a job starts, stops and restarts the job
// together.
//
// Note [Restart rounds]
// Each ddprun starts, stops and restarts only its own node's workers; a job of several nodes must
// restart as a whole. It does so in numbered rounds that every node's ddprun joins through the
// job's agent store (src/store: bounded, admitting only holders of the job's key), which one
// node's ddprun hosts; the workers rendezvous there too (TORCHELASTIC_USE_AGENT_STORE=True,
// DDP_AGENT_STORE=ddp) under their round's keys ("ddp/<run id>/attempt_<round>/"), so two rounds
// never meet (Python workers, whose TCPStore clients cannot talk to our store, get their rank 0
// hosting PyTorch's on the next port instead). One protocol serves both kinds of job: a fixed
// job (--nnodes N, --node-rank K) is an elastic one (--nnodes MIN:MAX, Note [Elastic rounds] in
// elastic.h) with MIN = MAX = N and given node ranks; what else differs is its membership policy
// (Note [Membership policy] in membership_policy.h). Its keys: Note [Round store keys] in
// round_store.h.
// Joining (ElasticRounds::join, round_join.cpp): short bounded steps, repeated every kWaitStep
// until the join timeout (the rendezvous timeout; the store's host may not listen yet, or may be
// starting again, so a store that does not answer is asked again). Each step goes through:
//   the shape   every node must have the same --nnodes and --nproc-per-node ("shape");
//   the round   "round" is raised to the lowest round this node may run (0 at first, R + 1 after
//               round R failed or re-formed); a newer one, opened meanwhile, is joined instead.
//               None is when the round before ended for good: a node finished it (its workers
//               all exited 0: it is gone), or its failure was final, or --max-restarts is used;
//   entering    count in ("<R>/count", once per round) with this node's entry; with fixed ranks
//               claim the rank first ("<R>/node/<K>"): a rank claimed twice means this node's
//               ddprun was started again while its earlier one had entered R, so R's workers on
//               this node are gone (unless "alive/<K>" still moves within kAliveWindow: then two
//               ddprun were given rank K, and the newcomer stops with that error). It fails R
//               ("node K's ddprun started again") and enters R + 1, where the others, stopped by
//               that failure, meet it; with --ft it takes its earlier ddprun's place in R
//               instead (Note [Membership policy]);
//   closing     the first node to see that R may begin writes how many it admits
//               ("<R>/closed"): fixed, all N; elastic, Note [Elastic rounds]. A round that failed
//               before it closed gives way to the next;
//   admission   arrivals below that count are R's nodes, ranked (fixed: by --node-rank); a
//               later one waits for R + 1. Too few nodes by the join timeout is an error that
//               names the missing ones.
// The round is the job's restart count, the same on every node: the workers'
// TORCHELASTIC_RESTART_COUNT.
// Running: a failure on this node is written to "<R>/failed" as soon as ddprun reaps it, and
// every node polls that key (kPollInterval): another node's failure stops this node's workers at
// once (SIGTERM, grace period, SIGKILL) instead of leaving them to a collective timeout. Each
// poll is also this node's sign of life ("alive/<id>").
// Ending: the store's host must outlive the others' use of it. When its part of a round is over
// it waits until "<R>/ended" counts every node of the round: after a success up to
// kSuccessLinger (the others may still be finishing), after a failure, or once another node
// fails, at most the grace period and kFailureLinger (the others only need to read why, and
// stop); a signal to ddprun ends the wait.
// What a fixed job cannot keep: node 0's host dying takes the store and its counts with it. A
// ddprun started again there hosts a fresh store, and the other nodes, which retry connecting
// until the join timeout, raise "round" to theirs again, so the job goes on with its round
// numbers. (An elastic job moves its store instead: Note [Moving the store] in elastic.cpp.)
// A single-node job needs none of this: its rounds are its own attempts (LocalRounds).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "ddp/env.h"    // ddp::EnvMap
#include "ddp/error.h"
#include "launch_config.h"
#include "store/client.h"  // store::Clock

namespace ddp::launcher {

// How often a node asks whether another node's workers failed.
inline constexpr std::chrono::milliseconds kPollInterval{500};
// A ddprun that finds its node rank already claimed in a round watches that rank's "alive"
// count this long: if it moves, the other ddprun is running (a duplicate --node-rank).
inline constexpr std::chrono::milliseconds kAliveWindow{2500};
// After a failed poll (the store did not answer), the next one waits this long.
inline constexpr std::chrono::milliseconds kPollBackoff{5000};
// Each store call made while workers run is bounded by this.
inline constexpr std::chrono::milliseconds kCallTime{2000};
// After a success, how long the store's host keeps the store up for the others at most (their
// workers are at their end too; less only with a shorter rendezvous timeout).
inline constexpr std::chrono::milliseconds kSuccessLinger{60'000};
// After a failure, how long the store's host keeps the store up beyond the grace period for the
// others.
inline constexpr std::chrono::milliseconds kFailureLinger{5000};

// Where this node stands in a round.
struct Membership {
  int round = 0;      // the job's round: the workers' attempt (TORCHELASTIC_RESTART_COUNT)
  int node_rank = 0;  // this node's rank in the round
  int nnodes = 1;     // nodes in the round
  int restarts = 0;   // restarts used so far against --max-restarts (elastic: failures only)
  // Where the workers' store is when it is not --master-addr/--master-port: an elastic job's
  // store moved to another node (Note [Moving the store] in elastic.cpp).
  std::string store_addr;
  int store_port = 0;
  // Which instance of the job: the workers' DDP_RUN_LINEAGE (Note [Run folder lease] in
  // ddp/run_lease.h): a single node's own, or the one of the rounds' store.
  std::string lineage;
};

// An elastic job ended (finished, or failed for good) while this node waited to be admitted.
class JobEnded : public Error {
 public:
  JobEnded(const std::string& what, bool succeeded_in) : Error(what), succeeded(succeeded_in) {}
  bool succeeded;
};

class Rounds {
 public:
  virtual ~Rounds() = default;

  // Whether the workers reach the store through the agent (the ddprun hosting the job's store).
  virtual bool agent_store() const = 0;

  // The round this node's next attempt runs as, once every node has joined it; `next` is the
  // lowest it may be (0, or a failed round + 1). nullopt when `stop` said so (ddprun received
  // a signal) before that. Throws ddp::Error: a node did not join in time, the store could not
  // be reached in that time, the round is past --max-restarts; JobEnded (elastic).
  virtual std::optional<Membership> join(int next, const std::function<bool()>& stop) = 0;

  // Elastic jobs: why `round` must end so that the job re-forms (a node leaves, or waits to be
  // admitted), nullopt otherwise. Asks the store at most every kPollInterval unless `now` (a
  // worker exited: was it stopped for a re-forming?).
  virtual std::optional<std::string> regroup(int /*round*/, bool /*now*/) { return std::nullopt; }

  // Elastic jobs: this node leaves the job after `round` (`why`: "its ddprun received
  // SIGTERM"), and the others go on without it. False where the job is not elastic: the signal
  // ends the whole job, as before.
  virtual bool announce_leaving(int /*round*/, const std::string& /*why*/) { return false; }

  // Another node's failure in `round`, when one was reported (polled while the workers run; asks
  // the store at most every kPollInterval, so it may be called often).
  virtual std::optional<std::string> failure_elsewhere(int round) = 0;

  // Tells the other nodes that this node's workers failed in `round` (`what`: "rank 3 failed
  // (exit code 1)"); `final`: restarting cannot help (Note [Final failures] in launcher.cpp).
  // Returns another node's failure when that came first.
  virtual std::optional<std::string> report_failure(int round, const std::string& what,
                                                    bool final = false) = 0;

  // Whether `round`'s first failure was reported final, on any node.
  virtual bool final_failure(int round) = 0;

  // This node is done with `round` (it succeeded, or failed for good). The store's host waits,
  // bounded, until the others are done with its store too, or until `stop` says so (a signal).
  virtual void leave(int round, bool failed, const std::function<bool()>& stop = {}) = 0;
};

// Asks the store while workers run: at most every kPollInterval, kPollBackoff after the store
// did not answer (said once: the workers go on, and fail by themselves if their peers are gone).
class StorePoll {
 public:
  // `ask(deadline)`'s answer, or nullopt when it is not time yet or the store did not answer
  // (`on_error` is told).
  std::optional<std::string> operator()(
      const std::function<std::optional<std::string>(store::Clock::time_point)>& ask,
      const std::function<void()>& on_error = {});

 private:
  store::Clock::time_point next_{};
  bool noted_ = false;
};

// A single node restarts alone: its rounds are its own attempts. With --ft this ddprun hosts the
// workers' store for the whole run (their coordination store: it outlives every worker).
std::unique_ptr<Rounds> make_local_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                          const std::string& run_id, const std::string& secret);

// The rounds this node runs in: LocalRounds for a single node, ElasticRounds (elastic.h) for a
// job of several, fixed or elastic. `base_env` supplies DDP_STORE_BIND; `secret` and `run_id`
// make the store's key. Defined by the launcher (launcher.cpp), the one place that knows every
// kind of rounds.
std::unique_ptr<Rounds> make_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                    const std::string& run_id, const std::string& secret);

}  // namespace ddp::launcher
