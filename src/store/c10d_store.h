// The rendezvous store as a c10d::Store, for Gloo, NCCL, PrefixStore and our own setup code.
//
//   DdpStore      our store (server.h, client.h): every call bounded by the store's timeout.
//   BoundedStore  any other c10d::Store (torchrun's agent TCPStore, which we do not control and
//                 whose 1.13 client blocks without limit in add/set/check): each call runs on a
//                 thread of the store's own and the caller stops waiting at its deadline.
//
// Note [Bounded store calls]
// Every call gets a deadline from the store's timeout (c10d's getTimeout/setTimeout):
//   - set, add, compareSet, check, deleteKey, getNumKeys: the timeout;
//   - get and wait: the server waits up to the timeout for the keys (wait's own timeout when
//     given), and the caller a little longer (kAnswerGrace), so that "the key never came"
//     (the server answers: timed out waiting for "k") and "the store's host is frozen" (no
//     answer at all) are told apart.
// c10d's kNoTimeout (0) means kDefaultTimeout here: nothing waits forever.
// A call that passes its deadline throws ddp::RendezvousError naming the endpoint, the call and
// its key. For BoundedStore the stuck call's thread is abandoned (it cannot be interrupted) and
// the store is broken from then on: every later call fails at once with the same message.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "base/thread_annotations.h"  // TimedMutex, GUARDED_BY
#include "c10d/compat.h"
#include "store/client.h"
#include "store/server.h"

namespace ddp::store {

// How much longer than a get/wait's own timeout its caller waits for the answer.
std::chrono::milliseconds answer_grace(std::chrono::milliseconds wait);

class DdpStore final : public c10d_compat::StoreBase {
 public:
  // `server`: the server this process hosts, kept alive while any handle on it lives (null for
  // a client only). The connection is made by the first call (or connect()).
  DdpStore(ClientOptions options, std::chrono::milliseconds timeout,
           std::shared_ptr<Server> server = nullptr);

  void connect(Clock::time_point deadline) { client_->connect(deadline); }
  const std::shared_ptr<Server>& server() const { return server_; }
  std::string endpoint() const { return client_->endpoint(); }

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  c10::intrusive_ptr<::c10d::Store> clone_store() override;

 private:
  std::chrono::milliseconds bound() const;  // timeout_, kNoTimeout replaced

  // Destroyed in reverse: the client before the server it may be connected to.
  std::shared_ptr<Server> server_;
  std::unique_ptr<Client> client_;
};

class BoundedStore final : public c10d_compat::StoreBase {
 public:
  // Creates the inner store with `make` (e.g. a TCPStore client, which connects) within
  // `timeout` + answer_grace; `make`'s own exceptions reach the caller unchanged. Errors open
  // with `who` ("[rank 1]") and name `endpoint` and `owner` ("the launcher's agent").
  BoundedStore(std::function<c10::intrusive_ptr<::c10d::Store>()> make,
               std::chrono::milliseconds timeout, std::string who, std::string endpoint,
               std::string owner);
  ~BoundedStore() override;

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& expected,
                                  const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override;
  c10::intrusive_ptr<::c10d::Store> clone_store() override;

  struct Worker;  // the thread that makes the calls, and what it shares with callers

 private:
  std::chrono::milliseconds bound() const;
  // Stops the worker: joined, or left behind when a call is stuck in it.
  void shutdown() EXCLUDES(call_mu_);
  // Runs `task` on the worker; the caller waits at most `limit`, then the store is broken.
  void run(const std::string& what, std::chrono::milliseconds limit, std::function<void()> task)
      EXCLUDES(call_mu_);

  // Constant after construction.
  const std::function<c10::intrusive_ptr<::c10d::Store>()> make_;
  const std::string who_, endpoint_, owner_;

  TimedMutex call_mu_;                       // one call at a time
  std::string broken_ GUARDED_BY(call_mu_);  // why every call now fails; empty: not broken
  std::shared_ptr<Worker> worker_;  // shared with its thread, which may outlive a stuck call
  std::thread thread_;
};

}  // namespace ddp::store
