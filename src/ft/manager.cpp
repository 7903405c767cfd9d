// ddp::ft::Manager: the groups of the quorums, the commit vote and live healing (Note [Per-step
// fault tolerance] in ddp/fault_tolerance.h); the quorums themselves are ft/quorum.h's.
#include "ddp/fault_tolerance.h"

#include <chrono>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "base/parse.h"      // parse::integer
#include "base/random_id.h"  // random_hex
#include "ddp/checkpoint.h"  // encode_checkpoint, decode_checkpoint
#include "ddp/env.h"
#include "ddp/error.h"
#include "ddp/training_state.h"
#include "ft/quorum.h"
#include "state/group_bound.h"  // what follows each new group: DDP, the sampler
#include "store/protocol.h"     // job_key

namespace ddp::ft {
namespace {

// How long a quorum group's failing rank waits for its peers' flight records (see
// InitOptions::hang_report_wait).
constexpr std::chrono::milliseconds kFailureReportWait{300};

std::string from_env(const char* name) {
  const EnvMap env = current_environment();
  const auto it = env.find(name);
  return it == env.end() ? "" : it->second;
}

std::pair<std::string, int> split_endpoint(const std::string& endpoint, const char* what) {
  const size_t colon = endpoint.rfind(':');
  const auto port =
      colon == std::string::npos ? std::nullopt : parse::integer(endpoint.substr(colon + 1));
  if (!port || *port <= 0 || *port > 65535) {
    throw ConfigError(fmt::format("{} '{}' is not HOST:PORT", what, endpoint));
  }
  return {endpoint.substr(0, colon), static_cast<int>(*port)};
}

QuorumOptions quorum_options(ManagerOptions& o) {
  if (o.replica_id.empty()) o.replica_id = "replica-" + random_hex(6);
  if (o.min_replicas < 1) {
    throw ConfigError(
        fmt::format("ft::ManagerOptions::min_replicas must be at least 1, not {}", o.min_replicas));
  }
  std::string endpoint = o.store.value_or("");
  if (endpoint.empty()) {
    const std::string addr = from_env("MASTER_ADDR"), port = from_env("MASTER_PORT");
    if (addr.empty() || port.empty()) {
      throw ConfigError(
          "ft::Manager needs a coordination store that outlives every replica: set "
          "ManagerOptions::store to HOST:PORT, or run under a launcher that hosts the store "
          "(MASTER_ADDR and MASTER_PORT are unset here)");
    }
    endpoint = addr + ":" + port;
  }
  const auto [host, port] = split_endpoint(endpoint, "ft::ManagerOptions::store");
  QuorumOptions q;
  q.host = host;
  q.port = port;
  q.run = o.run_id.value_or(from_env("TORCHELASTIC_RUN_ID"));
  q.key = store::job_key(o.secret.value_or(from_env("DDP_STORE_SECRET")), q.run);  // = Impl::secret
  q.replica_id = o.replica_id;
  q.min_replicas = o.min_replicas;
  q.quorum_timeout = o.quorum_timeout;
  q.join_timeout = o.join_timeout;
  return q;
}

}  // namespace

struct Manager::Impl {
  Impl(TrainingState& s, ManagerOptions options)
      : o(std::move(options)), secret(o.secret.value_or(from_env("DDP_STORE_SECRET"))),
        qo(quorum_options(o)), state(s), quorums(qo) {
    state.add("ft.step", json_state([this] { return fmt::format(R"({{"step": {}}})", step); },
                                    [this](const std::string& j) {
                                      step = std::stoll(j.substr(j.find(':') + 1));
                                    }));
  }

  void start_quorum() {
    error.clear();
    if (!broken && !regroup) return;
    regroup = false;
    std::string why;
    int64_t after = quorum;
    const auto started = std::chrono::steady_clock::now();
    for (;;) {
      const Formed f = quorums.join(after, {o.replica_id, step, quorum, rank}, why);
      if (f.job_finished) {
        finished_elsewhere = true;
        quorums.note(
            fmt::format("the job finished while this replica was away (at step {}): "
                        "nothing left to train",
                        step));
        return;
      }
      if (stale(f)) return;
      try {
        form(f);
        return;
      } catch (const Error& e) {
        // A member died or stalled while the group formed (RendezvousError) or while the
        // healing's broadcasts ran (CollectiveError: the healer died sending its state; a
        // receiver restores nothing unless every byte arrived): every member's formation
        // fails, and all of them go on to the next quorum, where another replica holding the
        // newest step heals. join_timeout bounds the attempts together (each join() bounds only
        // its own wait).
        const bool member_lost = dynamic_cast<const RendezvousError*>(&e) != nullptr ||
                                 dynamic_cast<const CollectiveError*>(&e) != nullptr;
        if (!member_lost || std::chrono::steady_clock::now() - started > o.join_timeout) throw;
        why = e.what();
        quorums.failed(f.number, why);
        after = f.number;
      }
    }
  }

  // Whether quorum `f` holds nobody with the job's newest committed step (its replicas were away,
  // a SIGSTOP, a partition): it must not train from an older one. When the job finished there,
  // this replica has nothing left to do (job_finished()); else the replicas that held it are
  // gone, and only a checkpoint has it.
  bool stale(const Formed& f) {
    int64_t newest = 0;
    for (const Arrival& a : f.members) newest = std::max(newest, a.step);
    const Quorums::Known known = quorums.known();
    if (newest >= known.step) return false;
    if (known.finished) {
      finished_elsewhere = true;
      quorums.note(
          fmt::format("the job finished at step {} while this replica was at step {}: "
                      "nothing left to train",
                      known.step, step));
      return true;
    }
    throw RendezvousError(fmt::format(
        "[{}] fault tolerance: quorum {}'s replicas hold step {} at most, but the job committed "
        "step {}: every replica that held it is gone. Going on would train from an older state; "
        "resume the job from its last checkpoint instead",
        o.replica_id, f.number, newest, known.step));
  }

  // The group of quorum `f` and, when committed steps differ, the healing.
  void form(const Formed& f) {
    InitOptions g = o.group;
    g.rank = f.rank;
    g.world_size = static_cast<int>(f.members.size());
    // Its rendezvous, and its hang reports, go through the coordination store, which outlives
    // every replica: one that stops or dies cannot freeze them (as it would a store that the
    // quorum's rank 0 hosted). Its keys are the quorum's: ddp/<run>/attempt_0/ft-q<N>/.
    g.master_addr = qo.host;
    g.master_port = qo.port;
    g.agent_store_run_id = qo.run;
    g.store_secret = secret;
    g.group_name = fmt::format("ft-q{}", f.number);
    g.process_defaults = false;
    // A failed step is recovered from and only noted: its error need not wait long for the
    // records of a peer that died on another host (the default wait is 3 s).
    if (!g.hang_report_wait) g.hang_report_wait = kFailureReportWait;
    if (group) retired.push_back(std::move(group));  // a failed group: left to its failure
    broken = true;
    group = make_process_group(g);
    // DDP and the sampler follow the new group, back at the last committed step.
    bound = state::group_bound(state);
    for (state::GroupBound* b : bound) b->regroup(group);

    // The replicas behind receive the state of the first rank holding the newest step. Before
    // any step committed, every replica receives rank 0's: the job's initial state, as DDP's
    // init_sync gives it.
    int64_t newest = 0;
    for (const Arrival& a : f.members) newest = std::max(newest, a.step);
    int source = -1;
    bool behind = false;
    for (int r = 0; r < static_cast<int>(f.members.size()); ++r) {
      if (f.members[r].step == newest && source < 0) source = r;
      behind |= f.members[r].step < newest;
    }
    if (newest == 0 && f.members.size() > 1) {
      heal(source, f.rank != source, f.number);
    } else if (behind) {
      heal(source, step < newest, f.number);
    }
    for (state::GroupBound* b : bound) b->committed();
    quorum = f.number;
    rank = f.rank;
    size = static_cast<int>(f.members.size());
    broken = false;
    if (rank == 0) quorums.formed(quorum, step);
    quorums.watch(quorum);
  }

  // The whole TrainingState from rank `source` to the ranks behind, over the new group: a
  // snapshot encoded as a checkpoint's bytes, broadcast (its size first).
  void heal(int source, bool receive, int64_t number) {
    const auto started = std::chrono::steady_clock::now();
    std::string bytes;
    if (group->rank() == source) {
      CheckpointMeta meta;
      meta.step = step;
      bytes = encode_checkpoint(state.snapshot(), meta);
    }
    at::Tensor size_of = at::tensor({static_cast<int64_t>(bytes.size())}, at::kLong);
    group->broadcast(size_of, source).wait();
    at::Tensor payload = at::empty({size_of.item<int64_t>()}, at::kByte);
    if (group->rank() == source) std::memcpy(payload.data_ptr(), bytes.data(), bytes.size());
    group->broadcast(payload, source).wait();
    if (!receive) return;
    const DecodedCheckpoint got =
        decode_checkpoint(std::string_view(static_cast<const char*>(payload.data_ptr()),
                                           payload.numel()),
                          fmt::format("the state healing {} from rank {}", o.replica_id, source));
    state.restore(got.snapshot, group->rank(), group->size());
    if (step == 0) return;  // the first quorum's copy of rank 0's state, not a healing
    quorums.note(
        fmt::format("healed: step {}'s state ({:.2f} MB) from rank {} of quorum {}, in {:.0f} ms",
                    step, static_cast<double>(payload.numel()) / 1e6, source, number,
                    std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() -
                                                              started)
                        .count()));
  }

  void allreduce(at::Tensor& t) {
    if (!error.empty() || broken) return;
    try {
      group->all_reduce(t, ReduceOp::kAvg).wait();
    } catch (const Error& e) {
      error = e.what();
    }
  }

  // The vote, with the news the quorum must agree on: whether a replica waits to join. Each
  // member's watcher looks at the store at its own moment (the step does not wait for it); the
  // MIN over "nobody waits" makes all of them re-form at the same step boundary, or none (one
  // that went alone would leave the others waiting in a collective).
  bool should_commit() {
    if (broken) return dropped();
    bool waits = false;
    try {
      waits = quorums.someone_waits(quorum);
    } catch (const Error& e) {
      if (error.empty()) error = e.what();
    }
    at::Tensor vote = at::tensor({error.empty() ? 1 : 0, waits ? 0 : 1}, at::kInt);
    try {
      group->all_reduce(vote, ReduceOp::kMin).wait();
    } catch (const Error& e) {
      if (error.empty()) error = e.what();
      return dropped();
    }
    if (vote[0].item<int>() != 1) {
      if (error.empty()) error = "another replica's step failed";
      return dropped();
    }
    regroup = vote[1].item<int>() == 0;
    ++step;
    for (state::GroupBound* b : bound) b->committed();
    // The store learns each commit: a quorum of replicas that all missed it (every holder gone,
    // restarted ones at step 0) is then refused (stale()), not trained from an older state. Sent
    // by the watcher, not waited for; a store that fails it fails a later step's vote (the
    // watcher's looks fail too).
    if (rank == 0) quorums.record_commit(quorum, step);
    return true;
  }

  // The current group; before the first quorum, a group of this replica alone.
  std::shared_ptr<ProcessGroup> process_group() {
    if (!group) {
      InitOptions g = o.group;
      g.rank = 0;
      g.world_size = 1;
      g.group_name = "ft-alone";
      g.process_defaults = false;
      group = make_process_group(g);
    }
    return group;
  }

  // The step is not applied here; the next start_quorum() re-forms.
  bool dropped() {
    broken = true;
    quorums.note(fmt::format("step {} not committed (quorum {}, rank {} of {}): {}", step, quorum,
                             rank, size, error.substr(0, 400)));
    return false;
  }

  ManagerOptions o;
  const std::string secret;  // the coordination store's
  const QuorumOptions qo;
  TrainingState& state;
  Quorums quorums;
  int64_t quorum = -1;  // the quorum this replica runs in (-1: none yet)
  int rank = -1, size = 0;
  int64_t step = 0;  // committed steps
  std::shared_ptr<ProcessGroup> group;
  // What follows the group (DDP, the sampler): found in `state` at each formation, not per step.
  std::vector<state::GroupBound*> bound;
  std::vector<std::shared_ptr<ProcessGroup>> retired;  // failed groups, destroyed with the manager
  bool finished_elsewhere = false;                     // see job_finished()
  bool broken = true;    // no usable group: none yet, or its step failed
  bool regroup = false;  // the quorum agreed to re-form at the next step (a replica waits)
  std::string error;   // this step's first error
};

Manager::Manager(TrainingState& state, ManagerOptions options)
    : impl_(std::make_unique<Impl>(state, std::move(options))) {}
Manager::~Manager() = default;

void Manager::start_quorum() { impl_->start_quorum(); }

ProcessGroup& Manager::group() {
  if (!impl_->group) throw ConfigError("ft::Manager::group() before the first start_quorum()");
  return *impl_->group;
}
std::shared_ptr<ProcessGroup> Manager::process_group() { return impl_->process_group(); }
int Manager::rank() const { return impl_->rank; }
int Manager::num_participants() const { return impl_->size; }
int64_t Manager::quorum_id() const { return impl_->quorum; }
int64_t Manager::current_step() const { return impl_->step; }
void Manager::allreduce(at::Tensor& tensor) { impl_->allreduce(tensor); }
void Manager::report_error(const std::string& what) {
  if (impl_->error.empty()) impl_->error = what;
}
const std::string& Manager::errored() const { return impl_->error; }
bool Manager::should_commit() { return impl_->should_commit(); }
bool Manager::job_finished() const { return impl_->finished_elsewhere; }
void Manager::finish() {
  if (!impl_->broken) impl_->quorums.finish(impl_->step);
}

}  // namespace ddp::ft
