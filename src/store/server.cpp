// The store's server loop (Note [Store server] in server.h).
#include "store/server.h"

#include "base/log.h"

#include <fcntl.h>        // open
#include <netinet/in.h>   // sockaddr_in6, IPV6_V6ONLY
#include <pthread.h>      // pthread_setname_np
#include <sys/epoll.h>    // epoll_*
#include <sys/eventfd.h>  // eventfd
#include <unistd.h>       // read, write, close

#include <algorithm>
#include <cerrno>
#include <charconv>  // from_chars
#include <cstring>
#include <limits>
#include <list>
#include <unordered_map>
#include <unordered_set>

#include <fmt/format.h>

#include "base/check.h"
#include "store/net.h"

namespace ddp::store {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr auto kCloseGrace = std::chrono::seconds(1);  // to flush a last error answer
constexpr int64_t kMaxWaitMs = int64_t{24} * 3600 * 1000;
constexpr size_t kReadChunk = 64 * 1024;
constexpr int kListenBacklog = 1024;

// epoll ids below this are the stop event and the listening sockets; connections count up.
constexpr uint64_t kStopId = 0;
constexpr uint64_t kFirstConnId = uint64_t{1} << 32;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

struct Conn {
  enum class State { kHandshake, kReady, kClosing };

  uint64_t id = 0;
  Fd fd;
  std::string peer;      // "127.0.0.1:51234"
  std::string identity;  // what it said it is in its hello (authenticated connections)
  State state = State::kHandshake;
  Nonce server_nonce{};
  Clock::time_point accepted;
  Clock::time_point last_progress;  // last byte received or sent
  Clock::time_point close_at;       // kClosing: closed by then even if its answer is unsent
  uint64_t received = 0;            // bytes, in total
  std::string first_bytes;          // the first bytes received, for log lines

  std::string in;  // received, not yet consumed from in_off
  size_t in_off = 0;
  std::string out;  // to send, from out_off
  size_t out_off = 0;
  uint32_t interest = 0;  // the epoll events registered

  // A get or wait whose keys are missing parks the connection until they appear.
  bool parked = false;
  Op parked_op = Op::kWait;
  std::vector<std::string> wait_keys;
  Clock::time_point wait_until;

  size_t buffered() const { return in.size() - in_off; }
  bool out_pending() const { return out_off < out.size(); }
  std::string who() const {
    return identity.empty() ? peer : fmt::format("{} ({})", peer, identity);
  }
};

}  // namespace

struct Server::Loop {
  explicit Loop(ServerOptions options) : o(std::move(options)) {}

  // Constant after construction.
  ServerOptions o;
  std::string name;  // where it listens, for log lines
  Fd epoll;
  Fd stop_event;
  std::vector<Fd> listeners;

  // Owned by the serving thread.
  Fd reserve;  // a spare descriptor, given up to refuse a connection when none are left
  std::unordered_map<uint64_t, std::unique_ptr<Conn>> conns;
  std::list<uint64_t> pending_order;  // unauthenticated, oldest first
  std::unordered_set<uint64_t> parked;
  uint64_t next_id = kFirstConnId;
  std::unordered_map<std::string, std::string> data;
  size_t stored = 0;  // bytes charged against max_stored_bytes
  size_t authenticated = 0;
  uint64_t refused = 0;
  Clock::time_point window_start = Clock::now();
  size_t window_lines = 0;
  uint64_t suppressed = 0;
  std::string last_suppressed;

  // Read by other threads (stats()).
  std::atomic<size_t> s_connections{0}, s_authenticated{0}, s_pending{0}, s_stored{0}, s_keys{0};
  std::atomic<uint64_t> s_refused{0};

  void run();
  void publish_stats();
  void emit(const std::string& line);
  void log_refusal(const std::string& line);
  void flush_log_summary(bool force);

  void accept_all(int listener);
  void add_connection(Fd fd, const SocketAddress& peer);
  void on_event(Conn& c, uint32_t events);
  void read_from(Conn& c);
  void process(Conn& c);
  void handle_hello(Conn& c, std::string_view body);
  void handle_request(Conn& c, std::string_view body);
  void answer(Conn& c, const std::string& frame);
  void flush(Conn& c);
  void update_interest(Conn& c);
  void close_conn(uint64_t id);
  // Closes `c` (after sending `final_frame`, if any) and logs why.
  void refuse(Conn& c, const std::string& why, const std::string& final_frame = "");
  void scan(Clock::time_point now);

  size_t frame_limit(const Conn& c) const {
    return c.state == Conn::State::kHandshake ? kMaxHelloBytes : o.limits.max_frame_bytes();
  }
  size_t pending() const { return pending_order.size(); }

  // The store itself.
  std::string store_set(const std::string& key, std::string value);  // "" or why refused
  bool has_all(const std::vector<std::string>& keys) const;
  void wake_waiters(const std::string& created);
  void park(Conn& c, Op op, std::vector<std::string> keys, int64_t wait_ms);
  void finish_wait(Conn& c, bool timed_out);
};

// ---------------------------------------------------------------------------------------------
// Logging.

void Server::Loop::emit(const std::string& line) {
  const std::string text = fmt::format("rendezvous store {}: {}", name, line);
  if (o.log) {
    o.log("ddp: " + text);
    return;
  }
  log::line(-1, text);  // Note [Logging]; refusals are rate-limited by log_refusal
}

void Server::Loop::log_refusal(const std::string& line) {
  ++refused;
  if (window_lines < kLogBurst) {
    ++window_lines;
    emit(line);
    return;
  }
  ++suppressed;
  last_suppressed = line;
}

void Server::Loop::flush_log_summary(bool force) {
  const auto now = Clock::now();
  if (!force && now - window_start < o.log_window) return;
  if (suppressed > 0) {
    emit(fmt::format("{} more refused connection{} not shown (the last: {})", suppressed,
                     suppressed == 1 ? "" : "s", last_suppressed));
  }
  suppressed = 0;
  window_lines = 0;
  window_start = now;
}

void Server::Loop::publish_stats() {
  s_connections.store(conns.size(), std::memory_order_relaxed);
  s_authenticated.store(authenticated, std::memory_order_relaxed);
  s_pending.store(pending(), std::memory_order_relaxed);
  s_refused.store(refused, std::memory_order_relaxed);
  s_stored.store(stored, std::memory_order_relaxed);
  s_keys.store(data.size(), std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Connections.

void Server::Loop::accept_all(int listener) {
  while (true) {
    SocketAddress peer;
    peer.length = sizeof peer.storage;
    int fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&peer.storage), &peer.length,
                       SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd >= 0) {
      add_connection(Fd(fd), peer);
      continue;
    }
    if (errno == EINTR || errno == ECONNABORTED) continue;
    if ((errno == EMFILE || errno == ENFILE) && reserve.valid()) {
      // No descriptor left: give up the spare one to take the connection off the queue and
      // close it, so the listening socket does not stay readable forever.
      reserve.reset();
      fd = ::accept4(listener, reinterpret_cast<sockaddr*>(&peer.storage), &peer.length,
                     SOCK_CLOEXEC);
      if (fd >= 0) {
        log_refusal(
            fmt::format("refused {}: this process has no file descriptor left", to_string(peer)));
        ::close(fd);
      }
      reserve.reset(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      continue;
    }
    return;  // EAGAIN, or an error of one connection: the next event retries
  }
}

void Server::Loop::add_connection(Fd fd, const SocketAddress& peer_address) {
  const std::string peer = to_string(peer_address);
  if (conns.size() >= o.max_connections) {
    log_refusal(
        fmt::format("refused {}: {} connections already open (the limit)", peer, conns.size()));
    return;  // fd closes here
  }
  if (pending() >= o.max_pending) {
    // Unauthenticated connections are capped: the oldest makes room. A rank completes its
    // handshake within milliseconds of connecting, so it is never the oldest for long.
    Conn& oldest = *conns.at(pending_order.front());
    refuse(oldest, fmt::format("{} connections were waiting to authenticate (the limit); the "
                               "oldest, connected {:.1f} s ago, made room",
                               o.max_pending, seconds(Clock::now() - oldest.accepted)));
  }
  set_nodelay(fd.get());
  auto c = std::make_unique<Conn>();
  c->id = next_id++;
  c->fd = std::move(fd);
  c->peer = peer;
  c->accepted = c->last_progress = Clock::now();
  c->server_nonce = random_nonce();
  epoll_event ev{};
  ev.events = 0;
  ev.data.u64 = c->id;
  if (::epoll_ctl(epoll.get(), EPOLL_CTL_ADD, c->fd.get(), &ev) != 0) return;
  pending_order.push_back(c->id);
  Conn& ref = *c;
  conns.emplace(c->id, std::move(c));
  answer(ref, greeting(ref.server_nonce));
}

void Server::Loop::update_interest(Conn& c) {
  uint32_t want = 0;
  if (c.state != Conn::State::kClosing && c.buffered() < kFrameHeaderBytes + frame_limit(c)) {
    want |= EPOLLIN | EPOLLRDHUP;
  }
  if (c.out_pending()) want |= EPOLLOUT;
  if (want == c.interest) return;
  epoll_event ev{};
  ev.events = want;
  ev.data.u64 = c.id;
  ::epoll_ctl(epoll.get(), EPOLL_CTL_MOD, c.fd.get(), &ev);
  c.interest = want;
}

void Server::Loop::close_conn(uint64_t id) {
  auto it = conns.find(id);
  if (it == conns.end()) return;
  Conn& c = *it->second;
  ::epoll_ctl(epoll.get(), EPOLL_CTL_DEL, c.fd.get(), nullptr);
  if (c.state == Conn::State::kReady) --authenticated;
  pending_order.remove(id);
  parked.erase(id);
  conns.erase(it);
}

void Server::Loop::refuse(Conn& c, const std::string& why, const std::string& final_frame) {
  log_refusal(fmt::format("{} {}: {}", c.state == Conn::State::kReady ? "closed" : "refused",
                          c.who(), why));
  if (final_frame.empty()) {
    close_conn(c.id);
    return;
  }
  // Say why, then close: kClosing reads nothing more and is closed by close_at regardless.
  if (c.state == Conn::State::kReady) --authenticated;
  pending_order.remove(c.id);
  parked.erase(c.id);
  c.parked = false;
  c.state = Conn::State::kClosing;
  c.close_at = Clock::now() + kCloseGrace;
  answer(c, final_frame);
}

void Server::Loop::answer(Conn& c, const std::string& frame) {
  publish_stats();  // before the client can read its answer and look at stats()
  c.out.append(frame);
  flush(c);
}

void Server::Loop::flush(Conn& c) {
  const uint64_t id = c.id;
  while (c.out_pending()) {
    const ssize_t n =
        ::send(c.fd.get(), c.out.data() + c.out_off, c.out.size() - c.out_off, MSG_NOSIGNAL);
    if (n > 0) {
      c.out_off += static_cast<size_t>(n);
      c.last_progress = Clock::now();
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    close_conn(id);  // the peer is gone
    return;
  }
  if (!c.out_pending()) {
    c.out.clear();
    c.out_off = 0;
    if (c.state == Conn::State::kClosing) {
      close_conn(id);
      return;
    }
  }
  update_interest(c);
}

void Server::Loop::on_event(Conn& c, uint32_t events) {
  const uint64_t id = c.id;
  if (events & EPOLLOUT) {
    flush(c);
    if (!conns.count(id)) return;
    process(c);  // answers were holding back the next request
    if (!conns.count(id)) return;
  }
  if (events & (EPOLLIN | EPOLLRDHUP | EPOLLHUP | EPOLLERR)) read_from(c);
}

void Server::Loop::read_from(Conn& c) {
  const uint64_t id = c.id;
  char buf[kReadChunk];
  while (c.state != Conn::State::kClosing) {
    const size_t cap = kFrameHeaderBytes + frame_limit(c);
    if (c.buffered() >= cap) break;  // a whole frame is waiting: process() consumes it first
    const ssize_t n = ::recv(c.fd.get(), buf, std::min(sizeof buf, cap - c.buffered()), 0);
    if (n > 0) {
      if (c.in_off > 0 && c.in_off == c.in.size()) {
        c.in.clear();
        c.in_off = 0;
      }
      c.in.append(buf, static_cast<size_t>(n));
      if (c.first_bytes.size() < 48) {
        c.first_bytes.append(buf, std::min(static_cast<size_t>(n), 48 - c.first_bytes.size()));
      }
      c.received += static_cast<uint64_t>(n);
      c.last_progress = Clock::now();
      process(c);
      if (!conns.count(id)) return;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    // The peer closed (n == 0) or the connection broke.
    if (c.state == Conn::State::kHandshake) {
      if (c.received == 0) {
        refuse(c, "connected and closed without a word (a port scan or health check?)");
      } else {
        refuse(c, fmt::format("sent \"{}\" ({} bytes), not the store's handshake, and closed",
                              printable(c.first_bytes), c.received));
      }
    } else if (c.state == Conn::State::kReady && c.buffered() > 0) {
      refuse(c, fmt::format("closed its connection in the middle of a request ({} bytes sent "
                            "of it)",
                            c.buffered()));
    } else {
      close_conn(id);
    }
    return;
  }
  if (conns.count(id)) update_interest(c);
}

void Server::Loop::process(Conn& c) {
  const uint64_t id = c.id;
  while (c.state != Conn::State::kClosing && !c.parked && !c.out_pending()) {
    if (c.buffered() < kFrameHeaderBytes) break;
    const uint32_t length = frame_length(std::string_view(c.in).substr(c.in_off));
    if (length > frame_limit(c)) {
      if (c.state == Conn::State::kHandshake) {
        refuse(c, fmt::format("not the store's handshake: it sent \"{}\", which would announce "
                              "a frame of {} bytes before authenticating (at most {} allowed)",
                              printable(c.first_bytes), length, kMaxHelloBytes));
      } else {
        refuse(c, fmt::format("it announced a frame of {} bytes; the limit is {} (values up to "
                              "{} bytes)",
                              length, frame_limit(c), o.limits.max_value_bytes));
      }
      return;
    }
    if (c.buffered() < kFrameHeaderBytes + length) break;
    // A copy: `in` is compacted below, and handling the request may wake other connections.
    const std::string body = c.in.substr(c.in_off + kFrameHeaderBytes, length);
    c.in_off += kFrameHeaderBytes + length;
    if (c.in_off == c.in.size()) {
      c.in.clear();
      c.in_off = 0;
    } else if (c.in_off > kReadChunk) {
      c.in.erase(0, c.in_off);
      c.in_off = 0;
    }
    if (c.state == Conn::State::kHandshake)
      handle_hello(c, body);
    else
      handle_request(c, body);
    if (!conns.count(id)) return;
  }
  update_interest(c);
}

void Server::Loop::handle_hello(Conn& c, std::string_view body) {
  Hello h;
  try {
    h = parse_hello(body);
  } catch (const ProtocolError& e) {
    const bool version = std::string_view(e.what()).find("version") != std::string_view::npos;
    Writer w;
    w.u8(static_cast<uint8_t>(Status::kError)).bytes(e.what());
    refuse(c,
           version ? e.what()
                   : fmt::format("not the store's handshake ({}): it sent \"{}\"", e.what(),
                                 printable(c.first_bytes)),
           version ? w.frame() : "");
    return;
  }
  c.identity = printable(h.identity, kMaxIdentityBytes);
  if (!proofs_equal(h.proof, client_proof(o.key, c.server_nonce, h.nonce))) {
    Writer w;
    w.u8(static_cast<uint8_t>(Status::kError))
        .bytes(
            "it does not hold this job's key: its DDP_STORE_SECRET (or, without one, its run "
            "id) differs from the store's. Every process of one job needs the same "
            "DDP_STORE_SECRET; a process of another job, or a stranger, cannot join");
    refuse(c,
           "wrong job key (a different DDP_STORE_SECRET or run id: another job, or a "
           "stranger)",
           w.frame());
    return;
  }
  c.state = Conn::State::kReady;
  pending_order.remove(c.id);
  ++authenticated;
  Writer w;
  const Proof proof = server_proof(o.key, h.nonce, c.server_nonce);
  w.u8(static_cast<uint8_t>(Status::kOk))
      .raw({reinterpret_cast<const char*>(proof.data()), proof.size()});
  answer(c, w.frame());
}

// ---------------------------------------------------------------------------------------------
// Requests.

std::string Server::Loop::store_set(const std::string& key, std::string value) {
  auto it = data.find(key);
  const size_t old_cost = it == data.end() ? 0 : key.size() + it->second.size() + kEntryOverhead;
  const size_t new_cost = key.size() + value.size() + kEntryOverhead;
  if (stored - old_cost + new_cost > o.max_stored_bytes) {
    return fmt::format(
        "the store holds {} bytes and storing this {}-byte value would pass its "
        "limit of {} bytes (DDP_STORE_MAX_BYTES)",
        stored, value.size(), o.max_stored_bytes);
  }
  stored = stored - old_cost + new_cost;
  if (it != data.end()) {
    it->second = std::move(value);
    return "";
  }
  data.emplace(key, std::move(value));
  wake_waiters(key);
  return "";
}

bool Server::Loop::has_all(const std::vector<std::string>& keys) const {
  for (const auto& k : keys) {
    if (!data.count(k)) return false;
  }
  return true;
}

void Server::Loop::park(Conn& c, Op op, std::vector<std::string> keys, int64_t wait_ms) {
  c.parked = true;
  c.parked_op = op;
  c.wait_keys = std::move(keys);
  c.wait_until = Clock::now() + milliseconds(std::clamp<int64_t>(wait_ms, 0, kMaxWaitMs));
  parked.insert(c.id);
}

void Server::Loop::finish_wait(Conn& c, bool timed_out) {
  parked.erase(c.id);
  c.parked = false;
  Writer w;
  if (timed_out) {
    std::string missing;
    for (const auto& k : c.wait_keys) {
      if (data.count(k)) continue;
      missing += fmt::format("{}\"{}\"", missing.empty() ? "" : ", ", printable(k, 200));
    }
    w.u8(static_cast<uint8_t>(Status::kTimeout)).bytes(missing);
  } else if (c.parked_op == Op::kGet) {
    w.u8(static_cast<uint8_t>(Status::kOk)).bytes(data.at(c.wait_keys.front()));
  } else {
    w.u8(static_cast<uint8_t>(Status::kOk));
  }
  c.wait_keys.clear();
  const uint64_t id = c.id;
  answer(c, w.frame());
  if (conns.count(id)) process(c);  // its next request may be waiting
}

void Server::Loop::wake_waiters(const std::string& created) {
  std::vector<uint64_t> ready;
  for (uint64_t id : parked) {
    const Conn& c = *conns.at(id);
    if (std::find(c.wait_keys.begin(), c.wait_keys.end(), created) != c.wait_keys.end() &&
        has_all(c.wait_keys)) {
      ready.push_back(id);
    }
  }
  for (uint64_t id : ready) {
    // Answering one may have let it (or another) send and park on a new request meanwhile.
    auto it = conns.find(id);
    if (it != conns.end() && it->second->parked && has_all(it->second->wait_keys)) {
      finish_wait(*it->second, false);
    }
  }
}

void Server::Loop::handle_request(Conn& c, std::string_view body) {
  const Limits& l = o.limits;
  Writer w;
  auto ok = [&]() -> Writer& { return w.u8(static_cast<uint8_t>(Status::kOk)); };
  auto error = [&](const std::string& why) {
    Writer e;
    e.u8(static_cast<uint8_t>(Status::kError)).bytes(why);
    answer(c, e.frame());
  };
  try {
    Reader r(body);
    const auto op = static_cast<Op>(r.u8());
    switch (op) {
      case Op::kSet: {
        std::string key(r.bytes(l.max_key_bytes));
        std::string value(r.bytes(l.max_value_bytes));
        r.expect_done();
        const std::string why = store_set(key, std::move(value));
        if (!why.empty()) return error(why);
        ok();
        break;
      }
      case Op::kGet: {
        const int64_t wait_ms = r.i64();
        std::string key(r.bytes(l.max_key_bytes));
        r.expect_done();
        auto it = data.find(key);
        if (it == data.end()) return park(c, op, {std::move(key)}, wait_ms);
        ok().bytes(it->second);
        break;
      }
      case Op::kAdd: {
        std::string key(r.bytes(l.max_key_bytes));
        const int64_t delta = r.i64();
        r.expect_done();
        int64_t value = 0;
        if (auto it = data.find(key); it != data.end()) {
          const std::string& s = it->second;
          auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), value);
          if (ec != std::errc() || end != s.data() + s.size()) {
            return error(fmt::format("add: the value of \"{}\" is \"{}\", not an integer",
                                     printable(key, 200), printable(s)));
          }
        }
        if ((delta > 0 && value > std::numeric_limits<int64_t>::max() - delta) ||
            (delta < 0 && value < std::numeric_limits<int64_t>::min() - delta)) {
          return error(fmt::format("add: {} + {} overflows", value, delta));
        }
        value += delta;
        const std::string why = store_set(key, std::to_string(value));
        if (!why.empty()) return error(why);
        ok().i64(value);
        break;
      }
      case Op::kCompareSet: {
        // c10d's rule (HashStore, TCPStore): set when the key is absent and `expected` is
        // empty, or when it holds `expected`; answer the value the key holds afterwards
        // (`expected` itself for an absent key that was not set).
        std::string key(r.bytes(l.max_key_bytes));
        std::string expected(r.bytes(l.max_value_bytes));
        std::string desired(r.bytes(l.max_value_bytes));
        r.expect_done();
        auto it = data.find(key);
        if ((it == data.end() && expected.empty()) ||
            (it != data.end() && it->second == expected)) {
          const std::string why = store_set(key, desired);
          if (!why.empty()) return error(why);
          ok().bytes(desired);
        } else if (it == data.end()) {
          ok().bytes(expected);
        } else {
          ok().bytes(it->second);
        }
        break;
      }
      case Op::kCheck: {
        auto keys = r.keys(l.max_keys_per_request, l.max_key_bytes);
        r.expect_done();
        ok().u8(has_all(keys) ? 1 : 0);
        break;
      }
      case Op::kWait: {
        const int64_t wait_ms = r.i64();
        auto keys = r.keys(l.max_keys_per_request, l.max_key_bytes);
        r.expect_done();
        if (!has_all(keys)) return park(c, op, std::move(keys), wait_ms);
        ok();
        break;
      }
      case Op::kDelete: {
        std::string key(r.bytes(l.max_key_bytes));
        r.expect_done();
        auto it = data.find(key);
        const bool existed = it != data.end();
        if (existed) {
          stored -= key.size() + it->second.size() + kEntryOverhead;
          data.erase(it);
        }
        ok().u8(existed ? 1 : 0);
        break;
      }
      case Op::kNumKeys:
        r.expect_done();
        ok().i64(static_cast<int64_t>(data.size()));
        break;
      default: throw ProtocolError(fmt::format("unknown request {}", static_cast<int>(op)));
    }
  } catch (const ProtocolError& e) {
    return refuse(c, fmt::format("malformed request: {}", e.what()));
  }
  answer(c, w.frame());
}

// ---------------------------------------------------------------------------------------------
// Deadlines and the loop.

void Server::Loop::scan(Clock::time_point now) {
  std::vector<std::pair<uint64_t, std::string>> expired;
  std::vector<uint64_t> waits_over;
  for (auto& [id, cp] : conns) {
    Conn& c = *cp;
    switch (c.state) {
      case Conn::State::kHandshake:
        if (now - c.accepted >= o.handshake_timeout) {
          expired.emplace_back(
              id, c.received == 0
                      ? fmt::format("connected and sent nothing for {:.1f} s",
                                    seconds(o.handshake_timeout))
                      : fmt::format("sent {} bytes (\"{}\") but no complete handshake within "
                                    "{:.1f} s",
                                    c.received, printable(c.first_bytes),
                                    seconds(o.handshake_timeout)));
        }
        break;
      case Conn::State::kReady:
        if (c.parked && now >= c.wait_until) waits_over.push_back(id);
        if ((c.buffered() > 0 && !c.parked && !c.out_pending()) || c.out_pending()) {
          if (now - c.last_progress >= o.stall_timeout) {
            expired.emplace_back(
                id,
                c.out_pending()
                    ? fmt::format("has not read its answers for {:.1f} s", seconds(o.stall_timeout))
                    : fmt::format("stopped in the middle of a request ({} bytes of it) for "
                                  "{:.1f} s",
                                  c.buffered(), seconds(o.stall_timeout)));
          }
        }
        break;
      case Conn::State::kClosing:
        if (now >= c.close_at) expired.emplace_back(id, "");
        break;
    }
  }
  for (auto& [id, why] : expired) {
    auto it = conns.find(id);
    if (it == conns.end()) continue;
    if (why.empty())
      close_conn(id);
    else
      refuse(*it->second, why);
  }
  for (uint64_t id : waits_over) {
    auto it = conns.find(id);
    if (it != conns.end() && it->second->parked) finish_wait(*it->second, true);
  }
}

void Server::Loop::run() {
  pthread_setname_np(pthread_self(), "ddp-store");
  std::vector<epoll_event> events(256);
  auto next_scan = Clock::now();
  while (true) {
    const auto now = Clock::now();
    if (now >= next_scan) {
      try {
        scan(now);
        flush_log_summary(false);
      } catch (const std::exception& e) {
        emit(fmt::format("checking deadlines failed: {}", e.what()));
      }
      publish_stats();
      // Deadlines are seconds long: checking them 10 times a second is exact enough and costs
      // one pass over the connections.
      next_scan = now + milliseconds(100);
    }
    const int timeout_ms = static_cast<int>(
        std::max<int64_t>(1, std::chrono::duration_cast<milliseconds>(next_scan - now).count()));
    const int n =
        ::epoll_wait(epoll.get(), events.data(), static_cast<int>(events.size()), timeout_ms);
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < n; ++i) {
      const uint64_t id = events[i].data.u64;
      if (id == kStopId) {
        flush_log_summary(true);
        return;
      }
      // Nothing a peer does may end the loop (an exception would end the process): a
      // failure handling one connection (out of memory for its frame, say) closes it.
      try {
        if (id < kFirstConnId) {
          accept_all(listeners[id - 1].get());
          continue;
        }
        auto it = conns.find(id);
        if (it != conns.end()) on_event(*it->second, events[i].events);
      } catch (const std::exception& e) {
        auto it = conns.find(id);
        emit(fmt::format("closed {}: {}", it != conns.end() ? it->second->who() : "a connection",
                         e.what()));
        if (it != conns.end()) close_conn(id);
      }
    }
    publish_stats();
  }
}

// ---------------------------------------------------------------------------------------------

namespace {

Fd listen_on(const SocketAddress& address) {
  Fd fd(::socket(address.family(), SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!fd.valid()) {
    throw BindError(fmt::format("socket: {}", std::strerror(errno)), errno, to_string(address));
  }
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (address.family() == AF_INET6) {
    // "::" next to "0.0.0.0" must not claim the IPv4 port too.
    ::setsockopt(fd.get(), IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
  }
  if (::bind(fd.get(), address.get(), address.length) != 0) {
    const int err = errno;
    throw BindError(fmt::format("cannot listen on {}: {}", to_string(address), std::strerror(err)),
                    err, to_string(address));
  }
  if (::listen(fd.get(), kListenBacklog) != 0) {
    const int err = errno;
    throw BindError(fmt::format("cannot listen on {}: {}", to_string(address), std::strerror(err)),
                    err, to_string(address));
  }
  return fd;
}

int bound_port(int fd) {
  SocketAddress a;
  a.length = sizeof a.storage;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a.storage), &a.length);
  return a.family() == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&a.storage)->sin6_port)
                                : ntohs(reinterpret_cast<sockaddr_in*>(&a.storage)->sin_port);
}

}  // namespace

Server::Server(ServerOptions options) : loop_(std::make_unique<Loop>(std::move(options))) {
  Loop& l = *loop_;
  const bool every_interface = l.o.bind_addresses.empty();
  std::vector<std::string> addresses = l.o.bind_addresses;
  if (every_interface) addresses = {"0.0.0.0", "::"};
  int port = l.o.port;
  std::vector<std::string> names;
  for (const std::string& text : addresses) {
    SocketAddress a;
    DDP_CHECK(parse_ip(text, port, a), ConfigError,
              "the rendezvous store cannot listen on '{}': not an IP address", text);
    Fd fd;
    try {
      fd = listen_on(a);
    } catch (const BindError& e) {
      // A host without IPv6 still listens on every IPv4 interface.
      if (every_interface && a.family() == AF_INET6 &&
          (e.error == EAFNOSUPPORT || e.error == EADDRNOTAVAIL)) {
        continue;
      }
      throw;
    }
    if (port == 0) port = bound_port(fd.get());  // the others take the same port
    names.push_back(format_endpoint(text, port));
    l.listeners.push_back(std::move(fd));
  }
  port_ = port;
  for (const auto& n : names) listening_ += (listening_.empty() ? "" : ", ") + n;
  local_address_ = every_interface ? "127.0.0.1" : l.o.bind_addresses.front();
  if (local_address_ == "0.0.0.0") local_address_ = "127.0.0.1";
  if (local_address_ == "::") local_address_ = "::1";
  l.name = listening_;

  l.epoll = Fd(::epoll_create1(EPOLL_CLOEXEC));
  l.stop_event = Fd(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  l.reserve = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  DDP_CHECK(l.epoll.valid() && l.stop_event.valid(), RendezvousError,
            "cannot start the rendezvous store: {}", std::strerror(errno));
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.u64 = kStopId;
  ::epoll_ctl(l.epoll.get(), EPOLL_CTL_ADD, l.stop_event.get(), &ev);
  for (size_t i = 0; i < l.listeners.size(); ++i) {
    ev.data.u64 = i + 1;
    ::epoll_ctl(l.epoll.get(), EPOLL_CTL_ADD, l.listeners[i].get(), &ev);
  }
  thread_ = std::thread([&l] { l.run(); });
}

Server::~Server() {
  const uint64_t one = 1;
  (void)!::write(loop_->stop_event.get(), &one, sizeof one);
  if (thread_.joinable()) thread_.join();
}

Server::Stats Server::stats() const {
  const Loop& l = *loop_;
  Stats s;
  s.connections = l.s_connections.load(std::memory_order_relaxed);
  s.authenticated = l.s_authenticated.load(std::memory_order_relaxed);
  s.pending = l.s_pending.load(std::memory_order_relaxed);
  s.refused = l.s_refused.load(std::memory_order_relaxed);
  s.stored_bytes = l.s_stored.load(std::memory_order_relaxed);
  s.keys = l.s_keys.load(std::memory_order_relaxed);
  return s;
}

}  // namespace ddp::store
