// Rendezvous: turning WORLD_SIZE independent processes into one group, or failing loudly.
//
// Note [Counting rendezvous]
// LibTorch 1.13's TCPStore does not check that every rank arrived (with waitWorkers=false it
// proceeds; with true it hangs without naming anyone). We count ourselves, over the store:
//   1. Connect: rank 0 hosts the TCPStore server on MASTER_ADDR:MASTER_PORT unless the
//      launcher's agent already does (torchrun); everyone else connects as a client, retrying
//      until the rendezvous timeout. A port in use or an unreachable host fails here, named.
//   2. Agree on the world size: compareSet("world_size", "", "<N>:<rank>") is first-writer-wins,
//      so every rank learns the WORLD_SIZE of the first rank to arrive and compares its own.
//   3. Claim the rank: add("rank/<r>", 1) must return 1; a second claimant is a duplicate RANK.
//   4. Count: add("joined", 1), then poll until joined == N. A rank that detects a problem (2,
//      3, or the timeout) writes the reason under "abort", which every waiting rank also polls,
//      so all ranks fail together with the same message instead of waiting out their timeout.
//      Each rank acknowledges an abort ("abort_ack"); the host of the store keeps it up (at
//      most 2 s) until every rank that "connected" has, so nobody sees a dropped connection
//      instead of the reason.
//   5. On timeout the missing ranks are those with no "rank/<r>" key: "k/N ranks joined
//      after T s; missing ranks: ...".
// Keys live under "ddp/<run id>/attempt_<restart count>/<group name>/", so a restarted group
// (or another group on the same store) never sees stale keys.
#pragma once

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddp::rendezvous {

struct Config {
  int rank = 0;
  int world_size = 1;
  std::string master_addr;
  int master_port = 0;
  bool use_agent_store = false;  // every rank is a client of the launcher's store
  std::string key_prefix;        // e.g. "ddp/<run id>/attempt_0/default/"
  std::chrono::milliseconds timeout{0};
};

// Returns a store shared by all ranks (prefixed with key_prefix) once all world_size ranks have
// joined. world_size == 1 uses an in-process store: no socket is opened.
c10::intrusive_ptr<::c10d::Store> join(const Config& config);

}  // namespace ddp::rendezvous
