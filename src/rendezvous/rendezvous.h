// Rendezvous: turning WORLD_SIZE independent processes into one group, or failing loudly.
//
// Note [Counting rendezvous]
// LibTorch 1.13's TCPStore does not check that every rank arrived (with waitWorkers=false it
// proceeds; with true it hangs without naming anyone). We count ourselves, over the store:
//   1. Connect: rank 0 hosts the store (ours: src/store, Note [Store server]) on
//      MASTER_ADDR:MASTER_PORT unless the launcher's agent already hosts one (torchrun's
//      TCPStore, reached through store::BoundedStore; or a ddp-cpp store with DDP_AGENT_STORE=
//      ddp); everyone connects as a client, retrying refused connections until the rendezvous
//      timeout, and proves it holds the job's key (Note [Store protocol]). A port in use, an
//      unreachable host, a silent one (stopped, or another program's port) or a wrong secret
//      fails here, named.
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
// Every store call is bounded (Note [Bounded store calls]); while counting, by what is left of
// the rendezvous timeout, so a store whose host freezes mid-rendezvous fails the rank in time,
// naming the endpoint and the call that got no answer.
// Keys live under "ddp/<run id>/attempt_<restart count>/<group name>/", so a restarted group
// (or another group on the same store) never sees stale keys.
#pragma once

#include <chrono>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "ddp/env.h"

namespace ddp::rendezvous {

// Where this rank stands (the launch environment, whole: no field-by-field copy to forget one)
// and what the process group decided on top of it.
struct Config : DistEnv {
  explicit Config(const DistEnv& env) : DistEnv(env) {}
  bool single_host = false;  // every rank runs on this host (where the store listens)
  std::string key_prefix;    // e.g. "ddp/<run id>/attempt_0/default/"
  std::chrono::milliseconds timeout{0};
};

// Returns a store shared by all ranks (prefixed with key_prefix) once all world_size ranks have
// joined. world_size == 1 uses an in-process store: no socket is opened.
c10::intrusive_ptr<::c10d::Store> join(const Config& config);

}  // namespace ddp::rendezvous
