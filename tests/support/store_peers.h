// Test support: raw peers of the rendezvous store (strangers, broken or stalled ranks), a
// listener that never answers, and memory readings. Used by tests/collective/test_store.cpp
// and tests/multiproc/test_store_multiproc.cpp.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <string_view>

#include "store/protocol.h"

namespace ddp::testing {

// A blocking TCP connection to 127.0.0.1:`port`, driven byte by byte by the test.
class RawPeer {
 public:
  explicit RawPeer(int port) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(port));
    if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      const std::string why = std::strerror(errno);
      ::close(fd_);
      throw std::runtime_error("RawPeer: connect to port " + std::to_string(port) + ": " + why);
    }
  }
  ~RawPeer() { close(); }
  RawPeer(const RawPeer&) = delete;
  RawPeer& operator=(const RawPeer&) = delete;

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

  // "127.0.0.1:54321": how the store sees this peer (and logs it).
  std::string address() const {
    sockaddr_in a{};
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    return "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  }

  bool send(std::string_view bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }

  // Whatever arrives within `timeout_s`, up to `max` bytes; stops early at `want` bytes.
  std::string read(double timeout_s, size_t want = SIZE_MAX, size_t max = 1 << 20) {
    std::string out;
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(static_cast<int>(timeout_s * 1000));
    while (out.size() < want && out.size() < max) {
      const int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            until - std::chrono::steady_clock::now())
                                            .count());
      if (left <= 0) break;
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, left) <= 0) break;
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, std::min(sizeof buf, std::min(want, max) - out.size()), 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      out.append(buf, static_cast<size_t>(n));
    }
    return out;
  }

  // True when the other side closes the connection within `timeout_s` (data is discarded).
  bool closed_within(double timeout_s) {
    const auto until = std::chrono::steady_clock::now() +
                       std::chrono::milliseconds(static_cast<int>(timeout_s * 1000));
    while (!closed_ && std::chrono::steady_clock::now() < until) read(0.05);
    return closed_;
  }

  // The store's handshake with `key`, as a rank does it; true when admitted.
  bool authenticate(const std::string& key) {
    const std::string g =
        read(5.0, store::kFrameHeaderBytes + store::kMagic.size() + 1 + store::kNonceBytes);
    auto server_nonce = store::parse_greeting(
        std::string_view(g).substr(std::min(g.size(), store::kFrameHeaderBytes)));
    if (!server_nonce) return false;
    const store::Nonce mine = store::random_nonce();
    send(store::hello(mine, store::client_proof(key, *server_nonce, mine), "a test's raw peer"));
    const std::string header = read(5.0, store::kFrameHeaderBytes);
    if (header.size() < store::kFrameHeaderBytes) return false;
    const std::string body = read(5.0, store::frame_length(header));
    return !body.empty() && body[0] == static_cast<char>(store::Status::kOk);
  }

  int fd() const { return fd_; }

 private:
  int fd_ = -1;
  bool closed_ = false;
};

// A TCP port on 127.0.0.1 where connections are accepted (by the kernel's backlog) and nothing
// is ever said: a frozen host, or a port that belongs to a program that waits for its client.
class SilentListener {
 public:
  SilentListener() {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    ::listen(fd_, 64);
    socklen_t len = sizeof a;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len);
    port_ = ntohs(a.sin_port);
  }
  ~SilentListener() { ::close(fd_); }
  SilentListener(const SilentListener&) = delete;
  SilentListener& operator=(const SilentListener&) = delete;
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// A field of /proc/<pid>/status in KiB ("VmRSS", "VmHWM"); pid "self" for this process.
inline long status_kib(const std::string& pid, const std::string& field) {
  std::ifstream in("/proc/" + pid + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stol(line.substr(field.size() + 1));
  }
  return -1;
}

}  // namespace ddp::testing
