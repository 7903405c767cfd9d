// Where a job's rounds are kept: the key-value operations the round store (round_store.h) needs,
// behind one small interface with two backends: the agent store (src/store, hosted by a ddprun:
// --rdzv-backend c10d and static) and etcd (etcd.h: --rdzv-backend etcd).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "store/client.h"  // store::Clock, store::ClientOptions

namespace ddp::launcher {

// c10d::Store's operations as the rounds use them. Every call is bounded by its deadline and
// throws RendezvousError when the store does not answer in time (the rounds ask again), or
// store::RefusedError when asking again cannot help (another job's store, refused credentials).
class KeyValue {
 public:
  using Clock = store::Clock;
  using Deadline = Clock::time_point;

  virtual ~KeyValue() = default;

  virtual void set(const std::string& key, std::string_view value, Deadline deadline) = 0;
  // The value of `key`, waiting up to `wait` for it to be set; RendezvousError when it is not.
  virtual std::string get(const std::string& key, std::chrono::milliseconds wait,
                          Deadline deadline) = 0;
  // Adds `delta` to the decimal number `key` holds (0 when absent) and returns the sum.
  virtual int64_t add(const std::string& key, int64_t delta, Deadline deadline) = 0;
  // c10d's rule: sets `desired` when `key` is absent and `expected` is empty, or when it holds
  // `expected`; returns the value it holds afterwards (`expected` for an absent key not set).
  virtual std::string compare_set(const std::string& key, std::string_view expected,
                                  std::string_view desired, Deadline deadline) = 0;
  virtual bool check(const std::string& key, Deadline deadline) = 0;

  // Signs of life (Note [Round store keys]: alive/<id>). The agent store counts them: a count
  // that stops moving is a node gone. etcd ties the key to this node's lease instead (Note
  // [etcd backend] in etcd.h): the key vanishes when the lease expires, and count_beats returns
  // -1 for a vanished key, a node known dead at once.
  virtual void beat(const std::string& key, Deadline deadline) = 0;
  virtual int64_t count_beats(const std::string& key, Deadline deadline) = 0;

  // Returns once a key under `prefix` is written or deleted (writes under `quiet` aside: signs of
  // life), or after `timeout`. etcd watches (Note [etcd backend] in etcd.h), from the newest
  // revision this client has read, so a change since then returns at once; the agent store
  // cannot tell, and waits `timeout`: its callers poll.
  virtual void wait_for_change(const std::string& prefix, const std::string& quiet,
                               std::chrono::milliseconds timeout);

  // Where it is, for messages: "10.0.0.1:29400", "etcd at 10.0.0.1:2379,10.0.0.2:2379".
  virtual std::string describe() const = 0;
  // The address this host reached the store from on its last call ("-": unknown). On etcd, node
  // rank 0's is where its workers' store listens (Note [etcd backend] in etcd.h).
  virtual std::string local_address() const { return "-"; }
};

// The agent store at `options`' endpoint (a ddprun hosts it: agent_store.h).
std::unique_ptr<KeyValue> agent_store_key_value(const store::ClientOptions& options);

}  // namespace ddp::launcher
