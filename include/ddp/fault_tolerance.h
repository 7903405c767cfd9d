// Per-step fault tolerance: a failure costs a step, not a restart (torchft's Manager, in C++).
//
//   ddp::TrainingState state;  // everything a newcomer must receive (ddp/training_state.h)
//   state.add("model", model);
//   state.add("optimizer", opt);
//   ddp::ft::Manager manager(state, {.store = "10.0.0.1:29400"});
//   while (manager.current_step() < steps) {
//     manager.start_quorum();               // re-forms the group and heals, when needed
//     if (manager.job_finished()) break;    // it finished while this replica was away
//     auto loss = model->forward(batch_for(manager.rank(), manager.num_participants()));
//     loss.backward();
//     for (auto& p : model->parameters()) manager.allreduce(p.grad());  // the mean
//     if (manager.should_commit()) opt.step();  // else the step is dropped everywhere
//     opt.zero_grad();
//   }
//   manager.finish();
//
// With DistributedDataParallel and a DistributedSampler (registered, they follow every new quorum
// by themselves; a backward whose bucket all-reduce failed throws, and the step is dropped):
//   ddp::TrainingState state;
//   ddp::ft::Manager manager(state, {.store = "10.0.0.1:29400"});
//   ddp::DistributedDataParallel model(net, {.process_group = manager.process_group(),
//                                            .init_sync = false});
//   ddp::DistributedSampler sampler(n, {.num_replicas = 1, .rank = 0});  // re-split per quorum
//   state.add("model", model);  state.add("optimizer", opt);  state.add("sampler", sampler);
//   while (manager.current_step() < steps) {
//     manager.start_quorum();
//     if (manager.job_finished()) break;
//     if (sampler.remaining().empty()) sampler.set_epoch(sampler.epoch() + 1);
//     auto batch = sampler.remaining(per_rank);  sampler.advance(batch.size());
//     try { loss_of(model, batch).backward(); } catch (const std::exception& e) {
//       manager.report_error(e.what());
//     }
//     if (manager.should_commit()) opt.step();
//     opt.zero_grad();
//   }
//   manager.finish();
//
// Note [Per-step fault tolerance]
// The replicas train in quorums (src/ft/quorum.h: the store's side, torch-free). A quorum is a
// numbered set of replicas (processes) and a process group over them; it lasts as long as its steps succeed. Its members and its number live in a
// coordination store that outlives every replica (the launcher's agent store: a ddp-cpp store
// that no replica hosts), under "ft/<run>/q<N>/...".
//   Each step: the step's collectives run over quorum N's group, and an error is recorded, not
//   thrown; should_commit() is the vote: an all_reduce (MIN) of "my step succeeded" over the
//   group. It commits only when every member contributed a success: a dead or stuck member, or
//   an error anywhere, fails the vote (a collective cannot complete without every member), and
//   the optimizer step is not applied. The manager's step counts committed steps. The vote also
//   carries whether a member saw a replica waiting to join quorum N + 1 (a watcher thread with
//   its own connection looks at the store every 20 ms: the step never waits for the store; a
//   look the store did not answer fails the next vote): then all of them re-form at the next
//   start_quorum(), the same step boundary for every member (one that re-formed alone would
//   leave the others waiting in a collective).
//   Re-forming (after a failed step, or when a replica waits): every live member and every
//   newcomer arrives in quorum N + 1 ("arrived" counter; its entry: id, committed step, the
//   quorum it last ran in and its rank there, its process). The quorum closes, by one
//   compare-and-set of "closed" to the number of arrivals it admits, once every live member of
//   quorum N has arrived (a member whose process is gone from this host is dead for sure), or
//   quorum_timeout after this replica arrived (the missing are taken for dead), with at least
//   min_replicas and a majority of quorum N's live members: a replica that was away (stopped,
//   cut off) cannot start a quorum of its own while the others train (the rule of ddprun's
//   rounds, Note [Never two groups]; a 2-replica job survives a death it can see, not a stall). Arrivals past the closing count try quorum N + 2.
//   Ranks: quorum N's members in their old rank order, then newcomers by arrival. A new group
//   per quorum, whose rendezvous and hang reports go through the coordination store under the
//   quorum's keys (no member hosts a store that its stop or death would freeze: a stopped rank 0
//   hosting it cost the others seconds of recovery, enough for it to wake and rejoin unhealed).
//   The old group is left to its failure (a failed group fails every later call at once).
//   Healing: the members whose committed step is below the quorum's highest receive the whole
//   TrainingState from the lowest rank holding the highest, in memory: a snapshot encoded as a
//   checkpoint's bytes (ddp/checkpoint.h), broadcast over the new group. A member lost while
//   the group forms or heals (the healer killed mid-send: a CollectiveError on the others) fails
//   that formation on every member; a receiver restores nothing unless every byte arrived, and
//   the next quorum has another holder of the highest step heal. A vote that completed
//   on some members and failed on others (one saw the last contribution arrive, another timed
//   out first) leaves them a step apart: the next quorum heals the ones behind, so no replica
//   goes on from a step the others did not take.
//   What follows the group (src/state/group_bound.h): at each new quorum, on every member
//   and before any healing, a registered DistributedDataParallel rebinds its reducer to the new
//   group (an iteration the old one failed in is forgotten; the divisor is the new size; the
//   buckets, in the same order or the healer's, are built in the new transport's memory at the
//   next forward, in step on every rank), and a registered DistributedSampler returns to its
//   cursor at the last commit (a dropped step's batch is not consumed) and reshards: the new
//   ranks split the epoch's unconsumed rest, so each sample trains once over the committed
//   steps (but the padding when the rest does not divide by the new size). Before any step
//   committed, the first quorum gives every replica rank 0's state, as DDP's init_sync would:
//   build the wrapper on process_group() with init_sync = false. ddp::Join, ZeRO and
//   PowerSGD's per-rank error feedback do not follow a group yet.
//   Stale state: each quorum's rank 0 records in the store the step it started from and each
//   step it commits (under the quorum's number, so a woken rank 0 of an older quorum cannot set
//   it back; the watcher sends each commit's record, the step does not wait for its answer),
//   and finish() the last; a quorum whose members all hold an older step never trains
//   (job_finished() when the job ended meanwhile, else ddp::RendezvousError: only a checkpoint
//   has the newer state). One case is left open: rank 0 lost between a commit and its record
//   (a store round trip), with every other holder lost with it.
//   Why one store: the quorum's number grows only in the store, and "closed" is set once per
//   number, so two quorums of one number never form; a partition that separates replicas from
//   the store stops them (they cannot arrive: a replica asks a store that does not answer again
//   until join_timeout, waiting, not failing), and the side with the store goes on if it holds
//   the majority. Across hosts (ddprun --ft --nnodes N) the store is the agent store that node
//   0's ddprun hosts for the whole run; a host lost whole and started again takes its place in
//   the running round, and its new replicas are healed. Node 0's host lost takes the store and
//   the quorums' records: the other replicas fail at their join timeout, and only a checkpoint
//   has the state (an elastic job's moving store is not used for this yet).
// Where ours differs from torchft: while nothing changes, no step waits for the store (torchft
// asks its lighthouse for a quorum at every step, asynchronously during forward); a re-forming
// quorum is synchronous at the step's start; the vote is a collective over the group, not a
// call to the lighthouse; state moves over the group's transport, not HTTP.
// Thread-safety: none; one thread drives a Manager.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "ddp/process_group.h"

namespace ddp {

class TrainingState;

namespace ft {

struct ManagerOptions {
  // The coordination store, "HOST:PORT": a ddp-cpp store that outlives every replica. Unset:
  // MASTER_ADDR:MASTER_PORT, which must then be the launcher's agent store
  // (TORCHELASTIC_USE_AGENT_STORE=1 with DDP_AGENT_STORE=ddp).
  std::optional<std::string> store;
  // The store's secret and the run's id (its keys are the job's). Unset: DDP_STORE_SECRET and
  // TORCHELASTIC_RUN_ID.
  std::optional<std::string> secret;
  std::optional<std::string> run_id;
  // This replica; unique for each process that ever joins (default: drawn at random).
  std::string replica_id;
  int min_replicas = 1;
  // How long a forming quorum waits for a member of the last one that has not arrived.
  std::chrono::milliseconds quorum_timeout{1000};
  // A quorum that cannot form within this (fewer than min_replicas): ddp::RendezvousError.
  std::chrono::milliseconds join_timeout{60000};
  // Each quorum's group: backend and collective timeout (rank, world size and the store are the
  // manager's; hang_report_wait is 300 ms unless set, so that a peer dead on another host costs
  // the others little time in their error's report).
  InitOptions group;
};

class Manager {
 public:
  // Registers its own step counter in `state` (key "ft.step") and connects to the store. The
  // first start_quorum() joins.
  Manager(TrainingState& state, ManagerOptions options);
  ~Manager();
  Manager(const Manager&) = delete;
  Manager& operator=(const Manager&) = delete;

  // At the start of every step. Returns at once while nothing changed; else joins the next
  // quorum, forms its group and heals this replica (or lets it heal the others) when committed
  // steps differ.
  void start_quorum();

  // The current quorum's group, this replica's rank in it and its size.
  ProcessGroup& group();
  // The same, shared; before the first start_quorum(), a group of this replica alone: what a
  // DistributedDataParallel is built on (with init_sync = false: the first quorum gives every
  // replica rank 0's state) before it is registered in the TrainingState. A registered DDP
  // follows each new group by itself (see the Note).
  std::shared_ptr<ProcessGroup> process_group();
  int rank() const;
  int num_participants() const;
  int64_t quorum_id() const;
  // Committed steps (every replica of a quorum agrees after start_quorum()).
  int64_t current_step() const;

  // Averages `tensor` over the participants in place. An error is recorded (errored()), not
  // thrown: the step will not commit.
  void allreduce(at::Tensor& tensor);
  // An error of the user's own during this step: it will not commit.
  void report_error(const std::string& what);
  // The first error of this step ("" if none).
  const std::string& errored() const;

  // The vote: true when every participant's step succeeded; then apply the optimizer step (the
  // manager counts it committed). False: drop the step; the next start_quorum() re-forms.
  bool should_commit();

  // After the training loop, on the replicas that ran it to the end: the job's last committed
  // step, for a replica that was away (stopped, cut off) and comes back after the others left.
  void finish();
  // start_quorum() found the job finished at a step this replica does not hold, with nobody
  // left to heal it: end the loop, there is nothing to train. (A quorum that holds only older
  // steps while the job is not finished throws ddp::RendezvousError: it never trains from a
  // stale state.)
  bool job_finished() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ft
}  // namespace ddp
