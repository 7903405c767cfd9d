// Elastic rounds (see Note [Elastic rounds] in elastic.h): construction, the running round, its
// end, the nodes' signs of life, and moving the store. Joining is in round_join.cpp.
#include "elastic.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <thread>

#include <fmt/format.h>

#include "base/net.h"        // host_name
#include "base/random_id.h"  // random_hex: node ids, the lineage
#include "etcd.h"            // etcd_key_value: --rdzv-backend etcd
#include "output.h"          // note
#include "store/bind.h"      // ip_of
#include "store/net.h"       // resolve, format_endpoint
#include "store/protocol.h"  // job_key
#include "summary.h"         // format_seconds

namespace ddp::launcher {
namespace {

using Clock = store::Clock;
using std::chrono::milliseconds;

// How often the store's host, waiting for the others to be done, looks at the counts.
constexpr milliseconds kWaitStep{100};

double seconds_of(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A node's id in the store (Note [Membership policy]): its rank when ranks are given, else one
// of its own, so that a ddprun started again is a new node.
std::string node_id(const MembershipPolicy& policy, const std::string& host, int pid) {
  if (policy.node_rank) return std::to_string(*policy.node_rank);
  return fmt::format("{}:{}:{}", host, pid, random_hex(3));
}

}  // namespace

ElasticRounds::ElasticRounds(const LaunchConfig& config, const EnvMap& base_env,
                             const std::string& run_id, const std::string& secret)
    : c_(config), policy_(MembershipPolicy::of(config)), job_key_(store::job_key(secret, run_id)),
      run_id_(run_id), host_(net::host_name()), pid_(static_cast<int>(::getpid())),
      id_(node_id(policy_, host_, pid_)),
      join_timeout_(std::chrono::duration_cast<milliseconds>(
          config.rdzv_timeout.value_or(Seconds(kDefaultRendezvousTimeout)))),
      last_call_(std::chrono::duration_cast<milliseconds>(config.last_call_timeout)),
      hosted_(host_stores(config, policy_, base_env, job_key_, secret)),
      store_host_(config.master_addr), store_port_(config.master_port),
      store_(run_id, first_store()), lineage_(random_hex(8)) {}

std::unique_ptr<KeyValue> ElasticRounds::first_store() const {
  if (on_etcd()) {
    EtcdOptions o = etcd_options(c_.etcd_endpoints, c_.rdzv_conf);
    o.who = policy_.node_rank ? fmt::format("ddprun (node {})", *policy_.node_rank)
                              : fmt::format("ddprun ({})", host_);
    return etcd_key_value(o);
  }
  if (policy_.store_host == MembershipPolicy::StoreHost::kNodeZero && hosted_.server) {
    return agent_store_key_value(
        client_options(hosted_.server->local_address(), hosted_.server->port()));
  }
  return agent_store_key_value(client_options(store_host_, store_port_));
}

// --- the running round

std::optional<std::string> ElasticRounds::failure_elsewhere(int round) {
  return poll_(
      [&](Deadline deadline) -> std::optional<std::string> {
        store_.beat(id_, deadline);
        unreachable_since_.reset();
        std::optional<std::string> failed = store_.failure(round, deadline);
        if (failed) watch_members(deadline);
        return failed;
      },
      [&] {  // counts towards moving the store (Note [Moving the store])
        if (!unreachable_since_) unreachable_since_ = Clock::now();
      });
}

std::optional<std::string> ElasticRounds::regroup(int round, bool now) {
  if (!policy_.reforms()) return std::nullopt;
  const auto t = Clock::now();
  if (!now && t < next_regroup_poll_) return std::nullopt;
  next_regroup_poll_ = t + kPollInterval;
  const auto deadline = t + kCallTime;
  try {
    if (store_.failed(round, deadline)) return std::nullopt;  // a failure wins
    if (std::optional<std::string> why = store_.regroup(round, deadline)) {
      if (store_.store_goes_home(round, deadline)) go_home_ = true;
      if (store_.store_goes_away(round, deadline)) go_away_ = true;
      store_.saw_regroup(round, deadline);  // a leaving store host waits for it
      return why;
    }
    if (auto home = waiting_at_home(round)) return home;
    if (static_cast<int>(members_.size()) >= policy_.max_nodes) return std::nullopt;
    // A node waiting to be admitted while the job runs below its maximum: re-form now.
    if (store_.arrivals(round + 1, deadline) == 0) return std::nullopt;
    const RoundEntry waiting = store_.entries(round + 1, 1, milliseconds(1000)).front();
    return store_.write_regroup(
        round,
        fmt::format("node {} waits to join; the job runs on {} of at most {} nodes", waiting.host,
                    members_.size(), policy_.max_nodes),
        deadline);
  } catch (const Error&) {
    return std::nullopt;  // failure_elsewhere() says when the store does not answer
  }
}

bool ElasticRounds::announce_leaving(int round, const std::string& why) {
  if (!policy_.reforms()) return false;  // the signal ends the whole job
  try {
    const auto deadline = Clock::now() + kCallTime;
    store_.leave(round, id_, deadline);  // nobody waits for this node
    if (hosts_job_store()) store_.send_store_away(round, deadline);
    store_.write_regroup(round, fmt::format("{} leaves: {}", where(), why), deadline);
    leaving_ = true;
  } catch (const Error& e) {
    note(fmt::format("could not tell the other nodes that this node leaves: {}", e.what()));
  }
  return true;  // the others go on either way: they find this node gone
}

std::optional<std::string> ElasticRounds::report_failure(int round, const std::string& what,
                                                         bool final) {
  const std::string line = fmt::format("{}: {}", where(), what);
  try {
    std::optional<std::string> first =
        store_.write_first_failure(round, line, final, Clock::now() + kCallTime);
    watch_members(Clock::now() + kCallTime);
    if (first) return first;
    known_failures_ = store_.count_failure(Clock::now() + kCallTime);  // by the first reporter
  } catch (const Error& e) {
    unreported_failure_ = true;  // a store that moves carries it (Note [Moving the store])
    unreported_ = {.round = round, .line = line, .final = final};
    if (!unreachable_since_) unreachable_since_ = Clock::now();
    note(fmt::format("could not tell the other nodes that this node failed: {}", e.what()));
  }
  return std::nullopt;
}

bool ElasticRounds::final_failure(int round) {
  return store_.failure_is_final(round, Clock::now() + kCallTime);
}

// --- the round's end

void ElasticRounds::leave(int round, bool failed_round, const std::function<bool()>& stop) {
  try {
    if (!failed_round && !leaving_) store_.finish(round, where(), Clock::now() + kCallTime);
    store_.end(round, Clock::now() + kCallTime);
    if (!hosted_.server) return;
    if (leaving_) {
      linger_for_readers(round, stop);
    } else {
      linger_for_others(round, failed_round, stop);
    }
  } catch (const Error& e) {
    if (hosted_.server) {
      note(fmt::format("ending {} {}: {}", policy_.round_name(), round, e.what()));
    }
  }
}

// The store's host leaves the elastic job: it goes once every other node has read the regroup,
// at most kFailureLinger, then the others move the store. A node that had not read it when its
// workers exited (they checkpoint with everyone's at the same step, so they may exit before its
// next poll) would take their exit for a failure and spend a restart.
void ElasticRounds::linger_for_readers(int round, const std::function<bool()>& stop) {
  const auto until = Clock::now() + kFailureLinger;
  const int others = static_cast<int>(members_.size()) - 1;
  while (Clock::now() < until && !(stop && stop())) {
    if (store_.regroup_readers(round, Clock::now() + kCallTime) >= others) break;
    std::this_thread::sleep_for(kWaitStep);
  }
}

// The store's host: the others may still need the store, to end or to learn that the job ended
// (Note [Restart rounds]). After a failure, its own or one reported meanwhile, they only need to
// read why, and stop.
void ElasticRounds::linger_for_others(int round, bool failed, const std::function<bool()>& stop) {
  const auto failure_limit =
      std::chrono::duration_cast<milliseconds>(c_.grace_period) + kFailureLinger;
  const auto limit = failed ? failure_limit : std::min(join_timeout_, kSuccessLinger);
  auto until = Clock::now() + limit;
  bool said = false;
  while (Clock::now() < until) {
    const auto deadline = Clock::now() + kCallTime;
    if (store_.ended(round, deadline) >= static_cast<int>(members_.size())) {
      // Nodes waiting to be admitted read "finished" within a join step: give them a moment.
      if (policy_.reforms() && store_.arrivals(round + 1, deadline) > 0) {
        std::this_thread::sleep_for(5 * kWaitStep + kPollInterval);
      }
      return;
    }
    if (stop && stop()) {
      note("stopped waiting for the other nodes (signal); they may lose the agent store");
      return;
    }
    if (!failed && store_.failed(round, deadline)) {
      failed = true;
      until = std::min(until, Clock::now() + failure_limit);
      continue;
    }
    if (!said) {
      note(fmt::format("waiting up to {} for the other nodes to be done with the agent store "
                       "that this node hosts",
                       format_seconds(seconds_of(limit))));
      said = true;
    }
    std::this_thread::sleep_for(kWaitStep);
  }
}

// --- the rounds' ends and the nodes' signs of life

bool ElasticRounds::over(int round, Deadline deadline) {
  if (round < 0) return true;
  if (store_.said_over(round, deadline)) return true;
  const std::optional<int> closed = store_.closed(round, deadline);
  if (!closed) return false;  // it has not begun
  // Begun, and not ended by any of its nodes: over only when none of them shows a sign of life.
  bool alive = false;
  for (const RoundEntry& e : store_.entries(round, *closed, milliseconds(1000))) {
    if (shows_life(e.id, store_.beats(e.id, deadline), kStaleAfter)) alive = true;
  }
  if (alive) return false;
  store_.write_regroup(round,
                       fmt::format("none of its nodes answered for {}",
                                   format_seconds(seconds_of(kStaleAfter))),
                       deadline);
  return true;
}

bool ElasticRounds::awaited(const KnownRound& last, const std::vector<RoundEntry>& here,
                            Deadline deadline) {
  for (const std::string& id : last.members) {
    const bool here_too =
        std::ranges::any_of(here, [&](const RoundEntry& h) { return h.id == id; });
    if (id == "?" || here_too) continue;
    if (store_.left(last.round, id, deadline)) continue;
    // A store just moved to has seen no sign of life from it yet: the first look counts as one,
    // so a node moving the store with the others is waited for kDeadAfter.
    if (shows_life(id, store_.beats(id, deadline), kDeadAfter)) return true;
  }
  return false;
}

void ElasticRounds::watch_members(Deadline deadline) {
  try {
    for (const RoundEntry& e : members_) {
      if (e.id == id_ || e.id == "?") continue;
      shows_life(e.id, store_.beats(e.id, deadline), kDeadAfter);  // recorded for awaited()
    }
  } catch (const Error&) {
    // The next round's close looks again.
  }
}

bool ElasticRounds::shows_life(const std::string& id, int64_t beats, milliseconds window) {
  if (beats < 0) return false;  // its etcd lease expired: its ddprun is dead or cut off
  const auto now = Clock::now();
  auto [it, fresh] = seen_alive_.try_emplace(id, beats, now);
  if (fresh || it->second.first != beats) {
    it->second = {beats, now};
    return true;
  }
  return now - it->second.second < window;
}

bool ElasticRounds::hosts_job_store() const {
  if (!moved()) return hosted_.server != nullptr;
  return hosted_.standby != nullptr && hosted_.addr == store_host_;
}

KnownRound ElasticRounds::known_round() const {
  KnownRound k{.round = last_round_};
  for (const RoundEntry& e : members_) k.members.push_back(e.id);
  return k;
}

// --- the store's place

store::ClientOptions ElasticRounds::client_options(const std::string& host, int port) const {
  store::ClientOptions o;
  o.host = host;
  o.port = port;
  o.key = job_key_;
  if (policy_.node_rank) {
    o.identity = fmt::format("ddprun of node {}, pid {} on {}", *policy_.node_rank, pid_, host_);
    o.who = fmt::format("ddprun (node {})", *policy_.node_rank);
    o.owner = "node 0's ddprun";
    return o;
  }
  o.identity = fmt::format("ddprun {} (elastic)", id_);
  o.who = fmt::format("ddprun ({})", host_);
  o.owner = host == c_.master_addr ? "the ddprun on the rendezvous endpoint's host"
                                   : fmt::format("the ddprun that took the store over ({})", host);
  return o;
}

void ElasticRounds::connect_to(const std::string& host, int port) {
  store_host_ = host;
  store_port_ = port;
  store_.connect(client_options(host, port));
}

// Note [Moving the store]
// The node hosting an elastic job's store may be reclaimed like any other. Every other node
// hosts a standby store from the start, at its address toward the endpoint and the endpoint's
// port (quiet, empty; it costs a socket and a thread), and its round entries carry that address.
// When the store stops answering for kStoreLost, each node that ran the last round moves to the
// same successor without asking anyone: the first node of that round, in node-rank order, whose
// address has not stopped answering (all know the round's nodes and addresses from its
// entries). Its standby store already listens, so nobody races its start; whoever arrives first
// writes there that the last round is over (it moved) and the failures so far (plus the round
// that failed with the store's host, which nobody could record). Rounds go on from the last
// round + 1, workers get the new MASTER_ADDR. A successor that is gone too is found the same way
// and skipped. A node started later knows only --rdzv-endpoint: when a store answers there again
// (the endpoint's host came back and its ddprun hosts a fresh store) with a node waiting in it,
// the moved job re-forms (SIGTERM, checkpoint) and moves its store back, admitting that node;
// nodes of a moved store that wait for a majority they lack go back there too (a healed
// partition: the others may be waiting at the endpoint, each side short of a majority alone).
// A store's host that leaves (SIGTERM) says so with its regroup (<R>/store_away): the others move
// the store on as they read it, before the next round, which must not begin in a store about to
// vanish.
// Nodes that lost the store and the node on the endpoint's host that has not (a network
// partition, not a death) would each go on, in two stores: the majority rule keeps all but one
// side from forming rounds (Note [Never two groups] in quorum.h); the nodes moving the store
// write their last round into it, so that it counts against that round from the start. A fixed
// job's store does not move (Note [Membership policy]).
bool ElasticRounds::move_store(const std::string& why) {
  if (!policy_.store_moves) return false;
  if (members_.empty()) return false;  // this node never ran: it knows no successor
  lost_.insert(store_host_);
  std::string error;
  for (const store::SocketAddress& a : store::resolve(store_host_, store_port_, &error)) {
    lost_.insert(store::ip_of(a));  // the endpoint may be a name; entries hold addresses
  }
  const auto next = std::ranges::find_if(members_, [&](const RoundEntry& e) {
    return e.addr != "-" && lost_.count(e.addr) == 0;
  });
  if (next == members_.end()) return false;
  const std::string from = store::format_endpoint(store_host_, store_port_);
  connect_to(next->addr, c_.master_port);
  moved_note_ = fmt::format("the store on {} {}; it moved to {} ({})", from, why,
                            store::format_endpoint(next->addr, c_.master_port), next->host);
  note(moved_note_);
  unreachable_since_.reset();
  return true;
}

void ElasticRounds::settle_moved_store(Deadline deadline) {
  if (moved_note_.empty()) return;
  if (last_round_ >= 0) {
    store_.claim_lineage(lineage_, deadline);  // the job's instance goes on in the new store
    store_.write_regroup(last_round_, moved_note_, deadline);
    store_.record_round(known_round(), deadline);  // Note [Never two groups]
  }
  store_.carry_failures(known_failures_ + (unreported_failure_ ? 1 : 0), deadline);
  moved_note_.clear();
  unreported_failure_ = false;
  unreported_ = {};
}

void ElasticRounds::return_home() {
  const std::string from = store::format_endpoint(store_host_, store_port_);
  connect_to(c_.master_addr, c_.master_port);
  moved_note_ =
      fmt::format("the job's store moved from {} back to the rendezvous endpoint", from);
  note(moved_note_);
  go_home_ = false;
}

bool ElasticRounds::someone_at_home() {
  if (!moved()) return false;
  const auto now = Clock::now();
  if (now < next_home_poll_) return false;
  next_home_poll_ = now + 4 * kPollInterval;
  try {
    store::ClientOptions o = client_options(c_.master_addr, c_.master_port);
    o.identity = fmt::format("ddprun {} (elastic, looking at the endpoint)", id_);
    RoundStore home(run_id_, o);
    const auto deadline = now + milliseconds(1000);
    const std::optional<int> r = home.round(deadline);
    return r && home.arrivals(*r, deadline) > 0;
  } catch (const Error&) {
    return false;  // nobody there (yet)
  }
}

std::optional<std::string> ElasticRounds::waiting_at_home(int round) {
  if (!someone_at_home()) return std::nullopt;
  const auto now = Clock::now();
  try {
    go_home_ = true;
    store_.send_store_home(round, now + kCallTime);  // for every node
    return store_.write_regroup(
        round,
        fmt::format("a node waits at the rendezvous endpoint {}: the job's store moves back there",
                    store::format_endpoint(c_.master_addr, c_.master_port)),
        now + kCallTime);
  } catch (const Error&) {
    return std::nullopt;  // the store did not answer: failure_elsewhere() says so
  }
}

std::unique_ptr<Rounds> make_elastic_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                            const std::string& run_id, const std::string& secret) {
  return std::make_unique<ElasticRounds>(config, base_env, run_id, secret);
}

}  // namespace ddp::launcher
