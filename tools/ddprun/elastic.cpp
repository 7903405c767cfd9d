// Elastic rounds (see Note [Elastic rounds] in elastic.h).
#include "elastic.h"

#include <sys/random.h>  // getrandom
#include <sys/socket.h>  // socket, connect, getsockname
#include <unistd.h>      // getpid, close

#include <algorithm>
#include <charconv>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/net.h"  // host_name
#include "output.h"    // note
#include "store/bind.h"
#include "store/client.h"
#include "store/net.h"
#include "store/protocol.h"  // job_key
#include "summary.h"         // format_seconds

namespace ddp::launcher {
namespace {

using Clock = store::Clock;
using std::chrono::milliseconds;

// How often a node waiting to join looks at the round.
constexpr milliseconds kWaitStep{100};

double seconds_of(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int parse_count(const std::string& text, const char* what) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    throw Error(fmt::format("the agent store's {} is '{}', not a number: another program wrote "
                            "to this job's keys",
                            what, text));
  }
  return value;
}

// One node's entry in a round: "<id> <host> <address> <last round> <last node rank>".
struct Entry {
  std::string id;
  std::string host;
  std::string addr;     // its address toward the store ("-": unknown), where it would host one
  int last_round = -1;  // the round it last ran in; -1: none (a new node)
  int last_rank = -1;   // its node rank there
  int arrival = 0;      // its arrival index in this round
};

std::string format_entry(const Entry& e) {
  return fmt::format("{} {} {} {} {}", e.id, e.host, e.addr, e.last_round, e.last_rank);
}

Entry parse_entry(const std::string& text, int arrival) {
  Entry e;
  e.arrival = arrival;
  std::istringstream in(text);
  if (!(in >> e.id >> e.host >> e.addr >> e.last_round >> e.last_rank)) {
    e = Entry{.id = "?", .host = "?", .addr = "-", .arrival = arrival};
  }
  return e;
}

// The order of a round's nodes (Note [Elastic rounds]): the newest previous round first, then
// the node ranks there, then newcomers by arrival.
void sort_members(std::vector<Entry>& nodes) {
  std::ranges::sort(nodes, [](const Entry& a, const Entry& b) {
    if (a.last_round != b.last_round) return a.last_round > b.last_round;
    if (a.last_rank != b.last_rank) return a.last_rank < b.last_rank;
    return a.arrival < b.arrival;
  });
}

std::string random_hex(int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) {
    unsigned char b = 0;
    if (::getrandom(&b, 1, 0) != 1) b = static_cast<unsigned char>(::getpid() >> (8 * (i % 4)));
    out += fmt::format("{:02x}", b);
  }
  return out;
}

// This host's address on the route to host:port (the source address the kernel picks: a UDP
// socket connected there sends nothing); "-" when there is none.
std::string address_toward(const std::string& host, int port) {
  std::string error;
  for (const store::SocketAddress& a : store::resolve(host, port, &error)) {
    const int fd = ::socket(a.family(), SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    store::SocketAddress mine;
    mine.length = sizeof mine.storage;
    const bool ok = ::connect(fd, a.get(), a.length) == 0 &&
                    ::getsockname(fd, reinterpret_cast<sockaddr*>(&mine.storage), &mine.length) == 0;
    ::close(fd);
    if (ok) return store::ip_of(mine);
  }
  return "-";
}

// Whether `host` is an address of this machine: then this ddprun may host the store.
bool endpoint_is_here(const std::string& host, int port) {
  std::string error;
  for (const store::SocketAddress& a : store::resolve(host, port, &error)) {
    if (store::can_bind(a)) return true;
  }
  return false;
}

class ElasticRounds final : public Rounds {
 public:
  ElasticRounds(const LaunchConfig& config, const EnvMap& base_env, const std::string& run_id,
                const std::string& secret);

  bool agent_store() const override { return true; }
  std::optional<Membership> join(int next, const std::function<bool()>& stop) override;
  std::optional<std::string> failure_elsewhere(int round) override;
  std::optional<std::string> report_failure(int round, const std::string& what,
                                            bool final) override;
  bool final_failure(int round) override;
  void leave(int round, bool failed, const std::function<bool()>& stop) override;
  std::optional<std::string> regroup(int round, bool now) override;
  bool announce_leaving(int round, const std::string& why) override;

 private:
  std::string key(int round, std::string_view what) const {
    return fmt::format("{}{}/{}", prefix_, round, what);
  }
  std::string get_if_set(const std::string& k, Clock::time_point deadline) {
    if (!client_->check({k}, deadline)) return "";
    return client_->get(k, milliseconds(0), deadline);
  }
  int raise_round(int next, Clock::time_point deadline);
  void beat(Clock::time_point deadline);
  // Round `round` is over: failed, re-forming, finished, or all its nodes gone silent.
  bool over(int round, Clock::time_point deadline);
  // The nodes that arrived in `round` before index `n`, in arrival order.
  // (Entries are cached: each is written once.) `wait`: how long a missing one is waited for.
  std::vector<Entry> arrivals(int round, int n, milliseconds wait = milliseconds(1000));
  Membership admit(int round, int n, int index, Clock::time_point deadline);
  [[noreturn]] void too_few(int round, int count, Clock::time_point deadline);
  // Whether a node of the round before `round` may still come: it has not arrived in `round`,
  // has not left, and its ddprun still shows signs of life (within kDeadAfter).
  bool awaited(int round, Clock::time_point deadline);
  // Records the signs of life of this round's other nodes now, as the round ends: a dead node
  // is then known dead kDeadAfter from here, not from when the next round starts to close.
  void watch_members(Clock::time_point deadline);
  // Note [Moving the store]: clients of the store at host:port from now on.
  void connect_to(const std::string& host, int port);
  // The store stopped answering: the next node of the last round takes it over (this one, or
  // the one this connects to). False when no node is left to take it.
  bool move_store(const std::string& why);
  // On the store just moved to: the last round is over there, the failures so far carried.
  void settle_moved_store(Clock::time_point deadline);
  // While the store is moved: a node waiting at the rendezvous endpoint (its host came back).
  std::optional<std::string> waiting_at_home(int round);
  std::string where() const { return fmt::format("node {} (ddprun pid {})", host_, pid_); }
  std::string range() const { return fmt::format("{}:{}", c_.min_nodes, c_.nnodes); }

  const LaunchConfig& c_;
  const std::string job_key_;
  const std::string prefix_;  // "ddprun/<run id>/"
  const std::string host_;
  const int pid_;
  const std::string id_;  // "<host>:<pid>:<random>"
  const milliseconds join_timeout_;
  const milliseconds last_call_;
  std::unique_ptr<store::Server> server_;   // on the endpoint's host
  std::unique_ptr<store::Server> standby_;  // elsewhere: ready to take the store over
  std::unique_ptr<store::Client> client_;
  std::string store_host_;  // where client_ connects: --rdzv-endpoint, or where the store moved
  int store_port_ = 0;
  std::string addr_;  // this node's address toward the endpoint, where its store listens ("-")
  std::set<std::string> lost_;       // store addresses that stopped answering
  std::optional<Clock::time_point> unreachable_since_;
  std::string moved_note_;           // set by a move until settle_moved_store() writes it
  int known_failures_ = 0;           // the failure count last read
  bool unreported_failure_ = false;  // a failure report that did not reach the store
  bool go_home_ = false;             // the next join moves the store back to the endpoint
  Clock::time_point next_home_poll_{};

  // The last round this node ran: its number, this node's rank there, its nodes in rank order.
  int last_round_ = -1;
  int last_rank_ = -1;
  std::vector<Entry> members_;
  bool leaving_ = false;
  StorePoll poll_;  // failure_elsewhere()
  Clock::time_point next_regroup_poll_{};
  // Signs of life seen while waiting on a round: id -> (alive count, when it last moved).
  std::map<std::string, std::pair<int64_t, Clock::time_point>> seen_alive_;
  std::map<std::pair<int, int>, Entry> entries_;  // (round, arrival) -> its entry, once read
};

ElasticRounds::ElasticRounds(const LaunchConfig& config, const EnvMap& base_env,
                             const std::string& run_id, const std::string& secret)
    : c_(config), job_key_(store::job_key(secret, run_id)),
      prefix_(fmt::format("ddprun/{}/", run_id)), host_(net::host_name()),
      pid_(static_cast<int>(::getpid())),
      id_(fmt::format("{}:{}:{}", host_, pid_, random_hex(3))),
      join_timeout_(std::chrono::duration_cast<milliseconds>(
          config.rdzv_timeout.value_or(Seconds(kDefaultRendezvousTimeout)))),
      last_call_(std::chrono::duration_cast<milliseconds>(config.last_call_timeout)),
      addr_(address_toward(config.master_addr, config.master_port)) {
  // The first ddprun on the endpoint's host hosts the store; a second one there finds the port
  // taken and is a client like the rest.
  if (endpoint_is_here(c_.master_addr, c_.master_port)) {
    server_ = host_agent_store(c_, base_env, job_key_, secret,
                               "the ddprun on the rendezvous endpoint's host",
                               /*none_if_in_use=*/true);
    if (server_) {
      note(fmt::format("hosting the elastic job's agent store on {}", server_->listening()));
    }
  }
  // Every other node keeps a standby store at its address and the endpoint's port, ready when
  // the store moves to it (Note [Moving the store]); one that cannot is no successor ("-").
  if (!server_ && addr_ != "-") {
    LaunchConfig here = c_;
    here.master_addr = addr_;
    try {
      standby_ = host_agent_store(here, base_env, job_key_, secret, "a standby store",
                                  /*none_if_in_use=*/true, /*quiet=*/true);
    } catch (const Error&) {
      standby_.reset();
    }
    if (!standby_) addr_ = "-";
  }
  connect_to(c_.master_addr, c_.master_port);
}

void ElasticRounds::connect_to(const std::string& host, int port) {
  store_host_ = host;
  store_port_ = port;
  store::ClientOptions o;
  o.host = host;
  o.port = port;
  o.key = job_key_;
  o.identity = fmt::format("ddprun {} (elastic)", id_);
  o.who = fmt::format("ddprun ({})", host_);
  o.owner = host == c_.master_addr ? "the ddprun on the rendezvous endpoint's host"
                                   : fmt::format("the ddprun that took the store over ({})", host);
  client_ = std::make_unique<store::Client>(o);
}

// Note [Moving the store]
// The node hosting the store may be reclaimed like any other. Every other node hosts a standby
// store from the start, at its address toward the endpoint and the endpoint's port (quiet,
// empty; it costs a socket and a thread), and its round entries carry that address. When the
// store stops answering for kStoreLost, each node that ran the last round moves to the same
// successor without asking anyone: the first node of that round, in node-rank order, whose
// address has not stopped answering (all know the round's nodes and addresses from its
// entries). Its standby store already listens, so nobody races its start; whoever arrives first
// writes there that the last round is over (it moved) and the failures so far (plus the round
// that failed with the store's host, which nobody could record). Rounds go
// on from the last round + 1, workers get the new MASTER_ADDR. A successor that is gone too is
// found the same way and skipped. A node started later knows only --rdzv-endpoint: when a store
// answers there again (the endpoint's host came back and its ddprun hosts a fresh store) with a
// node waiting in it, the moved job re-forms (SIGTERM, checkpoint) and moves its store back,
// admitting that node. Nodes that lost the store and the node on the endpoint's host that has
// not (a network partition, not a death) would each go on: MIN above half of MAX keeps two
// halves from both forming rounds.
bool ElasticRounds::move_store(const std::string& why) {
  if (members_.empty()) return false;  // this node never ran: it knows no successor
  lost_.insert(store_host_);
  std::string error;
  for (const store::SocketAddress& a : store::resolve(store_host_, store_port_, &error)) {
    lost_.insert(store::ip_of(a));  // the endpoint may be a name; entries hold addresses
  }
  const auto next = std::ranges::find_if(members_, [&](const Entry& e) {
    return e.addr != "-" && lost_.count(e.addr) == 0;
  });
  if (next == members_.end()) return false;
  const std::string from = store::format_endpoint(store_host_, store_port_);
  connect_to(next->addr, c_.master_port);
  moved_note_ = fmt::format("the store on {} stopped answering ({}); it moved to {} ({})", from,
                            why, store::format_endpoint(next->addr, c_.master_port), next->host);
  note(moved_note_);
  unreachable_since_.reset();
  return true;
}

void ElasticRounds::settle_moved_store(Clock::time_point deadline) {
  if (moved_note_.empty()) return;
  if (last_round_ >= 0) client_->compare_set(key(last_round_, "regroup"), "", moved_note_, deadline);
  const int carried = known_failures_ + (unreported_failure_ ? 1 : 0);
  std::string now = client_->compare_set(prefix_ + "failures", "", std::to_string(carried),
                                         deadline);
  while (parse_count(now, "failure count") < carried) {
    now = client_->compare_set(prefix_ + "failures", now, std::to_string(carried), deadline);
  }
  moved_note_.clear();
  unreported_failure_ = false;
}

std::optional<std::string> ElasticRounds::waiting_at_home(int round) {
  if (store_host_ == c_.master_addr) return std::nullopt;
  const auto now = Clock::now();
  if (now < next_home_poll_) return std::nullopt;
  next_home_poll_ = now + 4 * kPollInterval;
  try {
    store::ClientOptions o;
    o.host = c_.master_addr;
    o.port = c_.master_port;
    o.key = job_key_;
    o.identity = fmt::format("ddprun {} (elastic, looking at the endpoint)", id_);
    o.who = fmt::format("ddprun ({})", host_);
    o.owner = "the ddprun on the rendezvous endpoint's host";
    store::Client home(o);
    const auto deadline = now + milliseconds(1000);
    if (!home.check({prefix_ + "round"}, deadline)) return std::nullopt;
    const std::string r = home.get(prefix_ + "round", milliseconds(0), deadline);
    if (home.add(fmt::format("{}{}/count", prefix_, r), 0, deadline) == 0) return std::nullopt;
    go_home_ = true;
    client_->compare_set(key(round, "store_home"), "", "1", now + kCallTime);  // for every node
    return client_->compare_set(
        key(round, "regroup"), "",
        fmt::format("a node waits at the rendezvous endpoint {}: the job's store moves back there",
                    store::format_endpoint(c_.master_addr, c_.master_port)),
        now + kCallTime);
  } catch (const Error&) {
    return std::nullopt;  // nobody there (yet)
  }
}

int ElasticRounds::raise_round(int next, Clock::time_point deadline) {
  int round = parse_count(client_->compare_set(prefix_ + "round", "", "0", deadline), "round");
  while (round < next) {
    round = parse_count(client_->compare_set(prefix_ + "round", std::to_string(round),
                                             std::to_string(next), deadline),
                        "round");
  }
  return round;
}

void ElasticRounds::beat(Clock::time_point deadline) {
  client_->add(prefix_ + "alive/" + id_, 1, deadline);
}

bool ElasticRounds::over(int round, Clock::time_point deadline) {
  if (round < 0) return true;
  for (const char* what : {"failed", "regroup", "finished"}) {
    if (client_->check({key(round, what)}, deadline)) return true;
  }
  const std::string closed = get_if_set(key(round, "closed"), deadline);
  if (closed.empty()) return false;  // it has not begun
  // Begun, and not ended by any of its nodes: over only when none of them shows a sign of life.
  const auto now = Clock::now();
  bool alive = false;
  for (const Entry& e : arrivals(round, parse_count(closed, "closed count"))) {
    const int64_t count = client_->add(prefix_ + "alive/" + e.id, 0, deadline);
    auto [it, fresh] = seen_alive_.try_emplace(e.id, count, now);
    if (fresh || it->second.first != count) {
      it->second = {count, now};
      alive = true;
    } else if (now - it->second.second < kStaleAfter) {
      alive = true;
    }
  }
  if (alive) return false;
  client_->compare_set(key(round, "regroup"), "",
                       fmt::format("none of its nodes answered for {}",
                                   format_seconds(seconds_of(kStaleAfter))),
                       deadline);
  return true;
}

void ElasticRounds::watch_members(Clock::time_point deadline) {
  try {
    const auto now = Clock::now();
    for (const Entry& e : members_) {
      if (e.id == id_ || e.id == "?") continue;
      const int64_t beats = client_->add(prefix_ + "alive/" + e.id, 0, deadline);
      auto [it, fresh] = seen_alive_.try_emplace(e.id, beats, now);
      if (!fresh && it->second.first != beats) it->second = {beats, now};
    }
  } catch (const Error&) {
    // The next round's close looks again.
  }
}

bool ElasticRounds::awaited(int round, Clock::time_point deadline) {
  if (round == 0) return false;
  const std::string closed = get_if_set(key(round - 1, "closed"), deadline);
  if (closed.empty()) return false;  // (a store just moved to knows no earlier round)
  const std::vector<Entry> before = arrivals(round - 1, parse_count(closed, "closed count"));
  const std::vector<Entry> here =
      arrivals(round, static_cast<int>(client_->add(key(round, "count"), 0, deadline)));
  const auto now = Clock::now();
  for (const Entry& e : before) {
    if (e.id == "?" || std::ranges::any_of(here, [&](const Entry& h) { return h.id == e.id; })) {
      continue;
    }
    if (client_->check({key(round - 1, "left/" + e.id)}, deadline)) continue;
    const int64_t beats = client_->add(prefix_ + "alive/" + e.id, 0, deadline);
    auto [it, fresh] = seen_alive_.try_emplace(e.id, beats, now);
    if (fresh || it->second.first != beats) {
      it->second = {beats, now};
      return true;
    }
    if (now - it->second.second < kDeadAfter) return true;
  }
  return false;
}

std::vector<Entry> ElasticRounds::arrivals(int round, int n, milliseconds wait) {
  std::vector<Entry> out;
  for (int i = 0; i < n; ++i) {
    if (auto it = entries_.find({round, i}); it != entries_.end()) {
      out.push_back(it->second);  // written once, never changed: read once
      continue;
    }
    // A node writes its entry right after counting itself in: wait a moment for it.
    const std::string k = key(round, fmt::format("member/{}", i));
    std::string text;
    try {
      text = client_->get(k, wait, Clock::now() + wait + kWaitStep);
    } catch (const RendezvousError&) {
      text.clear();  // it died in between: an unknown node
    }
    Entry e = parse_entry(text, i);
    if (e.id != "?") entries_.emplace(std::make_pair(round, i), e);
    out.push_back(std::move(e));
  }
  return out;
}

Membership ElasticRounds::admit(int round, int n, int index, Clock::time_point deadline) {
  // Every node must order the same entries: wait for a late one as long as a call may take
  // (an entry still missing then belongs to a node that died between counting in and writing
  // it, and every node reads it as unknown).
  std::vector<Entry> nodes = arrivals(round, n, kCallTime);
  sort_members(nodes);
  const auto mine = std::ranges::find_if(nodes, [&](const Entry& e) { return e.arrival == index; });
  const int rank = static_cast<int>(mine - nodes.begin());
  const std::string failures = get_if_set(prefix_ + "failures", deadline);
  std::vector<std::string> hosts;
  for (const Entry& e : nodes) hosts.push_back(e.host);
  note(fmt::format("elastic round {}: {} node(s) ({} allowed), node ranks {}; this node is node {}",
                   round, n, range(), fmt::join(hosts, ", "), rank));
  last_round_ = round;
  last_rank_ = rank;
  members_ = std::move(nodes);
  known_failures_ = failures.empty() ? 0 : parse_count(failures, "failure count");
  const bool moved = store_host_ != c_.master_addr;
  return Membership{.round = round,
                    .node_rank = rank,
                    .nnodes = n,
                    .restarts = known_failures_,
                    .store_addr = moved ? store_host_ : "",
                    .store_port = moved ? store_port_ : 0};
}

void ElasticRounds::too_few(int round, int count, Clock::time_point deadline) {
  std::vector<std::string> present;
  std::vector<std::string> missing;
  const std::vector<Entry> here = arrivals(round, count);
  for (const Entry& e : here) present.push_back(e.host);
  for (size_t r = 0; r < members_.size(); ++r) {
    const Entry& m = members_[r];
    if (std::ranges::none_of(here, [&](const Entry& e) { return e.id == m.id; })) {
      missing.push_back(fmt::format("{} (node {} of round {})", m.host, r, last_round_));
    }
  }
  throw RendezvousError(fmt::format(
      "{}: {} node(s) joined elastic round {} within {} (the join timeout), fewer than the "
      "minimum of {} (--nnodes {}); present: {}; missing: {}. Start ddprun on more nodes, or "
      "lower MIN.",
      where(), count, round, format_seconds(seconds_of(join_timeout_)), c_.min_nodes, range(),
      present.empty() ? "none" : fmt::format("{}", fmt::join(present, ", ")),
      missing.empty() ? "no node of an earlier round (this job never ran)"
                      : fmt::format("{}", fmt::join(missing, ", "))));
}

// Every step is a short bounded call, retried until the join timeout (the store's host may not
// listen yet). The timeout counts only while the round before has ended: waiting to be admitted
// while the job runs at its maximum is not a rendezvous that failed.
std::optional<Membership> ElasticRounds::join(int next, const std::function<bool()>& stop) {
  auto end = Clock::now() + join_timeout_;
  const std::string shape =
      fmt::format("--nnodes {}, --nproc-per-node {}", range(), c_.nproc_per_node);
  bool shape_checked = false;
  bool said_waiting = false;
  int round = -1;
  int index = -1;  // this node's arrival index in `round`
  std::optional<Clock::time_point> min_seen;
  std::string last_error;
  std::optional<int> short_of;  // the round's count at the join timeout, below MIN
  if (go_home_) {  // Note [Moving the store]: back to the endpoint, where a node waits
    const std::string from = store::format_endpoint(store_host_, store_port_);
    connect_to(c_.master_addr, c_.master_port);
    moved_note_ = fmt::format("the job's store moved from {} back to the rendezvous endpoint",
                              from);
    note(moved_note_);
    go_home_ = false;
  }
  while (true) {
    if (stop && stop()) return std::nullopt;
    const auto now = Clock::now();
    const auto deadline = now + kCallTime;
    try {
      last_error.clear();
      beat(deadline);
      unreachable_since_.reset();
      settle_moved_store(deadline);
      if (!shape_checked) {
        const std::string job = client_->compare_set(prefix_ + "shape", "", shape, deadline);
        if (job != shape) {
          throw Error(fmt::format(
              "{} was started with {}, but this job's first node with {}: give every node the "
              "same --nnodes and --nproc-per-node",
              where(), shape, job));
        }
        shape_checked = true;
      }
      const int r = raise_round(next, deadline);
      if (r != round) {
        round = r;
        index = -1;
        min_seen.reset();
      }
      if (round > 0) {
        const std::string finished = get_if_set(key(round - 1, "finished"), deadline);
        if (!finished.empty() && last_round_ == round - 1) {
          // A node whose workers all exited 0 has left: the job is done, this node failed late.
          throw Error(fmt::format(
              "{}: {} finished elastic round {} (its workers exited 0) while this node's failed: "
              "not starting again",
              where(), finished, round - 1));
        }
        if (!finished.empty()) {
          throw JobEnded(fmt::format("the elastic job finished in round {} ({} was first to "
                                     "finish) while this node waited to be admitted",
                                     round - 1, finished),
                         true);
        }
        const std::string final = get_if_set(key(round - 1, "final"), deadline);
        if (!final.empty()) {
          throw Error(fmt::format("{}: elastic round {} ended with a final failure ({}): no "
                                  "node starts again",
                                  where(), round - 1, final));
        }
      }
      const std::string failures = get_if_set(prefix_ + "failures", deadline);
      if (!failures.empty() && parse_count(failures, "failure count") > c_.max_restarts) {
        throw Error(fmt::format(
            "{}: the elastic job has failed {} time(s), past --max-restarts {}: it has used its "
            "restarts, so no node starts its workers again (nodes leaving or joining do not "
            "count)",
            where(), failures, c_.max_restarts));
      }
      if (index < 0) {
        index = static_cast<int>(client_->add(key(round, "count"), 1, deadline)) - 1;
        client_->set(key(round, fmt::format("member/{}", index)),
                     format_entry({.id = id_, .host = host_, .addr = addr_,
                                   .last_round = last_round_, .last_rank = last_rank_}),
                     deadline);
      }
      std::string closed = get_if_set(key(round, "closed"), deadline);
      if (closed.empty()) {
        const int count = static_cast<int>(client_->add(key(round, "count"), 0, deadline));
        if (over(round - 1, deadline)) {
          std::optional<int> close_at;
          if (count >= c_.nnodes) {
            close_at = c_.nnodes;
          } else if (count >= c_.min_nodes) {
            // After the last call, and once no node of the last round is still on its way
            // (one stopping its workers with a checkpoint can take longer than the last call).
            if (!min_seen) min_seen = now;
            if (now - *min_seen >= last_call_ &&
                (now - *min_seen >= join_timeout_ || !awaited(round, deadline))) {
              close_at = count;
            }
          } else {
            min_seen.reset();
          }
          if (close_at) {
            closed = client_->compare_set(key(round, "closed"), "", std::to_string(*close_at),
                                          deadline);
          } else if (now >= end) {
            short_of = count;
          }
        } else {
          end = now + join_timeout_;  // the round before still runs
          if (!said_waiting) {
            note(fmt::format("elastic round {} still runs; this node joins at the next one",
                             round - 1));
            said_waiting = true;
          }
        }
      }
      if (!closed.empty()) {
        const int n = parse_count(closed, "closed count");
        if (index < n) return admit(round, n, index, deadline);
        note(fmt::format("elastic round {} began with {} node(s) before this node arrived "
                         "(--nnodes {}): this node waits to be admitted when the job next "
                         "re-forms{}",
                         round, n, range(),
                         n >= c_.nnodes ? ", which it does when a node leaves (it runs at its "
                                          "maximum)"
                                        : ", at once"));
        next = round + 1;
      }
    } catch (const store::RefusedError& e) {  // another job's store, a wrong secret: final
      throw RendezvousError(fmt::format("{}: {}", where(), e.what()));
    } catch (const RendezvousError& e) {  // the store did not answer (in time): retried
      last_error = e.what();
      // Moved at once when its host exited, else after kStoreLost without an answer.
      const bool exited = dynamic_cast<const store::StoreExitedError*>(&e) != nullptr;
      if (!unreachable_since_) unreachable_since_ = Clock::now();  // (polls and reports count)
      if ((exited || Clock::now() - *unreachable_since_ >= kStoreLost) && move_store(e.what())) {
        end = Clock::now() + join_timeout_;  // a new store: the rendezvous starts over there
        last_error.clear();
        round = -1;
        shape_checked = false;
        continue;
      }
    }
    if (short_of) too_few(round, *short_of, Clock::now() + kCallTime);
    if (!last_error.empty() && Clock::now() >= end) {
      throw RendezvousError(fmt::format(
          "{}: could not reach the elastic job's agent store at {}:{} (--rdzv-endpoint) within "
          "{}: {}. The ddprun on that host hosts it: it has not started, has exited, or listens "
          "on another address or port.",
          where(), c_.master_addr, c_.master_port, format_seconds(seconds_of(join_timeout_)),
          last_error));
    }
    std::this_thread::sleep_for(kWaitStep);
  }
}

std::optional<std::string> ElasticRounds::failure_elsewhere(int round) {
  return poll_(
      [&](Clock::time_point deadline) -> std::optional<std::string> {
        beat(deadline);
        unreachable_since_.reset();
        const std::string failed = get_if_set(key(round, "failed"), deadline);
        if (failed.empty()) return std::nullopt;
        watch_members(deadline);
        return failed;
      },
      [&] {  // counts towards moving the store (Note [Moving the store])
        if (!unreachable_since_) unreachable_since_ = Clock::now();
      });
}

std::optional<std::string> ElasticRounds::regroup(int round, bool now) {
  const auto t = Clock::now();
  if (!now && t < next_regroup_poll_) return std::nullopt;
  next_regroup_poll_ = t + kPollInterval;
  const auto deadline = t + kCallTime;
  try {
    if (client_->check({key(round, "failed")}, deadline)) return std::nullopt;  // a failure wins
    if (std::string why = get_if_set(key(round, "regroup"), deadline); !why.empty()) {
      if (client_->check({key(round, "store_home")}, deadline)) go_home_ = true;
      client_->add(key(round, "regroup_seen"), 1, deadline);  // a leaving store host waits
      return why;
    }
    if (auto home = waiting_at_home(round)) return home;
    if (static_cast<int>(members_.size()) >= c_.nnodes) return std::nullopt;
    // A node waiting to be admitted while the job runs below its maximum: re-form now.
    if (client_->add(key(round + 1, "count"), 0, deadline) == 0) return std::nullopt;
    const Entry waiting = arrivals(round + 1, 1).front();
    return client_->compare_set(
        key(round, "regroup"), "",
        fmt::format("node {} waits to join; the job runs on {} of at most {} nodes", waiting.host,
                    members_.size(), c_.nnodes),
        deadline);
  } catch (const Error&) {
    return std::nullopt;  // failure_elsewhere() says when the store does not answer
  }
}

bool ElasticRounds::announce_leaving(int round, const std::string& why) {
  try {
    const auto deadline = Clock::now() + kCallTime;
    client_->set(key(round, "left/" + id_), "1", deadline);  // nobody waits for this node
    client_->compare_set(key(round, "regroup"), "", fmt::format("{} leaves: {}", where(), why),
                         deadline);
    leaving_ = true;
  } catch (const Error& e) {
    note(fmt::format("could not tell the other nodes that this node leaves: {}", e.what()));
  }
  return true;  // the others go on either way: they find this node gone
}

std::optional<std::string> ElasticRounds::report_failure(int round, const std::string& what,
                                                         bool final) {
  try {
    std::optional<std::string> first =
        write_first_failure(*client_, prefix_, round, fmt::format("{}: {}", where(), what), final);
    watch_members(Clock::now() + kCallTime);
    if (first) return first;
    // Counted once, by the first reporter.
    known_failures_ =
        static_cast<int>(client_->add(prefix_ + "failures", 1, Clock::now() + kCallTime));
  } catch (const Error& e) {
    unreported_failure_ = true;  // a store that moves carries it (Note [Moving the store])
    if (!unreachable_since_) unreachable_since_ = Clock::now();
    note(fmt::format("could not tell the other nodes that this node failed: {}", e.what()));
  }
  return std::nullopt;
}

bool ElasticRounds::final_failure(int round) { return failure_is_final(*client_, prefix_, round); }

void ElasticRounds::leave(int round, bool failed_round, const std::function<bool()>& stop) {
  try {
    if (!failed_round && !leaving_) {
      client_->compare_set(key(round, "finished"), "", where(), Clock::now() + kCallTime);
    }
    client_->add(key(round, "ended"), 1, Clock::now() + kCallTime);
    if (!server_) return;
    if (leaving_) {
      // The store's host leaves: it goes once every other node has read the regroup, at most
      // kFailureLinger, then the others move the store. A node that had not read it when its
      // workers exited (they checkpoint with everyone's at the same step, so they may exit
      // before its next poll) would take their exit for a failure and spend a restart.
      const auto until = Clock::now() + kFailureLinger;
      const int others = static_cast<int>(members_.size()) - 1;
      while (Clock::now() < until && !(stop && stop())) {
        if (client_->add(key(round, "regroup_seen"), 0, Clock::now() + kCallTime) >= others) break;
        std::this_thread::sleep_for(kWaitStep);
      }
      return;
    }
    // The store's host: the others may still need it, to end or to learn that the job ended.
    const auto limit = failed_round ? std::chrono::duration_cast<milliseconds>(c_.grace_period) +
                                          kFailureLinger
                                    : std::min(join_timeout_, kSuccessLinger);
    const auto until = Clock::now() + limit;
    bool said = false;
    while (Clock::now() < until) {
      const auto deadline = Clock::now() + kCallTime;
      const int ended = static_cast<int>(client_->add(key(round, "ended"), 0, deadline));
      const bool waiting = client_->add(key(round + 1, "count"), 0, deadline) > 0;
      if (ended >= static_cast<int>(members_.size()) && !waiting) return;
      if (ended >= static_cast<int>(members_.size()) && waiting) {
        // Nodes waiting to be admitted read "finished" within kWaitStep: give them a moment.
        std::this_thread::sleep_for(5 * kWaitStep + kPollInterval);
        return;
      }
      if (stop && stop()) {
        note("stopped waiting for the other nodes (signal); they may lose the agent store");
        return;
      }
      if (!said) {
        note(fmt::format("waiting up to {} for the other nodes to be done with the agent store "
                         "that this node hosts",
                         format_seconds(seconds_of(limit))));
        said = true;
      }
      std::this_thread::sleep_for(kWaitStep);
    }
  } catch (const Error& e) {
    if (server_) note(fmt::format("ending elastic round {}: {}", round, e.what()));
  }
}

}  // namespace

std::unique_ptr<Rounds> make_elastic_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                            const std::string& run_id, const std::string& secret) {
  return std::make_unique<ElasticRounds>(config, base_env, run_id, secret);
}

}  // namespace ddp::launcher
