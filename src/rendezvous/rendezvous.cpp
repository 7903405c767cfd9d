// Counting rendezvous over a TCPStore (see Note [Counting rendezvous] in rendezvous.h).
#include "rendezvous/rendezvous.h"

#include <unistd.h>  // gethostname, getpid

#include <algorithm>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "base/check.h"
#include "c10d/compat.h"

namespace ddp::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }
std::string text(const std::vector<uint8_t>& b) { return {b.begin(), b.end()}; }

double seconds(std::chrono::milliseconds ms) { return ms.count() / 1000.0; }

std::string this_host() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

std::string endpoint(const Config& c) { return fmt::format("{}:{}", c.master_addr, c.master_port); }

c10::intrusive_ptr<::c10d::Store> connect(const Config& c) {
  ::c10d::TCPStoreOptions opts;
  opts.port = static_cast<uint16_t>(c.master_port);
  opts.isServer = c.rank == 0 && !c.use_agent_store;
  opts.waitWorkers = false;  // we count ranks ourselves
  opts.timeout = c.timeout;
  try {
    return c10d_compat::make_tcp_store(c.master_addr, opts);  // Note [TCPStore and libuv]
  } catch (const std::exception& e) {
    const std::string why = e.what();
    if (opts.isServer) {
      const bool in_use = why.find("errno: 98") != std::string::npos ||
                          why.find("Address already in use") != std::string::npos;
      if (in_use) {
        throw RendezvousError(fmt::format(
            "[rank 0] cannot host the rendezvous store: port {} (MASTER_PORT) is already in use "
            "on this host. Another job, or an earlier run still shutting down, holds it: pick a "
            "free port with --master-port / MASTER_PORT, or let ddprun --standalone choose one.",
            c.master_port));
      }
      throw RendezvousError(fmt::format(
          "[rank 0] cannot host the rendezvous store on {} (MASTER_ADDR:MASTER_PORT): {}",
          endpoint(c), why));
    }
    std::string cause = why;
    while (!cause.empty() && (cause.back() == '.' || cause.back() == '\n')) cause.pop_back();
    throw RendezvousError(fmt::format(
        "[rank {}] could not reach the rendezvous store at {} (MASTER_ADDR:MASTER_PORT) within "
        "{:.1f} s: {}. Rank 0 hosts the store{}: it has not started, has exited, or listens on "
        "another address or port. Missing ranks: 0 (at least). Check that every rank was given "
        "the same MASTER_ADDR and MASTER_PORT and that rank 0 is running.",
        c.rank, endpoint(c), seconds(c.timeout), cause,
        c.use_agent_store ? " (here: the launcher's agent)" : ""));
  }
}

// How long the rank hosting the store lingers after a failed rendezvous so that the others can
// read why (they acknowledge under "abort_ack"), instead of seeing a broken connection.
constexpr auto kAbortLinger = std::chrono::seconds(2);

// Counts ranks until all joined (see Note [Counting rendezvous]). Throws on abort or timeout.
void count(::c10d::Store& store, const Config& c) {
  const std::string me =
      fmt::format("{}:{}:{}:{}", c.world_size, c.rank, this_host(), static_cast<int>(getpid()));
  const bool hosting = c.rank == 0 && !c.use_agent_store;
  // Acknowledges an abort (whoever raised it). The store's host then keeps the store up until
  // every rank that connected has acknowledged too (at most kAbortLinger), so that nobody sees
  // a dropped connection instead of the reason.
  auto acknowledge = [&] {
    store.add("abort_ack", 1);
    if (!hosting) return;
    const auto until = Clock::now() + kAbortLinger;
    while (Clock::now() < until && store.add("abort_ack", 0) < store.add("connected", 0)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
  };
  // Ends the rendezvous on every rank with `reason`.
  auto fail = [&](const std::string& reason) {
    store.set("abort", bytes(reason));
    acknowledge();
    throw RendezvousError(reason);
  };

  // Counted before anything can fail, so that the host knows whom to wait for on an abort.
  store.add("connected", 1);

  // 2. One world size for all.
  const std::string first = text(store.compareSet("world_size", {}, bytes(me)));
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
  if (store.add(rank_key, 1) != 1) {
    std::string other = "another process";
    if (store.check({rank_key + "/owner"})) other = text(store.get(rank_key + "/owner"));
    fail(fmt::format(
        "[rank {}] duplicate RANK: RANK={} was already claimed by {} (WORLD_SIZE:RANK:host:pid). "
        "Each process needs a distinct RANK in [0, {}).",
        c.rank, c.rank, other, c.world_size));
  }
  store.set(rank_key + "/owner", bytes(me));

  // 4. Count.
  store.add("joined", 1);
  const auto start = Clock::now();
  auto backoff = std::chrono::milliseconds(1);
  while (true) {
    if (store.check({"abort"})) {
      const std::string reason = text(store.get("abort"));
      acknowledge();
      throw RendezvousError(reason);
    }
    const int64_t joined = store.add("joined", 0);
    if (joined >= c.world_size) return;
    if (Clock::now() - start >= c.timeout) {
      // 5. Name the missing.
      std::vector<int> missing;
      for (int r = 0; r < c.world_size; ++r) {
        if (!store.check({fmt::format("rank/{}", r)})) missing.push_back(r);
      }
      fail(fmt::format(
          "[rank {}] rendezvous timed out: {}/{} ranks joined after {:.1f} s; missing ranks: {}. "
          "Start every rank with the same MASTER_ADDR:MASTER_PORT ({}), or raise the timeout "
          "(DDP_RDZV_TIMEOUT, ddprun --rdzv-timeout) if they start slowly.",
          c.rank, joined, c.world_size, seconds(c.timeout), fmt::join(missing, ", "),
          endpoint(c)));
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
  auto tcp = connect(config);
  tcp->setTimeout(config.timeout);
  auto store = c10::make_intrusive<::c10d::PrefixStore>(config.key_prefix, tcp);
  try {
    count(*store, config);
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
