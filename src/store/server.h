// The rendezvous store's server: a key-value store on a TCP port that a stranger cannot join,
// stall or grow. Torch-free; rank 0 (or whoever hosts the store) runs one.
//
// Note [Store server]
// One thread, one epoll loop, non-blocking sockets; nothing it does can block on a peer:
//   - A connection must prove it holds the job key (Note [Store protocol]) within
//     handshake_timeout of its accept, sending at most kMaxHelloBytes meanwhile; at most
//     max_pending such connections exist at once (a new one closes the oldest), so hundreds of
//     idle or slow strangers cost a bounded number of sockets and bytes, and a rank that
//     connects among them still gets in.
//   - Every frame's length is checked against the connection's limit before its body is read;
//     buffers grow only with bytes actually received (a 1 GiB length prefix costs nothing).
//   - A peer's half-sent frame stalls only its own connection: others are served meanwhile,
//     and an authenticated peer that stops mid-frame for stall_timeout is closed.
//   - Requests of one connection are answered in order, one at a time; a get/wait whose keys
//     are missing parks that connection (never the loop) until the keys appear or its wait
//     time ends (answered kTimeout). A peer that does not read its answers is not read either.
//   - The stored bytes (keys + values + kEntryOverhead each) are capped at max_stored_bytes; a
//     set beyond it is refused with the reason, the store stays as it was.
//   - Stopping (the destructor) closes every socket at once: a client holding a socket open
//     never keeps the host from exiting.
// Whoever is refused or dropped is logged with its address and why (at most kLogBurst lines
// per log_window, 10 s; the rest are counted in a summary line).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "store/protocol.h"

namespace ddp::store {

// Stored entries cost their key and value plus this, for the map's own bookkeeping.
inline constexpr size_t kEntryOverhead = 64;
// Refusals logged one by one per log window; the rest are summed up in one line.
inline constexpr size_t kLogBurst = 20;

struct ServerOptions {
  // IP literals to listen on (e.g. "127.0.0.1"); empty: every interface (0.0.0.0 and ::).
  std::vector<std::string> bind_addresses;
  int port = 0;     // 0: the kernel picks one (tests); see Server::port()
  std::string key;  // job_key(): what clients must prove they hold
  Limits limits;
  size_t max_stored_bytes = size_t{256} << 20;  // DDP_STORE_MAX_BYTES
  size_t max_pending = 64;                      // connections not yet authenticated, at once
  size_t max_connections = 4096;                // all connections, at once
  std::chrono::milliseconds handshake_timeout{10'000};
  std::chrono::milliseconds stall_timeout{30'000};  // mid-frame, or not reading its answers
  // Receives each log line (no newline). Unset: "ddp: ..." lines on stderr.
  std::function<void(const std::string&)> log;
  // At most kLogBurst refusals are logged one by one per window; the rest are counted.
  std::chrono::milliseconds log_window{10'000};
};

// Binding or listening failed; `error` is the errno (EADDRINUSE: the port is taken).
class BindError : public std::runtime_error {
 public:
  BindError(const std::string& what, int error_in, std::string address_in)
      : std::runtime_error(what), error(error_in), address(std::move(address_in)) {}
  int error;
  std::string address;  // "127.0.0.1:29500"
};

class Server {
 public:
  // Binds and listens on every address (throws BindError), then serves on its own thread.
  explicit Server(ServerOptions options);
  // Stops at once: closes every connection, waits for no client.
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  int port() const { return port_; }
  // "127.0.0.1:29500" (or "0.0.0.0:29500, [::]:29500"): where it listens, for messages.
  const std::string& listening() const { return listening_; }
  // An address this host reaches it on ("127.0.0.1" when it listens on every interface).
  const std::string& local_address() const { return local_address_; }

  // Counters for tests and messages, updated by the serving thread.
  struct Stats {
    size_t connections = 0;
    size_t authenticated = 0;
    size_t pending = 0;
    uint64_t refused = 0;  // connections refused or dropped, in total
    size_t stored_bytes = 0;
    size_t keys = 0;
  };
  Stats stats() const;

  struct Loop;  // the serving thread's state (server.cpp)

 private:
  int port_ = 0;
  std::string listening_;
  std::string local_address_;
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
};

}  // namespace ddp::store
