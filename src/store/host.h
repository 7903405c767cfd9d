// Hosting the rendezvous store: the one place that turns "this process hosts the job's store"
// into a listening server. Used by rank 0 (rendezvous.cpp) and by node 0's ddprun (a multi-node
// job's agent store, tools/ddprun/agent_store.cpp). Torch-free.
//
// Note [Hosting the store]
// Both hosts apply the same rules: listen where the job's processes reach the store (Note
// [Where the store listens]; DDP_STORE_BIND), admit only holders of the job's key (Note [Store
// protocol]), cap the stored bytes (DDP_STORE_MAX_BYTES), and say so, once, when the store
// listens on every interface as a fallback, or beyond loopback without a secret (anyone who
// reaches it and knows the run id could join).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "store/server.h"

namespace ddp::store {

struct HostOptions {
  std::string master_addr;  // where the other processes connect (MASTER_ADDR, --master-addr)
  int port = 0;
  bool single_host = false;           // every process of the job runs on this host
  std::string bind;                   // DDP_STORE_BIND ("" when unset)
  std::string key;                    // job_key(secret, run id)
  bool has_secret = false;            // DDP_STORE_SECRET was given
  std::optional<uint64_t> max_bytes;  // DDP_STORE_MAX_BYTES; unset: the server's default
  std::string name;                   // "the rendezvous store", "the agent store": for notes
  // Notes and the server's own log lines ("ddp: ...", no trailing newline). Unset: the log
  // sink (Note [Logging]) as rank `rank` (-1: none).
  std::function<void(const std::string&)> log;
  int rank = -1;
};

// The server could not bind or listen.
class HostError : public std::runtime_error {
 public:
  HostError(const std::string& what, bool port_in_use_in)
      : std::runtime_error(what), port_in_use(port_in_use_in) {}
  bool port_in_use;  // EADDRINUSE: another job, or an earlier run still shutting down
};

// Listening and serving on its own thread (Server), or HostError.
std::unique_ptr<Server> host(const HostOptions& options);

}  // namespace ddp::store
