// Restart rounds: how the ddprun of every node of a job restarts the job together.
//
// Note [Restart rounds]
// Each ddprun starts, stops and restarts only its own node's workers; a job of several nodes must
// restart as a whole. It does so in rounds that every node's ddprun joins through the agent
// store: node 0's ddprun hosts our store (src/store: bounded, admitting only holders of the job's
// key) on MASTER_ADDR:MASTER_PORT for the whole run, and the workers rendezvous there too
// (TORCHELASTIC_USE_AGENT_STORE=True, DDP_AGENT_STORE=ddp) under their round's keys
// ("ddp/<run id>/attempt_<round>/"), so two rounds never meet. ddprun's keys, under
// "ddprun/<run id>/":
//   round          the newest round; it only grows (compare_set)
//   <R>/node/<K>   add(1) by node K's ddprun joining round R: 1 for the first, more when a
//                  ddprun of node K joins again (its scheduler started it again)
//   <R>/joined     how many nodes joined round R
//   <R>/failed     round R's first failure, one line ("node 1 (host h): rank 3 failed (exit
//                  code 1)"); the first writer wins
//   <R>/final      set (before <R>/failed) when that failure is final: no node restarts
//   <R>/ended      how many nodes are done with round R
//   <R>/finished   the first node whose workers all exited 0 in round R: a node that failed in
//                  R does not restart then (the finished node is gone), it says why
//   shape          "--nnodes N, --nproc-per-node P" of the first node to join: every node must
//                  agree
//   alive/<K>      counts node K's ddprun's polls (each join step, each kPollInterval while its
//                  workers run, stopping included)
// Joining: a node raises "round" to the round it may run next (0 at first, R + 1 after round R
// failed), counts itself in and waits until every node has, bounded by the rendezvous timeout
// (the missing nodes are named); if round R fails or a newer round opens meanwhile, it joins that
// one instead. The round is the job's restart count, the same on every node: it is the workers'
// TORCHELASTIC_RESTART_COUNT, and a round past --max-restarts is refused.
// Running: a failure on this node is written to "<R>/failed" as soon as ddprun reaps it, and
// every node polls that key (kPollInterval): another node's failure stops this node's workers at
// once (SIGTERM, grace period, SIGKILL) instead of leaving them to a collective timeout.
// Rejoining: a ddprun killed with its node and started again joins with nothing to remember: it
// finds "<R>/node/<K>" already counted, so its node's workers of round R are gone (unless
// "alive/<K>" still moves within kAliveWindow: then two ddprun were given node rank K, and the
// newcomer stops with that error). It fails round
// R ("node K's ddprun started again") and joins R + 1, where the others, stopped by that
// failure, meet it.
// Ending: node 0's store must outlive the others' use of it. When its part of a round is over it
// waits until "<R>/ended" counts every node: after a success up to kSuccessLinger (the others
// may still be finishing), after a failure at most the grace period and kFailureLinger (the
// others only need to read why, and stop); a signal to ddprun ends the wait.
// What this cannot keep: node 0's host dying takes the store and its counts with it. A ddprun
// started again there hosts a fresh store, and the other nodes, which retry connecting until the
// rendezvous timeout, raise "round" to theirs again, so the job goes on with its round numbers.
// A single-node job needs none of this: its rounds are its own attempts (LocalRounds).
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "args.h"  // LaunchConfig, EnvMap
#include "ddp/error.h"
#include "store/client.h"
#include "store/host.h"

namespace ddp::launcher {

// How often a node asks whether another node's workers failed.
inline constexpr std::chrono::milliseconds kPollInterval{500};
// A ddprun that finds its node already counted in a round watches that node's "alive" count
// this long: if it moves, the other ddprun is running (a duplicate --node-rank).
inline constexpr std::chrono::milliseconds kAliveWindow{2500};
// After a failed poll (the store did not answer), the next one waits this long.
inline constexpr std::chrono::milliseconds kPollBackoff{5000};
// Each store call made while workers run is bounded by this.
inline constexpr std::chrono::milliseconds kCallTime{2000};
// How long a node waits for the others to join a round, without --rdzv-timeout: as long as the
// workers' rendezvous (kDefaultRendezvousTimeout, DDP_RDZV_TIMEOUT's default).
// After a success, how long node 0 keeps the store up for the others at most (their workers are
// at their end too; more only with a shorter rendezvous timeout).
inline constexpr std::chrono::milliseconds kSuccessLinger{60'000};
// After a failure, how long node 0 keeps the store up beyond the grace period for the others.
inline constexpr std::chrono::milliseconds kFailureLinger{5000};

// Where this node stands in a round.
struct Membership {
  int round = 0;      // the job's round: the workers' attempt (TORCHELASTIC_RESTART_COUNT)
  int node_rank = 0;  // this node's rank in the round
  int nnodes = 1;     // nodes in the round
  int restarts = 0;   // restarts used so far against --max-restarts (elastic: failures only)
  // Where the workers' store is when it is not --master-addr/--master-port: an elastic job's
  // store moved to another node (Note [Moving the store] in elastic.h).
  std::string store_addr;
  int store_port = 0;
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

  // Whether the workers reach the store through the agent (node 0's ddprun).
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

  // This node is done with `round` (it succeeded, or failed for good). Node 0 waits, bounded,
  // until the others are done with its store too, or until `stop` says so (a signal).
  virtual void leave(int round, bool failed, const std::function<bool()>& stop = {}) = 0;
};

// Hosts the job's agent store on this host (Note [Hosting the store] in rounds.cpp); `who`
// names this ddprun in errors ("node 0"). Throws ddp::Error saying what to change; returns null
// when the port is taken and `none_if_in_use` (another ddprun on this host hosts it). `quiet`:
// without the store's notes (a standby store: Note [Moving the store] in elastic.cpp).
std::unique_ptr<store::Server> host_agent_store(const LaunchConfig& config, const EnvMap& base_env,
                                                const std::string& key, const std::string& secret,
                                                const std::string& who,
                                                bool none_if_in_use = false, bool quiet = false);

// What the store-backed rounds share (StoreRounds in rounds.cpp, ElasticRounds in elastic.cpp):
// a round's failure keys, "<prefix><round>/failed" and "<prefix><round>/final".
//
// Writes `line` as `round`'s failure unless another came first (then returns that one);
// "final" first when `final`, so that whoever sees the failure sees whether it is final.
// Throws ddp::Error when the store does not answer within kCallTime.
std::optional<std::string> write_first_failure(store::Client& client, const std::string& prefix,
                                               int round, const std::string& line, bool final);
// Whether `round`'s failure is final; false also when the store does not answer.
bool failure_is_final(store::Client& client, const std::string& prefix, int round);

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

// LocalRounds for a single node; store rounds (hosting the store on node 0) for several; elastic
// rounds (elastic.h) for an elastic job.
// `base_env` supplies DDP_STORE_BIND; `secret` and `run_id` make the store's key.
std::unique_ptr<Rounds> make_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                    const std::string& run_id, const std::string& secret);

}  // namespace ddp::launcher
