// Small socket helpers shared by the store's server and client. Torch-free.
#pragma once

#include <sys/socket.h>  // sockaddr_storage, socklen_t

#include <string>
#include <vector>

namespace ddp::store {

// Owns a file descriptor; closes it on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = o.release();
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

struct SocketAddress {
  sockaddr_storage storage{};
  socklen_t length = 0;
  const sockaddr* get() const { return reinterpret_cast<const sockaddr*>(&storage); }
  int family() const { return storage.ss_family; }
  bool is_loopback() const;
};

// "127.0.0.1:5555" or "[::1]:5555".
std::string to_string(const SocketAddress& address);
std::string format_endpoint(const std::string& host, int port);  // brackets an IPv6 literal

// The addresses `host` (a name or literal) resolves to for TCP on `port`; empty when it does
// not resolve (`error` then says why).
std::vector<SocketAddress> resolve(const std::string& host, int port, std::string* error);
// `text` as an IP literal (IPv4 or IPv6); false when it is not one.
bool parse_ip(const std::string& text, int port, SocketAddress& out);

void set_nonblocking(int fd);
void set_nodelay(int fd);  // request/response frames: Nagle would add 40 ms stalls

}  // namespace ddp::store
