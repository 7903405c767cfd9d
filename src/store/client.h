// The rendezvous store's client: every call is bounded by a deadline. Torch-free.
//
// A call connects first when it has no connection (retrying refused connections until its
// deadline: the host may not listen yet), proves the job key and checks the server's proof
// (Note [Store protocol]), sends one request and reads one answer, each step bounded by what
// is left of the deadline. Any failure closes the connection (an answer may still be on its
// way) and throws ddp::RendezvousError naming the endpoint, the request and what did not
// answer; the next call connects again. Thread-safe: calls are serialised, and waiting for
// another thread's call counts against the caller's deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "base/thread_annotations.h"  // TimedMutex, GUARDED_BY
#include "ddp/error.h"
#include "store/net.h"
#include "store/protocol.h"

namespace ddp::store {

using Clock = std::chrono::steady_clock;

// The store could not be reached at all (nothing listens, no route, name unknown) before the
// deadline. The rendezvous turns it into its own message ("Missing ranks: 0").
class UnreachableError : public RendezvousError {
 public:
  UnreachableError(const std::string& what, std::string cause_in)
      : RendezvousError(what), cause(std::move(cause_in)) {}
  std::string cause;  // "connection refused"
};

// The store refused connections where it had served this client: its host process exited.
// Definite, unlike a store that is not up yet or does not answer.
class StoreExitedError : public UnreachableError {
 public:
  using UnreachableError::UnreachableError;
};

// The endpoint answered, but not as this job's store does: it refused this process (another
// job key), proved no key, speaks another protocol version, or is another program. Waiting and
// trying again cannot help, unlike a store that is not up yet or does not answer in time.
class RefusedError : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

struct ClientOptions {
  std::string host;      // a name or an IP literal (MASTER_ADDR)
  int port = 0;          // MASTER_PORT
  std::string key;       // job_key()
  std::string identity;  // sent in the hello, shown in the store's log ("rank 1, pid 4711 on n3")
  std::string who;       // opens every error message, e.g. "[rank 1]"
  std::string owner;     // who hosts the store, for messages: "rank 0"
  Limits limits;
};

class Client {
 public:
  explicit Client(ClientOptions options);
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  const ClientOptions& options() const { return o_; }
  std::string endpoint() const { return format_endpoint(o_.host, o_.port); }

  // Connects and authenticates now (a call would do it anyway).
  void connect(Clock::time_point deadline) EXCLUDES(mu_);

  // c10d::Store's operations. `wait` is how long the server waits for missing keys; the
  // deadline bounds the whole call (keep it a little past `wait`, so that a slow key and a
  // silent server are told apart).
  void set(const std::string& key, std::string_view value, Clock::time_point deadline);
  std::string get(const std::string& key, std::chrono::milliseconds wait,
                  Clock::time_point deadline);
  int64_t add(const std::string& key, int64_t delta, Clock::time_point deadline);
  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired, Clock::time_point deadline);
  bool check(const std::vector<std::string>& keys, Clock::time_point deadline);
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds wait,
            Clock::time_point deadline);
  bool remove(const std::string& key, Clock::time_point deadline);
  int64_t num_keys(Clock::time_point deadline);

 private:
  struct Answer {
    Status status;
    std::string body;  // after the status byte
  };
  // Sends one request and reads its answer; `what` names it in errors ("add(\"joined\")").
  Answer call(const std::string& request, const std::string& what, Clock::time_point deadline,
              Clock::time_point started) EXCLUDES(mu_);
  void connect_locked(Clock::time_point deadline, Clock::time_point started) REQUIRES(mu_);
  void handshake(Clock::time_point deadline, Clock::time_point started) REQUIRES(mu_);
  // Both throw internal NoAnswer / Closed values (client.cpp), or fail() on a bad frame.
  void send_all(std::string_view bytes, Clock::time_point deadline) REQUIRES(mu_);
  std::string read_frame(size_t limit, Clock::time_point deadline) REQUIRES(mu_);
  [[noreturn]] void fail(const std::string& message) REQUIRES(mu_);
  // fail() with a RefusedError.
  [[noreturn]] void refuse(const std::string& message) REQUIRES(mu_);
  std::string silent_host_hint() const;

  // Constant after construction.
  const ClientOptions o_;

  TimedMutex mu_;          // one call at a time
  Fd fd_ GUARDED_BY(mu_);  // invalid: not connected
  // A store that served this client and now refuses connections has exited: no retrying then
  // (a store that is not up yet, or a silent one, is retried until the deadline).
  bool served_ GUARDED_BY(mu_) = false;
};

}  // namespace ddp::store
