// Counting rendezvous over the store (see Note [Counting rendezvous] in rendezvous.h).
#include "rendezvous/rendezvous.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <cerrno>  // EADDRINUSE
#include <cstdio>  // stderr
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "base/check.h"
#include "base/net.h"  // host_name, unresolvable
#include "c10d/compat.h"
#include "store/host.h"        // host
#include "store/c10d_store.h"  // DdpStore, BoundedStore

namespace ddp::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

double seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

std::string endpoint(const Config& c) {
  return store::format_endpoint(c.master_addr, c.master_port);
}

bool hosting(const Config& c) { return c.rank == 0 && !c.use_agent_store; }

std::string who_hosts(const Config& c) {
  if (c.use_agent_store) return "the launcher's agent";
  return c.rank == 0 ? "rank 0, this process" : "rank 0";
}

// Where the store's address came from, for messages.
std::string address_source(const Config& c) {
  return c.master_addr_source.empty() ? "MASTER_ADDR:MASTER_PORT" : c.master_addr_source;
}

// The message for a store nobody answered at all (refused, no route, unknown name).
[[noreturn]] void unreachable(const Config& c, std::string cause) {
  while (!cause.empty() && (cause.back() == '.' || cause.back() == '\n')) cause.pop_back();
  throw RendezvousError(fmt::format(
      "[rank {}] could not reach the rendezvous store at {} ({}) within {:.1f} s: {}. Rank 0 "
      "hosts the store{}: it has not started, has exited, or listens on another address or "
      "port. Missing ranks: 0 (at least). Check that every rank was given the same MASTER_ADDR "
      "and MASTER_PORT and that rank 0 is running.",
      c.rank, endpoint(c), address_source(c), seconds(c.timeout), cause,
      c.use_agent_store ? " (here: the launcher's agent)" : ""));
}

// A name from a launcher's node list (Slurm's) must resolve, and one that does not will not
// start to: say so at once, naming the variable. MASTER_ADDR itself is retried until the
// timeout, as torchrun does: such a name may appear late (a service starting with rank 0).
void check_listed_name_resolves(const Config& c) {
  if (c.master_addr_source.empty()) return;
  const std::optional<std::string> why = net::unresolvable(c.master_addr);
  if (!why) return;  // resolves, or DNS did not answer now: the connection's retries report it
  throw ConfigError(fmt::format(
      "[rank {}] the rendezvous address '{}', {}, does not resolve on this host ({}). Export "
      "MASTER_ADDR=<the address of rank 0's node> to every task (srun --export=ALL,MASTER_ADDR="
      "...), or make the node names resolve here (/etc/hosts, DNS).",
      c.rank, c.master_addr, c.master_addr_source, *why));
}

// torchrun's agent hosts LibTorch's TCPStore: reached through a TCPStore client, each call of
// which runs under a deadline (Note [Bounded store calls]).
c10::intrusive_ptr<::c10d::Store> connect_agent_tcpstore(const Config& c) {
  ::c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(c.master_port);
  opts.isServer = false;
  opts.waitWorkers = false;  // we count ranks ourselves
  opts.timeout = c.timeout;
  auto make = [host = c.master_addr, opts]() -> c10::intrusive_ptr<::c10d::Store> {
    return c10d_compat::make_tcp_store(host, opts);  // Note [TCPStore and libuv]
  };
  try {
    return c10::make_intrusive<store::BoundedStore>(make, c.timeout,
                                                    fmt::format("[rank {}]", c.rank), endpoint(c),
                                                    who_hosts(c));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    unreachable(c, e.what());
  }
}

// Rank 0 hosts our store where the job's ranks reach it (Note [Hosting the store]).
std::shared_ptr<store::Server> host_store(const Config& c, const std::string& key) {
  store::HostOptions o;
  o.master_addr = c.master_addr;
  o.port = c.master_port;
  o.single_host = c.single_host;
  o.bind = c.store_bind;
  o.key = key;
  o.has_secret = !c.store_secret.empty();
  o.max_bytes = c.store_max_bytes;
  o.name = "the rendezvous store";
  o.rank = 0;
  try {
    return store::host(o);
  } catch (const store::HostError& e) {
    if (e.port_in_use) {
      throw RendezvousError(fmt::format(
          "[rank 0] cannot host the rendezvous store: port {} (MASTER_PORT) is already in use "
          "on this host. Another job, or an earlier run still shutting down, holds it: pick a "
          "free port with --master-port / MASTER_PORT, or let ddprun --standalone choose one.",
          c.master_port));
    }
    throw RendezvousError(fmt::format(
        "[rank 0] cannot host the rendezvous store on {} (MASTER_ADDR:MASTER_PORT): {}. Set "
        "DDP_STORE_BIND to an address of this host (or 'any').",
        endpoint(c), e.what()));
  }
}

c10::intrusive_ptr<::c10d::Store> connect(const Config& c) {
  if (c.use_agent_store && !c.agent_store_is_ddp) return connect_agent_tcpstore(c);
  const std::string key = store::job_key(c.store_secret, c.run_id);
  std::shared_ptr<store::Server> server;
  if (hosting(c)) server = host_store(c, key);
  store::ClientOptions o;
  // The host reaches its own server on an address it listens on, whatever MASTER_ADDR says.
  o.host = server ? server->local_address() : c.master_addr;
  o.port = server ? server->port() : c.master_port;
  o.key = key;
  o.identity =
      fmt::format("rank {}, pid {} on {}", c.rank, static_cast<int>(getpid()), net::host_name());
  o.who = fmt::format("[rank {}]", c.rank);
  o.owner = who_hosts(c);
  auto s = c10::make_intrusive<store::DdpStore>(o, c.timeout, server);
  try {
    s->connect(store::Clock::now() + c.timeout);
  } catch (const store::UnreachableError& e) {
    unreachable(c, e.cause);
  }
  return s;
}

// How long the rank hosting the store lingers after a failed rendezvous so that the others can
// read why (they acknowledge under "abort_ack"), instead of seeing a broken connection.
constexpr auto kAbortLinger = std::chrono::seconds(2);

// While counting, each store call may take what is left of the rendezvous timeout, and no less
// than this (the abort path runs after the timeout and must still be able to say why).
constexpr auto kMinCallTime = std::chrono::seconds(1);

// Counts ranks until all joined (see Note [Counting rendezvous]). Throws on abort or timeout.
// `raw` is the store under `prefixed`, whose timeout bounds each call.
void count(::c10d::Store& prefixed, ::c10d::Store& raw, const Config& c) {
  const std::string me = fmt::format("{}:{}:{}:{}", c.world_size, c.rank, net::host_name(),
                                     static_cast<int>(getpid()));
  const bool hosting = rendezvous::hosting(c);
  const auto deadline = Clock::now() + c.timeout;
  // The store, its next call bounded by the time left.
  auto bounded = [&]() -> ::c10d::Store& {
    const auto left =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    raw.setTimeout(std::max<std::chrono::milliseconds>(left, kMinCallTime));
    return prefixed;
  };
  // Acknowledges an abort (whoever raised it). The store's host then keeps the store up until
  // every rank that connected has acknowledged too (at most kAbortLinger), so that nobody sees
  // a dropped connection instead of the reason.
  auto acknowledge = [&] {
    bounded().add("abort_ack", 1);
    if (!hosting) return;
    const auto until = Clock::now() + kAbortLinger;
    while (Clock::now() < until && bounded().add("abort_ack", 0) < bounded().add("connected", 0)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  // Ends the rendezvous on every rank with `reason`.
  auto fail = [&](const std::string& reason) {
    bounded().set("abort", bytes(reason));
    acknowledge();
    throw RendezvousError(reason);
  };

  // Counted before anything can fail, so that the host knows whom to wait for on an abort.
  bounded().add("connected", 1);

  // 2. One world size for all.
  const std::string first = text(bounded().compareSet("world_size", {}, bytes(me)));
  if (first != me) {
    const int their_world = std::stoi(first.substr(0, first.find(':')));
    if (their_world != c.world_size) {
      const std::string rest = first.substr(first.find(':') + 1);
      fail(fmt::format(
          "[rank {}] WORLD_SIZE differs between ranks: {} here, but {} on rank {} (host {}). "
          "Every rank must be started with the same WORLD_SIZE.",
          c.rank, c.world_size, their_world, rest.substr(0, rest.find(':')),
          rest.substr(rest.find(':') + 1)));
    }
  }
  // 3. One process per rank.
  const std::string rank_key = fmt::format("rank/{}", c.rank);
  if (bounded().add(rank_key, 1) != 1) {
    std::string other = "another process";
    if (bounded().check({rank_key + "/owner"})) other = text(bounded().get(rank_key + "/owner"));
    fail(fmt::format(
        "[rank {}] duplicate RANK: RANK={} was already claimed by {} (WORLD_SIZE:RANK:host:pid). "
        "Each process needs a distinct RANK in [0, {}).",
        c.rank, c.rank, other, c.world_size));
  }
  bounded().set(rank_key + "/owner", bytes(me));

  // 4. Count.
  bounded().add("joined", 1);
  const auto start = Clock::now();
  auto backoff = std::chrono::milliseconds(1);
  while (true) {
    if (bounded().check({"abort"})) {
      const std::string reason = text(bounded().get("abort"));
      acknowledge();
      throw RendezvousError(reason);
    }
    const int64_t joined = bounded().add("joined", 0);
    if (joined >= c.world_size) return;
    if (Clock::now() - start >= c.timeout) {
      // 5. Name the missing.
      std::vector<int> missing;
      for (int r = 0; r < c.world_size; ++r) {
        if (!bounded().check({fmt::format("rank/{}", r)})) missing.push_back(r);
      }
      fail(fmt::format(
          "[rank {}] rendezvous timed out: {}/{} ranks joined after {:.1f} s; missing ranks: {}. "
          "Start every rank with the same MASTER_ADDR:MASTER_PORT ({}), or raise the timeout "
          "(DDP_RDZV_TIMEOUT, ddprun --rdzv-timeout) if they start slowly.",
          c.rank, joined, c.world_size, seconds(c.timeout), fmt::join(missing, ", "), endpoint(c)));
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(50));
  }
}

}  // namespace

c10::intrusive_ptr<::c10d::Store> join(const Config& config) {
  DDP_ASSERT(config.world_size >= 1 && config.rank >= 0 && config.rank < config.world_size,
             "rank {} world {}", config.rank, config.world_size);
  if (config.world_size == 1 && !config.use_agent_store) {
    return c10::make_intrusive<::c10d::HashStore>();
  }
  check_listed_name_resolves(config);
  auto raw = connect(config);
  auto store = c10::make_intrusive<::c10d::PrefixStore>(config.key_prefix, raw);
  try {
    count(*store, *raw, config);
    raw->setTimeout(config.timeout);  // the bound of every later call (Gloo's, ours)
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    // The store went away mid-rendezvous: its host (rank 0) failed or exited.
    throw RendezvousError(fmt::format(
        "[rank {}] lost the rendezvous store at {} during the rendezvous: {}. Its host{} has "
        "probably failed: look for its own error.",
        config.rank, endpoint(config), e.what(),
        config.use_agent_store ? " (the launcher's agent)" : " (rank 0)"));
  }
  return store;
}

}  // namespace ddp::rendezvous
