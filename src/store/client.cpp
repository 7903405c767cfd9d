// The store's client (see client.h and Note [Store protocol]).
#include "store/client.h"

#include <poll.h>        // poll
#include <sys/socket.h>  // socket, connect, send, recv

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

namespace ddp::store {
namespace {

using std::chrono::milliseconds;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::ceil<milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<int64_t>(left, 0, 1 << 30));
}

std::string quoted(const std::string& key) { return fmt::format("\"{}\"", printable(key, 120)); }

// What reading or writing met instead of the bytes it wanted (turned into messages by callers).
struct NoAnswer {};
struct Closed {
  std::string cause;  // "the store closed the connection", "Connection reset by peer"
};

// The frame of an answer holding only a status, an error text or a proof.
constexpr size_t kMaxWelcomeBytes = 4096;

}  // namespace

Client::Client(ClientOptions options) : o_(std::move(options)) {}

void Client::fail(const std::string& message) {
  fd_.reset();  // an answer may still be on its way: never read it as the next one's
  throw RendezvousError(message);
}

void Client::refuse(const std::string& message) {
  fd_.reset();
  throw RefusedError(message);
}

std::string Client::silent_host_hint() const {
  return fmt::format(
      "the process hosting it ({}) is stopped (SIGSTOP, a debugger), frozen or overloaded, the "
      "network to its host is down, or {} belongs to another program than this job's store",
      o_.owner, endpoint());
}

void Client::send_all(std::string_view bytes, Clock::time_point deadline) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(fd_.get(), bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_.get(), POLLOUT, 0};
      const int ready = ::poll(&p, 1, remaining_ms(deadline));
      if (ready == 0) throw NoAnswer{};
      continue;
    }
    throw Closed{std::strerror(errno)};
  }
}

std::string Client::read_frame(size_t limit, Clock::time_point deadline) {
  const int fd = fd_.get();  // the lambda reads it: the analysis does not see mu_ held there
  std::string data;
  auto read_exact = [&](size_t n) {
    const size_t want = data.size() + n;
    char buf[64 * 1024];
    while (data.size() < want) {
      const ssize_t got = ::recv(fd, buf, std::min(sizeof buf, want - data.size()), 0);
      if (got > 0) {
        data.append(buf, static_cast<size_t>(got));
        continue;
      }
      if (got == 0) throw Closed{"the store closed the connection"};
      if (errno == EINTR) continue;
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        pollfd p{fd, POLLIN, 0};
        const int ready = ::poll(&p, 1, remaining_ms(deadline));
        if (ready == 0) throw NoAnswer{};
        continue;
      }
      throw Closed{std::strerror(errno)};
    }
  };
  read_exact(kFrameHeaderBytes);
  const uint32_t length = frame_length(data);
  if (length > limit) {
    refuse(
        fmt::format("{} {} is not a ddp-cpp rendezvous store, or is a broken one: it sent \"{}\" "
                    "(as a frame of {} bytes, more than the {} expected here). Check "
                    "MASTER_ADDR and MASTER_PORT.",
                    o_.who, endpoint(), printable(data), length, limit));
  }
  data.clear();
  read_exact(length);
  return data;
}

void Client::handshake(Clock::time_point deadline, Clock::time_point started) {
  const std::string ep = endpoint();
  std::string body;
  try {
    body = read_frame(kMagic.size() + 1 + kNonceBytes, deadline);
  } catch (const NoAnswer&) {
    fail(
        fmt::format("{} the rendezvous store at {} accepted the connection but did not answer "
                    "(no greeting) within {:.1f} s: {}.",
                    o_.who, ep, seconds(Clock::now() - started), silent_host_hint()));
  }
  const std::optional<Nonce> server_nonce = parse_greeting(body);
  if (!server_nonce) {
    refuse(
        fmt::format("{} {} is not a ddp-cpp rendezvous store: it greeted with \"{}\". Check "
                    "MASTER_ADDR and MASTER_PORT.",
                    o_.who, ep, printable(body)));
  }
  if (static_cast<uint8_t>(body[kMagic.size()]) != kVersion) {
    refuse(
        fmt::format("{} the rendezvous store at {} speaks protocol version {}, this process {}: "
                    "the ranks run different builds of ddp-cpp.",
                    o_.who, ep, static_cast<int>(static_cast<uint8_t>(body[kMagic.size()])),
                    kVersion));
  }
  const Nonce nonce = random_nonce();
  send_all(hello(nonce, client_proof(o_.key, *server_nonce, nonce), o_.identity), deadline);
  std::string welcome;
  try {
    welcome = read_frame(kMaxWelcomeBytes, deadline);
  } catch (const NoAnswer&) {
    fail(
        fmt::format("{} the rendezvous store at {} stopped answering during the handshake "
                    "({:.1f} s): {}.",
                    o_.who, ep, seconds(Clock::now() - started), silent_host_hint()));
  }
  Reader r(welcome);
  try {
    const auto status = static_cast<Status>(r.u8());
    if (status == Status::kError) {
      const std::string why(r.bytes(kMaxWelcomeBytes));
      refuse(
          fmt::format("{} the rendezvous store at {} refused this process: {}.", o_.who, ep, why));
    }
    const std::string_view proof = r.raw(kProofBytes);
    r.expect_done();
    if (status != Status::kOk || !proofs_equal(proof, server_proof(o_.key, nonce, *server_nonce))) {
      refuse(
          fmt::format("{} the server at {} does not hold this job's key: it is another job's "
                      "rendezvous store, or was given another DDP_STORE_SECRET. Check "
                      "MASTER_ADDR and MASTER_PORT, and give every process of the job the same "
                      "DDP_STORE_SECRET.",
                      o_.who, ep));
    }
  } catch (const ProtocolError& e) {
    fail(fmt::format("{} the rendezvous store at {} sent a malformed answer to the handshake: {}",
                     o_.who, ep, e.what()));
  }
}

void Client::connect_locked(Clock::time_point deadline, Clock::time_point started) {
  std::string cause = "connection refused";
  auto backoff = milliseconds(10);
  while (true) {
    std::string resolve_error;
    const std::vector<SocketAddress> addresses = resolve(o_.host, o_.port, &resolve_error);
    if (addresses.empty()) cause = fmt::format("cannot resolve '{}': {}", o_.host, resolve_error);
    size_t refused = 0;
    for (const SocketAddress& a : addresses) {
      Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
      if (!fd.valid()) {
        cause = std::strerror(errno);
        continue;
      }
      int rc = ::connect(fd.get(), a.get(), a.length);
      if (rc != 0 && errno == EINPROGRESS) {
        pollfd p{fd.get(), POLLOUT, 0};
        if (::poll(&p, 1, remaining_ms(deadline)) == 0) {
          cause = "the connection attempt got no answer (a firewall dropping it, or no route)";
          continue;
        }
        int err = 0;
        socklen_t len = sizeof err;
        ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
        rc = err == 0 ? 0 : -1;
        errno = err;
      }
      if (rc != 0) {
        cause = errno == ECONNREFUSED ? "connection refused" : std::strerror(errno);
        if (errno == ECONNREFUSED) ++refused;
        continue;
      }
      set_nodelay(fd.get());
      fd_ = std::move(fd);
      try {
        handshake(deadline, started);
        served_ = true;
        return;
      } catch (const Closed& c) {
        // Closed before the handshake ended: the host may be starting or stopping, or it
        // shed this connection under a flood of others; try again while there is time.
        fd_.reset();
        cause = fmt::format("the store closed the connection during the handshake ({})", c.cause);
      } catch (const NoAnswer&) {
        fd_.reset();
        fail(
            fmt::format("{} the rendezvous store at {} stopped answering during the handshake "
                        "({:.1f} s): {}.",
                        o_.who, endpoint(), seconds(Clock::now() - started), silent_host_hint()));
      }
    }
    if (served_ && !addresses.empty() && refused == addresses.size()) {
      throw StoreExitedError(
          fmt::format("{} could not reach the rendezvous store at {}: connection refused, where "
                      "it had answered before: the process hosting it has exited",
                      o_.who, endpoint()),
          cause);
    }
    if (Clock::now() + backoff >= deadline) {
      throw UnreachableError(
          fmt::format("{} could not reach the rendezvous store at {} within {:.1f} s: {}", o_.who,
                      endpoint(), seconds(Clock::now() - started), cause),
          cause);
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, milliseconds(500));
  }
}

void Client::connect(Clock::time_point deadline) {
  const auto started = Clock::now();
  if (!mu_.try_lock_until(deadline)) {
    throw RendezvousError(fmt::format(
        "{} could not use the connection to the rendezvous store at {} within {:.1f} s: another "
        "thread's call held it",
        o_.who, endpoint(), seconds(Clock::now() - started)));
  }
  TimedMutexLock lock(&mu_, std::adopt_lock);
  if (!fd_.valid()) connect_locked(deadline, started);
}

Client::Answer Client::call(const std::string& request, const std::string& what,
                            Clock::time_point deadline, Clock::time_point started) {
  if (!mu_.try_lock_until(deadline)) {
    throw RendezvousError(fmt::format(
        "{} {} on the rendezvous store at {} waited {:.1f} s for another thread's call on the "
        "same connection",
        o_.who, what, endpoint(), seconds(Clock::now() - started)));
  }
  TimedMutexLock lock(&mu_, std::adopt_lock);
  if (!fd_.valid()) {
    try {
      connect_locked(deadline, started);
    } catch (const UnreachableError& e) {
      throw UnreachableError(
          fmt::format("{} for {}; {}, which hosts it, has probably exited (or the network to "
                      "its host is down): look for its own error",
                      e.what(), what, o_.owner),
          e.cause);
    }
  }
  std::string frame;
  try {
    send_all(request, deadline);
    frame = read_frame(kFrameHeaderBytes + o_.limits.max_frame_bytes(), deadline);
  } catch (const NoAnswer&) {
    fail(fmt::format("{} the rendezvous store at {} did not answer {} within {:.1f} s: {}.", o_.who,
                     endpoint(), what, seconds(Clock::now() - started), silent_host_hint()));
  } catch (const Closed& c) {
    fail(
        fmt::format("{} lost the connection to the rendezvous store at {} during {}: {}; {}, "
                    "which hosts it, has probably exited or failed: look for its own error.",
                    o_.who, endpoint(), what, c.cause, o_.owner));
  }
  if (frame.empty()) fail(fmt::format("{} empty answer to {} from {}", o_.who, what, endpoint()));
  Answer a{static_cast<Status>(static_cast<uint8_t>(frame[0])), frame.substr(1)};
  if (a.status == Status::kError) {
    Reader r(a.body);
    std::string why;
    try {
      why = std::string(r.bytes(kMaxWelcomeBytes));
    } catch (const ProtocolError&) {
      why = printable(a.body);
    }
    throw RendezvousError(
        fmt::format("{} the rendezvous store at {} refused {}: {}", o_.who, endpoint(), what, why));
  }
  return a;
}

namespace {

void check_size(const ClientOptions& o, const std::string& what, size_t n, size_t limit,
                const char* kind) {
  if (n > limit) {
    throw RendezvousError(fmt::format("{} {}: {} {} exceeds the rendezvous store's limit of {}",
                                      o.who, what, kind, n, limit));
  }
}

template <typename F>
auto parse_answer(const std::string& body, const std::string& what, const ClientOptions& o, F&& f) {
  try {
    Reader r(body);
    auto v = f(r);
    r.expect_done();
    return v;
  } catch (const ProtocolError& e) {
    throw RendezvousError(fmt::format("{} malformed answer to {} from the rendezvous store: {}",
                                      o.who, what, e.what()));
  }
}

std::string timed_out(const ClientOptions& o, const std::string& endpoint,
                      std::chrono::milliseconds wait, const std::string& missing) {
  return fmt::format(
      "{} timed out after {:.1f} s waiting for {} in the rendezvous store at {}: whoever should "
      "write it has not (it failed, exited, or is slower than the timeout)",
      o.who, wait.count() / 1000.0, missing, endpoint);
}

}  // namespace

void Client::set(const std::string& key, std::string_view value, Clock::time_point deadline) {
  const auto started = Clock::now();
  const std::string what = fmt::format("set({})", quoted(key));
  check_size(o_, what, key.size(), o_.limits.max_key_bytes, "key size");
  check_size(o_, what, value.size(), o_.limits.max_value_bytes, "value size");
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kSet)).bytes(key).bytes(value);
  call(w.frame(), what, deadline, started);
}

std::string Client::get(const std::string& key, std::chrono::milliseconds wait,
                        Clock::time_point deadline) {
  const auto started = Clock::now();
  const std::string what = fmt::format("get({})", quoted(key));
  check_size(o_, what, key.size(), o_.limits.max_key_bytes, "key size");
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kGet)).i64(wait.count()).bytes(key);
  Answer a = call(w.frame(), what, deadline, started);
  if (a.status == Status::kTimeout) {
    throw RendezvousError(timed_out(o_, endpoint(), wait, quoted(key)));
  }
  return parse_answer(a.body, what, o_,
                      [&](Reader& r) { return std::string(r.bytes(o_.limits.max_value_bytes)); });
}

int64_t Client::add(const std::string& key, int64_t delta, Clock::time_point deadline) {
  const auto started = Clock::now();
  const std::string what = fmt::format("add({}, {})", quoted(key), delta);
  check_size(o_, what, key.size(), o_.limits.max_key_bytes, "key size");
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kAdd)).bytes(key).i64(delta);
  Answer a = call(w.frame(), what, deadline, started);
  return parse_answer(a.body, what, o_, [](Reader& r) { return r.i64(); });
}

std::string Client::compare_set(const std::string& key, std::string_view expected,
                                std::string_view desired, Clock::time_point deadline) {
  const auto started = Clock::now();
  const std::string what = fmt::format("compareSet({})", quoted(key));
  check_size(o_, what, key.size(), o_.limits.max_key_bytes, "key size");
  check_size(o_, what, expected.size(), o_.limits.max_value_bytes, "expected value size");
  check_size(o_, what, desired.size(), o_.limits.max_value_bytes, "value size");
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kCompareSet)).bytes(key).bytes(expected).bytes(desired);
  Answer a = call(w.frame(), what, deadline, started);
  return parse_answer(a.body, what, o_,
                      [&](Reader& r) { return std::string(r.bytes(o_.limits.max_value_bytes)); });
}

bool Client::check(const std::vector<std::string>& keys, Clock::time_point deadline) {
  const auto started = Clock::now();
  const std::string what =
      fmt::format("check({}{})", keys.empty() ? "" : quoted(keys.front()),
                  keys.size() > 1 ? fmt::format(" and {} more", keys.size() - 1) : "");
  check_size(o_, what, keys.size(), o_.limits.max_keys_per_request, "number of keys");
  for (const auto& k : keys) check_size(o_, what, k.size(), o_.limits.max_key_bytes, "key size");
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kCheck)).keys(keys);
  Answer a = call(w.frame(), what, deadline, started);
  return parse_answer(a.body, what, o_, [](Reader& r) { return r.u8() != 0; });
}

void Client::wait(const std::vector<std::string>& keys, std::chrono::milliseconds wait,
                  Clock::time_point deadline) {
  const auto started = Clock::now();
  const std::string what =
      fmt::format("wait({}{})", keys.empty() ? "" : quoted(keys.front()),
                  keys.size() > 1 ? fmt::format(" and {} more", keys.size() - 1) : "");
  check_size(o_, what, keys.size(), o_.limits.max_keys_per_request, "number of keys");
  for (const auto& k : keys) check_size(o_, what, k.size(), o_.limits.max_key_bytes, "key size");
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kWait)).i64(wait.count()).keys(keys);
  Answer a = call(w.frame(), what, deadline, started);
  if (a.status == Status::kTimeout) {
    const std::string missing = parse_answer(a.body, what, o_, [](Reader& r) {
      return std::string(r.bytes(kMaxWelcomeBytes * 64));
    });
    throw RendezvousError(timed_out(o_, endpoint(), wait, missing));
  }
}

bool Client::remove(const std::string& key, Clock::time_point deadline) {
  const auto started = Clock::now();
  const std::string what = fmt::format("deleteKey({})", quoted(key));
  check_size(o_, what, key.size(), o_.limits.max_key_bytes, "key size");
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kDelete)).bytes(key);
  Answer a = call(w.frame(), what, deadline, started);
  return parse_answer(a.body, what, o_, [](Reader& r) { return r.u8() != 0; });
}

int64_t Client::num_keys(Clock::time_point deadline) {
  const auto started = Clock::now();
  Writer w;
  w.u8(static_cast<uint8_t>(Op::kNumKeys));
  Answer a = call(w.frame(), "getNumKeys()", deadline, started);
  return parse_answer(a.body, "getNumKeys()", o_, [](Reader& r) { return r.i64(); });
}

}  // namespace ddp::store
