// Joining a round: ElasticRounds::join's phases, in the order one step goes through them (Note
// [Restart rounds] in rounds.h): the shape, the round, entering it, closing it, admission.
#include <algorithm>
#include <charconv>
#include <climits>  // INT_MAX
#include <set>
#include <thread>
#include <tuple>  // std::tie
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/net.h"  // pick_free_port: the workers' store on etcd
#include "elastic.h"
#include "output.h"   // note
#include "summary.h"  // format_seconds

namespace ddp::launcher {
namespace {

using Clock = store::Clock;
using std::chrono::milliseconds;
using Arrivals = MembershipPolicy::Arrivals;

// How often a node waiting to join looks at the round.
constexpr milliseconds kWaitStep{100};

double seconds_of(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// A fixed node's rank: its id ("?", an unknown node, ranks last).
int fixed_rank(const RoundEntry& e) {
  int rank = INT_MAX;
  std::from_chars(e.id.data(), e.id.data() + e.id.size(), rank);
  return rank;
}

// The order of a round's nodes. Fixed: their node ranks. Elastic (Note [Elastic rounds]): the
// newest previous round first, then the node ranks there, then newcomers by arrival.
void rank_members(std::vector<RoundEntry>& nodes, bool fixed_ranks) {
  std::ranges::sort(nodes, [fixed_ranks](const RoundEntry& a, const RoundEntry& b) {
    if (fixed_ranks) return fixed_rank(a) < fixed_rank(b);
    if (a.last_round != b.last_round) return a.last_round > b.last_round;
    if (a.last_rank != b.last_rank) return a.last_rank < b.last_rank;
    return a.arrival < b.arrival;
  });
}

}  // namespace

// Every step is a short bounded call, repeated until the join timeout: the store's host may not
// listen yet, or may be starting again (Note [Restart rounds]). Repeating is safe because a node
// enters a round once (Join::index).
std::optional<Membership> ElasticRounds::join(int next, const std::function<bool()>& stop) {
  Join j{.next = next, .end = Clock::now() + join_timeout_};
  if (go_home_) return_home();
  if (go_away_) {  // its host leaves: the next round begins where the store goes next
    go_away_ = false;
    move_store("is going away with its host, which leaves the job");
  }
  while (true) {
    if (stop && stop()) return std::nullopt;
    if (std::optional<Membership> m = join_step(j)) return m;
    if (j.lacking && someone_at_home()) {  // Note [Moving the store]: a healed partition
      return_home();
      j = Join{.next = j.next, .end = j.end};
      continue;
    }
    if (j.short_of) too_few(j.round, *j.short_of, Clock::now() + kCallTime);
    if (j.lacking && Clock::now() >= j.end) no_majority(j.round, *j.lacking);
    if (!j.last_error.empty() && Clock::now() >= j.end) unreachable(j.last_error);
    if (on_etcd()) {
      store_.wait_for_change(kPollInterval);  // a watch: back at once when anything moves
    } else {
      std::this_thread::sleep_for(kWaitStep);
    }
  }
}

std::optional<Membership> ElasticRounds::join_step(Join& j) {
  const auto now = Clock::now();
  const auto deadline = now + kCallTime;
  try {
    j.last_error.clear();
    store_.beat(id_, deadline);
    unreachable_since_.reset();
    settle_moved_store(deadline);
    report_again(deadline);
    check_shape(j, deadline);
    find_round(j, deadline);
    if (!enter(j, deadline)) return std::nullopt;
    if (std::optional<int> closed = close(j, now, deadline)) {
      return admit_or_wait(j, *closed, deadline);
    }
  } catch (const store::RefusedError& e) {  // another job's store, a wrong secret: final
    throw RendezvousError(fmt::format("{}: {}", where(), e.what()));
  } catch (const RendezvousError& e) {  // the store did not answer (in time): asked again
    store_silent(j, e);
  }
  return std::nullopt;
}

void ElasticRounds::check_shape(Join& j, Deadline deadline) {
  if (j.shape_checked) return;
  const std::string shape =
      fmt::format("--nnodes {}, --nproc-per-node {}", policy_.nnodes(), c_.nproc_per_node);
  const std::string job = store_.claim_shape(shape, deadline);
  if (job != shape) {
    throw Error(fmt::format(
        "{} was started with {}, but this job's first node with {}: give every node the same "
        "--nnodes and --nproc-per-node",
        where(), shape, job));
  }
  j.shape_checked = true;
}

// The newest round, at least j.next; refused when there is none to run. A fixed job's restart
// count is the round itself, so a round past --max-restarts is refused before anything else;
// an elastic job that finished while this node waited ended well, whatever its failures.
void ElasticRounds::find_round(Join& j, Deadline deadline) {
  const int round = store_.raise_round(j.next, deadline);
  if (round != j.round) {
    j.round = round;
    j.index = -1;
    j.min_seen.reset();
  }
  const bool counts_rounds = policy_.restarts == MembershipPolicy::Restarts::kRounds;
  if (counts_rounds) check_restarts(round, deadline);
  check_round_before(round, deadline);
  if (!counts_rounds) check_restarts(round, deadline);
}

// The round before ended for good: a node finished it (its workers all exited 0, so it is gone),
// or its failure was final (Note [Final failures] in launcher.cpp).
void ElasticRounds::check_round_before(int round, Deadline deadline) {
  if (round == 0) return;
  const char* name = policy_.round_name();
  if (std::optional<std::string> finished = store_.finished(round - 1, deadline)) {
    if (policy_.arrivals == Arrivals::kWaitToBeAdmitted && last_round_ != round - 1) {
      throw JobEnded(fmt::format("the elastic job finished in round {} ({} was first to finish) "
                                 "while this node waited to be admitted",
                                 round - 1, *finished),
                     true);
    }
    throw Error(fmt::format("{}: {} finished {} {} (its workers exited 0) while {}", where(),
                            *finished, name, round - 1,
                            policy_.fixed_ranks()
                                ? "another node failed, so the job cannot restart without it: "
                                  "not restarting"
                                : "this node's failed: not starting again"));
  }
  if (std::optional<std::string> final = store_.final_failure(round - 1, deadline)) {
    throw Error(fmt::format("{}: {} {} ended with a final failure ({}): no node {}", where(), name,
                            round - 1, *final,
                            policy_.fixed_ranks() ? "restarts" : "starts again"));
  }
}

// What --max-restarts counts (Note [Membership policy]): the rounds, or the failures.
void ElasticRounds::check_restarts(int round, Deadline deadline) {
  if (policy_.restarts == MembershipPolicy::Restarts::kRounds) {
    if (round <= c_.max_restarts) return;
    throw Error(fmt::format(
        "{}: the job is at restart round {}, past --max-restarts {}: it has used its restarts, "
        "so this node does not start its workers again",
        where(), round, c_.max_restarts));
  }
  const int failures = store_.failures(deadline);
  if (failures <= c_.max_restarts) return;
  throw Error(fmt::format(
      "{}: the elastic job has failed {} time(s), past --max-restarts {}: it has used its "
      "restarts, so no node starts its workers again (nodes leaving or joining do not count)",
      where(), failures, c_.max_restarts));
}

// Counts this node into j.round, once, with its entry; with fixed ranks, claims its rank first.
// False when it must go on to the next round instead.
bool ElasticRounds::enter(Join& j, Deadline deadline) {
  if (j.index >= 0) return true;
  if (policy_.node_rank && store_.claim_rank(j.round, *policy_.node_rank, deadline) > 1) {
    if (c_.ft && !store_.failed(j.round, deadline)) return take_predecessors_place(j, deadline);
    end_predecessors_round(j, deadline);
    return false;
  }
  j.index = store_.count_in(j.round, deadline);
  store_.write_entry(j.round, j.index,
                     {.id = id_,
                      .host = host_,
                      .addr = on_etcd() ? store_.local_address() : hosted_.addr,
                      .last_round = last_round_,
                      .last_rank = last_rank_,
                      .last_members = known_round().members},
                     deadline);
  return true;
}

// Fixed ranks: this node's earlier ddprun took part in j.round, so its workers are gone (unless
// that ddprun is still alive: two were given this --node-rank). Ends the round, so that every
// node restarts together in the next.
void ElasticRounds::end_predecessors_round(Join& j, Deadline deadline) {
  refuse_if_alive(deadline);
  store_.write_first_failure(
      j.round,
      fmt::format("{}: its ddprun started again, so its workers of round {} are gone", where(),
                  j.round),
      /*final=*/false, Clock::now() + kCallTime);  // the watch took longer than `deadline` leaves
  note(
      fmt::format("this node's previous ddprun took part in {} {}; ending that round so that "
                  "every node restarts together",
                  policy_.round_name(), j.round));
  j.next = j.round + 1;
}

// --ft (Note [Per-step fault tolerance] in ddp/fault_tolerance.h): the others' workers go on
// in j.round without this node's, which were lost with its earlier ddprun. This node takes its
// earlier ddprun's place in j.round instead of ending it: it does not count in again (the round
// holds its entry already), and its workers join the replicas' next quorum and are healed there.
bool ElasticRounds::take_predecessors_place(Join& j, Deadline deadline) {
  refuse_if_alive(deadline);
  note(
      fmt::format("this node's previous ddprun took part in {} {}; with --ft the other nodes' "
                  "workers go on, and this node's start again in that round and are healed",
                  policy_.round_name(), j.round));
  // With fixed ranks an arrival's index only says that it is admitted (below the closing count):
  // the node's rank is --node-rank.
  j.index = 0;
  return true;
}

// Throws when another ddprun of this node rank is alive (its count moves in kAliveWindow).
void ElasticRounds::refuse_if_alive(Deadline deadline) {
  const int64_t before = store_.beats(id_, deadline);
  std::this_thread::sleep_for(kAliveWindow);
  const int64_t after = store_.beats(id_, Clock::now() + kCallTime);
  if (after == before) return;
  throw Error(fmt::format(
      "{}: another ddprun of node {} is running (it keeps answering in the agent store): two "
      "ddprun were given --node-rank {}. Give each node its own --node-rank, 0 to {}.",
      where(), *policy_.node_rank, *policy_.node_rank, policy_.max_nodes - 1));
}

// How many j.round admits, once that is decided (by this node or another). A round that failed
// before it closed (a node's ddprun started again in it) gives way to the next one.
std::optional<int> ElasticRounds::close(Join& j, Clock::time_point now, Deadline deadline) {
  if (std::optional<int> closed = store_.closed(j.round, deadline)) return closed;
  const int count = store_.arrivals(j.round, deadline);
  if (std::optional<int> admitted = admissible(j, count, now, deadline)) {
    return store_.close(j.round, *admitted, deadline);
  }
  if (store_.failed(j.round, deadline)) j.next = j.round + 1;
  return std::nullopt;
}

// The one place that decides whether j.round may begin, and with how many of its `count`
// arrivals; nullopt while it may not (j.short_of: the join timeout found it below MIN).
// With fixed ranks every node is in every round and enters R only once it has left R - 1, so
// R begins when all N are in. Elastic: only once the round before is over (nodes waiting to be
// admitted enter R while R - 1 runs), at MAX at once, at MIN once no node of the last round is
// on its way (the job's first round: after the last call too), and with a majority of the last
// round's nodes (Note [Elastic rounds]).
std::optional<int> ElasticRounds::admissible(Join& j, int count, Clock::time_point now,
                                             Deadline deadline) {
  if (policy_.arrivals == Arrivals::kWaitToBeAdmitted && !over(j.round - 1, deadline)) {
    j.end = now + join_timeout_;  // the round before still runs
    if (!j.said_waiting) {
      note(
          fmt::format("elastic round {} still runs; this node joins at the next one", j.round - 1));
      j.said_waiting = true;
    }
    return std::nullopt;
  }
  std::optional<int> admitted;
  if (count >= policy_.max_nodes) {
    admitted = policy_.max_nodes;
  } else if (count >= policy_.min_nodes) {
    if (!j.min_seen) j.min_seen = now;
    const auto waited = now - *j.min_seen;
    if (waited >= join_timeout_) {
      admitted = count;
    } else {
      // One stopping its workers with a checkpoint can take longer than the last call.
      const std::vector<RoundEntry> here = store_.entries(j.round, count, milliseconds(1000));
      const KnownRound last = known_last(j.round, here, deadline);
      const bool first_round = last.round < 0;
      if ((!first_round || waited >= last_call_) && !awaited(last, here, deadline)) {
        admitted = count;
      }
    }
  } else {
    j.min_seen.reset();
  }
  if (admitted && (!policy_.majority || majority(j, *admitted, deadline))) {
    return admitted;
  }
  if (now >= j.end && !admitted) j.short_of = count;
  return std::nullopt;
}

bool ElasticRounds::majority(Join& j, int admitted, Deadline deadline) {
  // Every admitted entry is read: one that is not there within a call (its node died between
  // counting in and writing it) might carry a newer round, so the round is not closed over it.
  const std::vector<RoundEntry> here = store_.entries(j.round, admitted, kCallTime);
  if (const auto unknown =
          std::ranges::find_if(here, [](const RoundEntry& e) { return e.id == "?"; });
      unknown != here.end()) {
    store_.write_first_failure(
        j.round,
        fmt::format("its arrival {} never wrote its entry (its ddprun died while joining): the "
                    "round starts over",
                    unknown->arrival),
        /*final=*/false, Clock::now() + kCallTime);
    j.next = j.round + 1;
    return false;
  }
  const KnownRound last = known_last(j.round, here, deadline);
  std::set<std::string> left;
  for (const std::string& id : last.members) {
    if (store_.left(last.round, id, deadline)) left.insert(id);
  }
  const Quorum q = quorum_of(last, here, left);
  if (q.ok()) {
    j.lacking.reset();
    return true;
  }
  if (!j.lacking) {
    note(fmt::format("{} {} waits for a majority of the {} node(s) of {} {} ({} needed, {} here)",
                     policy_.round_name(), j.round, q.present.size() + q.missing.size(),
                     policy_.round_name(), last.round, q.needed, q.present.size()));
  }
  j.lacking = q;
  return false;
}

KnownRound ElasticRounds::known_last(int round, const std::vector<RoundEntry>& here,
                                     Deadline deadline) {
  std::string conflict;
  KnownRound last = newest_round(store_.last_round(deadline), here, &conflict);
  if (!conflict.empty()) {
    throw Error(fmt::format(
        "{}: {} {} cannot begin: {}. The job's rounds no longer form one line (a store written "
        "by another program, or ddprun of different versions in one job); start the job again "
        "with a new --rdzv-id.",
        where(), policy_.round_name(), round, conflict));
  }
  return last;
}

std::optional<Membership> ElasticRounds::admit_or_wait(Join& j, int closed, Deadline deadline) {
  if (j.index < closed) return admit(j.round, closed, j.index, deadline);
  note(
      fmt::format("{} {} began with {} node(s) before this node arrived (--nnodes {}): this "
                  "node waits to be admitted when the job next re-forms{}",
                  policy_.round_name(), j.round, closed, policy_.nnodes(),
                  closed >= policy_.max_nodes ? ", which it does when a node leaves (it runs at "
                                                "its maximum)"
                                              : ", at once"));
  j.next = j.round + 1;
  return std::nullopt;
}

Membership ElasticRounds::admit(int round, int n, int index, Deadline deadline) {
  // Every node must order the same entries: wait for a late one as long as a call may take
  // (an entry still missing then belongs to a node that died between counting in and writing
  // it, and every node reads it as unknown).
  std::vector<RoundEntry> nodes = store_.entries(round, n, kCallTime);
  rank_members(nodes, policy_.fixed_ranks());
  const auto mine =
      std::ranges::find_if(nodes, [&](const RoundEntry& e) { return e.arrival == index; });
  const int rank = policy_.node_rank.value_or(static_cast<int>(mine - nodes.begin()));
  if (!policy_.fixed_ranks()) {
    std::vector<std::string> hosts;
    for (const RoundEntry& e : nodes) hosts.push_back(e.host);
    note(
        fmt::format("elastic round {}: {} node(s) ({} allowed), node ranks {}; this node is "
                    "node {}",
                    round, n, policy_.nnodes(), fmt::join(hosts, ", "), rank));
  }
  lineage_ = store_.claim_lineage(lineage_, deadline);
  last_round_ = round;
  last_rank_ = rank;
  members_ = std::move(nodes);
  store_.record_round(known_round(), deadline);  // what a round without this node counts against
  known_failures_ = store_.failures(deadline);
  const bool counts_rounds = policy_.restarts == MembershipPolicy::Restarts::kRounds;
  Membership m{.round = round,
               .node_rank = rank,
               .nnodes = n,
               .restarts = counts_rounds ? round : known_failures_,
               .store_addr = moved() ? store_host_ : "",
               .store_port = moved() ? store_port_ : 0,
               .lineage = lineage_};
  if (on_etcd()) std::tie(m.store_addr, m.store_port) = workers_store(round, rank, deadline);
  return m;
}

std::pair<std::string, int> ElasticRounds::workers_store(int round, int rank, Deadline deadline) {
  if (rank == 0) {
    const std::string address = members_.front().addr;
    const int port = net::pick_free_port();
    store_.set_workers_store(round, address, port, deadline);
    return {address, port};
  }
  // Node rank 0 writes it as it is admitted, as this node is: a join step's time is plenty.
  return store_.workers_store(round, join_timeout_);
}

// The store did not answer this step. It moves (where it can: Note [Moving the store]) at once
// when its host exited, else after kStoreLost without an answer (polls and reports count too);
// then the rendezvous starts over there.
void ElasticRounds::store_silent(Join& j, const RendezvousError& e) {
  j.last_error = e.what();
  const bool exited = dynamic_cast<const store::StoreExitedError*>(&e) != nullptr;
  if (!unreachable_since_) unreachable_since_ = Clock::now();
  if (!exited && Clock::now() - *unreachable_since_ < kStoreLost) return;
  if (!move_store(fmt::format("stopped answering ({})", e.what()))) return;
  j.end = Clock::now() + join_timeout_;
  j.last_error.clear();
  j.round = -1;
  j.shape_checked = false;
}

void ElasticRounds::report_again(Deadline deadline) {
  if (!unreported_failure_ || unreported_.round < 0) return;
  if (!store_.write_first_failure(unreported_.round, unreported_.line, unreported_.final,
                                  deadline)) {
    known_failures_ = store_.count_failure(deadline);  // this node's was the first
  }
  note(fmt::format("told the other nodes now that this node failed in {} {}", policy_.round_name(),
                   unreported_.round));
  unreported_failure_ = false;
  unreported_ = {};
}

void ElasticRounds::too_few(int round, int count, Deadline deadline) {
  if (policy_.fixed_ranks()) missing_ranks(round, deadline);
  std::vector<std::string> present;
  std::vector<std::string> missing;
  const std::vector<RoundEntry> here = store_.entries(round, count, milliseconds(1000));
  for (const RoundEntry& e : here) present.push_back(e.host);
  for (size_t r = 0; r < members_.size(); ++r) {
    const RoundEntry& m = members_[r];
    if (std::ranges::none_of(here, [&](const RoundEntry& e) { return e.id == m.id; })) {
      missing.push_back(fmt::format("{} (node {} of round {})", m.host, r, last_round_));
    }
  }
  throw RendezvousError(fmt::format(
      "{}: {} node(s) joined elastic round {} within {} (the join timeout), fewer than the "
      "minimum of {} (--nnodes {}); present: {}; missing: {}. Start ddprun on more nodes, or "
      "lower MIN.",
      where(), count, round, format_seconds(seconds_of(join_timeout_)), policy_.min_nodes,
      policy_.nnodes(), present.empty() ? "none" : fmt::format("{}", fmt::join(present, ", ")),
      missing.empty() ? "no node of an earlier round (this job never ran)"
                      : fmt::format("{}", fmt::join(missing, ", "))));
}

void ElasticRounds::no_majority(int round, const Quorum& q) {
  throw RendezvousError(fmt::format(
      "{}: elastic round {} could not begin within {} (the join timeout): its nodes hold {} of "
      "the {} node(s) of elastic round {} that have not left, and a round needs a majority of "
      "them ({}), so that the two sides of a divided job never both train; present: {}; "
      "missing: {}. The missing nodes are cut off (a network partition) or gone: once the "
      "network heals the job goes on; if they are gone for good, start the job again from its "
      "last checkpoint with a new --rdzv-id.",
      where(), round, format_seconds(seconds_of(join_timeout_)), q.present.size(),
      q.present.size() + q.missing.size(), q.last.round, q.needed,
      q.present.empty() ? "none" : fmt::format("{}", fmt::join(q.present, ", ")),
      fmt::join(q.missing, ", ")));
}

// Fixed ranks: the ranks that have not entered `round` are named.
void ElasticRounds::missing_ranks(int round, Deadline deadline) {
  std::vector<int> missing;
  for (int k = 0; k < policy_.max_nodes; ++k) {
    if (!store_.rank_claimed(round, k, deadline)) missing.push_back(k);
  }
  throw RendezvousError(fmt::format(
      "{}: {}/{} nodes joined restart round {} within {} (the rendezvous timeout); missing "
      "nodes: {}. Start ddprun on every node with the same --nnodes, --rdzv-id, --master-addr "
      "and --master-port; a node whose ddprun was killed must run it again.",
      where(), policy_.max_nodes - static_cast<int>(missing.size()), policy_.max_nodes, round,
      format_seconds(seconds_of(join_timeout_)), fmt::join(missing, ", ")));
}

void ElasticRounds::unreachable(const std::string& error) const {
  if (on_etcd()) {
    throw RendezvousError(fmt::format(
        "{}: could not reach etcd ({}, --rdzv-endpoint) within {}: {}. Start etcd there, or "
        "check the endpoints and, for TLS and auth, --rdzv-conf; a member cut off from the "
        "majority of its cluster answers nothing.",
        where(), c_.etcd_endpoints, format_seconds(seconds_of(join_timeout_)), error));
  }
  const bool node_zero = policy_.store_host == MembershipPolicy::StoreHost::kNodeZero;
  throw RendezvousError(fmt::format(
      "{}: could not reach the {} agent store at {}:{} ({}) within {}: {}. {} hosts it: it has "
      "not started, has exited, or listens on another address or port.",
      where(), node_zero ? "job's" : "elastic job's", c_.master_addr, c_.master_port,
      node_zero ? "--master-addr, --master-port" : "--rdzv-endpoint",
      format_seconds(seconds_of(join_timeout_)), error,
      node_zero ? "Node 0's ddprun" : "The ddprun on that host"));
}

}  // namespace ddp::launcher
