// Elastic rounds: a job of MIN to MAX nodes that re-forms whenever one leaves or arrives.
//
// Note [Elastic rounds]
// torchrun's --nnodes MIN:MAX with the c10d rendezvous, on our agent store (src/store: bounded,
// admitting only holders of the job's key). The ddprun on the rendezvous endpoint's host hosts
// the store (the first to bind it there); every ddprun, that one included, is a client. A node
// is one ddprun, named by "<host>:<pid>:<random>"; a ddprun started again is a new node. Keys,
// under "ddprun/<run id>/":
//   round            the newest round; it only grows (compare_set)
//   <R>/count        add(1) by each node joining round R: its arrival index i
//   <R>/member/<i>   that node's entry: "<id> <host> <address> <round it last ran> <its node
//                    rank there>" (the address: where its standby store listens, or "-")
//   <R>/closed       the number of nodes admitted to R, written once (compare_set): MAX as soon
//                    as MAX have arrived; else, once MIN have, the count after last_call_timeout
//                    (measured by each waiting node from when it saw MIN: the first to close
//                    wins) and once no node of R - 1 is still on its way: one that has neither
//                    arrived nor left and whose ddprun showed a sign of life within kDeadAfter
//                    (a node checkpointing its workers may take longer than the last call; a
//                    dead one is not waited for, nor, past the join timeout, a live one that
//                    never comes). A round closes only when the round before it is over (below).
//                    Arrivals i < closed are R's nodes; later ones wait for R + 1.
//   <R>/failed       R's first failure (as in Note [Restart rounds]); <R>/final: it is final
//   <R>/left/<id>    set by a node that leaves after R (nobody waits for it)
//   <R>/regroup      why R ends without a failure: a node leaves (its ddprun got SIGTERM, the
//                    scheduler's notice), or a node waits in R + 1 while R has fewer than MAX
//   <R>/regroup_seen how many nodes have read R's regroup (a leaving store host waits for them)
//   <R>/finished     the node whose workers all exited 0 first
//   <R>/ended        how many of R's nodes are done with it
//   failures         rounds that ended in a failure: what --max-restarts counts (torchrun counts
//                    failures, not changes of membership)
//   alive/<id>       counts each node's polls (its sign of life)
//   <R>/store_home   set with R's regroup when the job's store moves back to the endpoint
//                    (Note [Moving the store] in elastic.cpp)
// Round R is over when failed, regroup or finished is set, or when none of its nodes' alive
// counts has moved for kStaleAfter (they all vanished).
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

#include <memory>
#include <string>

#include "args.h"
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

std::unique_ptr<Rounds> make_elastic_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                            const std::string& run_id, const std::string& secret);

}  // namespace ddp::launcher
