// Restart rounds (see Note [Restart rounds] in rounds.h).
#include "rounds.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <cerrno>  // EADDRINUSE
#include <charconv>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/net.h"  // host_name
#include "ddp/error.h"
#include "elastic.h"
#include "output.h"  // note
#include "base/parse.h"
#include "store/client.h"
#include "store/host.h"
#include "summary.h"  // format_seconds

namespace ddp::launcher {
namespace {

using Clock = store::Clock;
using std::chrono::milliseconds;

// How often a node waiting for the others to join (or to end) looks at the counts.
constexpr milliseconds kWaitStep{100};

double seconds_of(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int parse_round(const std::string& text) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    throw Error(
        fmt::format("the agent store's restart round is '{}', not a number: another "
                    "program wrote to this job's keys",
                    text));
  }
  return value;
}

// A single node restarts alone: its rounds are its own attempts.
class LocalRounds final : public Rounds {
 public:
  bool agent_store() const override { return false; }
  std::optional<Membership> join(int next, const std::function<bool()>&) override {
    return Membership{.round = next, .node_rank = 0, .nnodes = 1, .restarts = next};
  }
  std::optional<std::string> failure_elsewhere(int) override { return std::nullopt; }
  std::optional<std::string> report_failure(int, const std::string&, bool) override {
    return std::nullopt;
  }
  bool final_failure(int) override { return false; }
  void leave(int, bool, const std::function<bool()>&) override {}
};

class StoreRounds final : public Rounds {
 public:
  StoreRounds(const LaunchConfig& config, const EnvMap& base_env, const std::string& run_id,
              const std::string& secret);

  bool agent_store() const override { return true; }
  std::optional<Membership> join(int next, const std::function<bool()>& stop) override;
  std::optional<std::string> failure_elsewhere(int round) override;
  std::optional<std::string> report_failure(int round, const std::string& what,
                                            bool final) override;
  bool final_failure(int round) override;
  void leave(int round, bool failed, const std::function<bool()>& stop) override;

 private:
  std::string key(int round, const std::string& what) const {
    return fmt::format("{}{}/{}", prefix_, round, what);
  }
  // Raises "round" to at least `next`; returns its value.
  int raise_round(int next, Clock::time_point deadline);
  int current_round(Clock::time_point deadline);
  bool failed(int round, Clock::time_point deadline);
  [[noreturn]] void missing_nodes(int round, Clock::time_point deadline);
  // "alive/<K>" counts this ddprun's polls: a ddprun that is running keeps it moving.
  void beat(Clock::time_point deadline);
  // Throws when another ddprun of this node rank is alive (its count moves in kAliveWindow).
  void refuse_if_alive(Clock::time_point deadline);
  std::string where() const { return fmt::format("node {} ({})", c_.node_rank, host_); }

  const LaunchConfig& c_;
  const std::string prefix_;  // "ddprun/<run id>/"
  const std::string host_;
  const milliseconds join_timeout_;
  std::unique_ptr<store::Server> server_;  // node 0 only
  std::unique_ptr<store::Client> client_;
  StorePoll poll_;
};

StoreRounds::StoreRounds(const LaunchConfig& config, const EnvMap& base_env,
                         const std::string& run_id, const std::string& secret)
    : c_(config), prefix_(fmt::format("ddprun/{}/", run_id)), host_(net::host_name()),
      join_timeout_(std::chrono::duration_cast<milliseconds>(
          config.rdzv_timeout.value_or(Seconds(kDefaultRendezvousTimeout)))) {
  const std::string key = store::job_key(secret, run_id);
  if (c_.node_rank == 0) server_ = host_agent_store(c_, base_env, key, secret, "node 0");
  store::ClientOptions o;
  o.host = server_ ? server_->local_address() : c_.master_addr;
  o.port = server_ ? server_->port() : c_.master_port;
  o.key = key;
  o.identity = fmt::format("ddprun of node {}, pid {} on {}", c_.node_rank,
                           static_cast<int>(::getpid()), host_);
  o.who = fmt::format("ddprun (node {})", c_.node_rank);
  o.owner = "node 0's ddprun";
  client_ = std::make_unique<store::Client>(o);
}

int StoreRounds::current_round(Clock::time_point deadline) {
  return parse_round(client_->compare_set(prefix_ + "round", "", "0", deadline));
}

int StoreRounds::raise_round(int next, Clock::time_point deadline) {
  int round = current_round(deadline);
  while (round < next) {
    const std::string now = std::to_string(round);
    round =
        parse_round(client_->compare_set(prefix_ + "round", now, std::to_string(next), deadline));
  }
  return round;
}

bool StoreRounds::failed(int round, Clock::time_point deadline) {
  return client_->check({key(round, "failed")}, deadline);
}

void StoreRounds::missing_nodes(int round, Clock::time_point deadline) {
  std::vector<int> missing;
  for (int k = 0; k < c_.nnodes; ++k) {
    if (!client_->check({key(round, fmt::format("node/{}", k))}, deadline)) missing.push_back(k);
  }
  throw RendezvousError(fmt::format(
      "{}: {}/{} nodes joined restart round {} within {} (the rendezvous timeout); missing "
      "nodes: {}. Start ddprun on every node with the same --nnodes, --rdzv-id, --master-addr "
      "and --master-port; a node whose ddprun was killed must run it again.",
      where(), c_.nnodes - static_cast<int>(missing.size()), c_.nnodes, round,
      format_seconds(seconds_of(join_timeout_)), fmt::join(missing, ", ")));
}

// Every step is a short bounded call, retried until the join timeout: the store's host may not
// listen yet, or may be starting again (Note [Restart rounds]). Retrying is safe because a node
// counts itself into a round once (`counted_in`).
std::optional<Membership> StoreRounds::join(int next, const std::function<bool()>& stop) {
  const auto end = Clock::now() + join_timeout_;
  const std::string shape =
      fmt::format("--nnodes {}, --nproc-per-node {}", c_.nnodes, c_.nproc_per_node);
  bool shape_checked = false;
  int counted_in = -1;
  int round = next;
  std::string last_error;
  while (true) {
    if (stop && stop()) return std::nullopt;
    const auto deadline = Clock::now() + kCallTime;
    try {
      last_error.clear();
      beat(deadline);
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
      round = raise_round(next, deadline);
      if (round != counted_in) {
        if (round > c_.max_restarts) {
          throw Error(fmt::format(
              "{}: the job is at restart round {}, past --max-restarts {}: it has used its "
              "restarts, so this node does not start its workers again",
              where(), round, c_.max_restarts));
        }
        const int64_t mine =
            client_->add(key(round, fmt::format("node/{}", c_.node_rank)), 1, deadline);
        if (mine > 1) {
          // This node's earlier ddprun took part in this round: its workers are gone, unless
          // that ddprun is still alive (two were given this --node-rank).
          refuse_if_alive(deadline);
          client_->compare_set(
              key(round, "failed"), "",
              fmt::format("{}: its ddprun started again, so its workers of round {} are gone",
                          where(), round),
              Clock::now() + kCallTime);  // the watch took longer than `deadline` leaves
          note(
              fmt::format("this node's previous ddprun took part in restart round {}; ending "
                          "that round so that every node restarts together",
                          round));
          next = round + 1;
          continue;
        }
        client_->add(key(round, "joined"), 1, deadline);
        counted_in = round;
      }
      if (round > 0 && client_->check({key(round - 1, "finished")}, deadline)) {
        // A node whose workers all exited 0 has left: the job cannot run again without it.
        throw Error(fmt::format(
            "{}: {} finished restart round {} (its workers exited 0) while another node failed, "
            "so the job cannot restart without it: not restarting",
            where(), client_->get(key(round - 1, "finished"), milliseconds(0), deadline),
            round - 1));
      }
      if (round > 0 && client_->check({key(round - 1, "final")}, deadline)) {
        throw Error(
            fmt::format("{}: restart round {} ended with a final failure ({}): no node restarts",
                        where(), round - 1,
                        client_->get(key(round - 1, "final"), milliseconds(0), deadline)));
      }
      if (client_->add(key(round, "joined"), 0, deadline) >= c_.nnodes) {
        return Membership{
            .round = round, .node_rank = c_.node_rank, .nnodes = c_.nnodes, .restarts = round};
      }
      // A round that failed before it began (a node came back) gives way to the next one; a
      // newer round, opened meanwhile, is found by raise_round.
      if (failed(round, deadline)) next = round + 1;
    } catch (const store::RefusedError& e) {  // another job's store, a wrong secret: final
      throw RendezvousError(fmt::format("{}: {}", where(), e.what()));
    } catch (const RendezvousError& e) {  // the store did not answer (in time): retried
      last_error = e.what();
    }
    if (Clock::now() >= end) {
      if (!last_error.empty()) {
        throw RendezvousError(fmt::format(
            "{}: could not reach the job's agent store at {}:{} (--master-addr, "
            "--master-port) within {}: {}. Node 0's ddprun hosts it: it has not started, has "
            "exited, or listens on another address or port.",
            where(), c_.master_addr, c_.master_port, format_seconds(seconds_of(join_timeout_)),
            last_error));
      }
      missing_nodes(round, Clock::now() + kCallTime);
    }
    std::this_thread::sleep_for(kWaitStep);
  }
}

void StoreRounds::beat(Clock::time_point deadline) {
  client_->add(prefix_ + fmt::format("alive/{}", c_.node_rank), 1, deadline);
}

void StoreRounds::refuse_if_alive(Clock::time_point deadline) {
  const std::string alive = prefix_ + fmt::format("alive/{}", c_.node_rank);
  const int64_t before = client_->add(alive, 0, deadline);
  std::this_thread::sleep_for(kAliveWindow);
  const int64_t after = client_->add(alive, 0, Clock::now() + kCallTime);
  if (after != before) {
    throw Error(fmt::format(
        "{}: another ddprun of node {} is running (it keeps answering in the agent store): two "
        "ddprun were given --node-rank {}. Give each node its own --node-rank, 0 to {}.",
        where(), c_.node_rank, c_.node_rank, c_.nnodes - 1));
  }
}

std::optional<std::string> StoreRounds::failure_elsewhere(int round) {
  return poll_([&](Clock::time_point deadline) -> std::optional<std::string> {
    beat(deadline);
    if (!failed(round, deadline)) return std::nullopt;
    return client_->get(key(round, "failed"), milliseconds(0), deadline);
  });
}

std::optional<std::string> StoreRounds::report_failure(int round, const std::string& what,
                                                       bool final) {
  try {
    return write_first_failure(*client_, prefix_, round, fmt::format("{}: {}", where(), what),
                               final);
  } catch (const Error& e) {
    note(fmt::format("could not tell the other nodes that this node failed: {}", e.what()));
  }
  return std::nullopt;
}

bool StoreRounds::final_failure(int round) { return failure_is_final(*client_, prefix_, round); }

void StoreRounds::leave(int round, bool failed_round, const std::function<bool()>& stop) {
  try {
    if (!failed_round) {
      client_->compare_set(key(round, "finished"), "", where(), Clock::now() + kCallTime);
    }
    client_->add(key(round, "ended"), 1, Clock::now() + kCallTime);
    if (!server_) return;
    // Node 0: the others may still need the store (Note [Restart rounds]).
    const auto failure_limit =
        std::chrono::duration_cast<milliseconds>(c_.grace_period) + kFailureLinger;
    const auto limit = failed_round ? failure_limit : std::min(join_timeout_, kSuccessLinger);
    auto until = Clock::now() + limit;
    bool said = false;
    while (client_->add(key(round, "ended"), 0, Clock::now() + kCallTime) < c_.nnodes &&
           Clock::now() < until) {
      if (stop && stop()) {
        note("stopped waiting for the other nodes (signal); they may lose the agent store");
        return;
      }
      if (!failed_round && failed(round, Clock::now() + kCallTime)) {
        // Another node failed after this one finished: it only needs to read why.
        failed_round = true;
        until = std::min(until, Clock::now() + failure_limit);
        continue;
      }
      if (!said) {
        note(
            fmt::format("waiting up to {} for the other nodes to be done with the agent store "
                        "that this node hosts",
                        format_seconds(seconds_of(limit))));
        said = true;
      }
      std::this_thread::sleep_for(kWaitStep);
    }
  } catch (const Error& e) {
    if (server_) note(fmt::format("ending restart round {}: {}", round, e.what()));
  }
}

}  // namespace

std::optional<std::string> write_first_failure(store::Client& client, const std::string& prefix,
                                               int round, const std::string& line, bool final) {
  const auto deadline = Clock::now() + kCallTime;
  const std::string failed = fmt::format("{}{}/failed", prefix, round);
  if (final && !client.check({failed}, deadline)) {
    client.compare_set(fmt::format("{}{}/final", prefix, round), "", line, deadline);
  }
  std::string first = client.compare_set(failed, "", line, deadline);
  if (first != line) return first;
  return std::nullopt;
}

bool failure_is_final(store::Client& client, const std::string& prefix, int round) {
  try {
    return client.check({fmt::format("{}{}/final", prefix, round)}, Clock::now() + kCallTime);
  } catch (const Error&) {
    return false;
  }
}

std::optional<std::string> StorePoll::operator()(
    const std::function<std::optional<std::string>(Clock::time_point)>& ask,
    const std::function<void()>& on_error) {
  const auto now = Clock::now();
  if (now < next_) return std::nullopt;
  next_ = now + kPollInterval;
  try {
    return ask(now + kCallTime);
  } catch (const Error& e) {
    if (on_error) on_error();
    if (!noted_) {
      note(fmt::format("could not ask the agent store whether the other nodes are well ({}); "
                       "the workers go on (they fail by themselves if their peers are gone)",
                       e.what()));
    }
    noted_ = true;
    next_ = now + kPollBackoff;
    return std::nullopt;
  }
}

// Note [Hosting the store]: the same rules as rank 0's store (DDP_STORE_BIND,
// DDP_STORE_MAX_BYTES, the notes), read from the environment the workers get.
std::unique_ptr<store::Server> host_agent_store(const LaunchConfig& c, const EnvMap& base_env,
                                                const std::string& key, const std::string& secret,
                                                const std::string& who, bool none_if_in_use,
                                                bool quiet) {
  auto knob = [&](const char* name) {
    auto it = base_env.find(name);
    return it != base_env.end() ? it->second : std::string();
  };
  store::HostOptions o;
  o.master_addr = c.master_addr;
  o.port = c.master_port;
  o.bind = knob("DDP_STORE_BIND");
  o.key = key;
  o.has_secret = !secret.empty();
  if (const std::string max = knob("DDP_STORE_MAX_BYTES"); !max.empty()) {
    o.max_bytes = parse::byte_size(max);
    if (!o.max_bytes) {
      throw Error(fmt::format(
          "DDP_STORE_MAX_BYTES='{}' is not a size in bytes (e.g. 268435456, 256M or 1G)", max));
    }
  }
  o.name = "the agent store";
  o.log = [quiet](const std::string& line) {  // "ddp: ...": ours, not a worker's
    if (quiet) return;
    note(line.rfind("ddp: ", 0) == 0 ? line.substr(5) : line);
  };
  try {
    return store::host(o);
  } catch (const store::HostError& e) {
    if (e.port_in_use && none_if_in_use) return nullptr;
    if (e.port_in_use) {
      throw Error(fmt::format(
          "{} cannot host the job's agent store: port {} (--master-port) is already in use "
          "on this host. Another job, or an earlier run still shutting down, holds it: give "
          "every node another --master-port.",
          who, c.master_port));
    }
    throw Error(fmt::format(
        "{} cannot host the job's agent store on {}:{} (--master-addr, --master-port): {}. "
        "Give --master-addr an address of this host, or set DDP_STORE_BIND.",
        who, c.master_addr, c.master_port, e.what()));
  }
}

std::unique_ptr<Rounds> make_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                    const std::string& run_id, const std::string& secret) {
  if (config.elastic) return make_elastic_rounds(config, base_env, run_id, secret);
  if (config.nnodes <= 1) return std::make_unique<LocalRounds>();
  return std::make_unique<StoreRounds>(config, base_env, run_id, secret);
}

}  // namespace ddp::launcher
