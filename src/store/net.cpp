// Socket helpers (see net.h).
#include "store/net.h"

#include <arpa/inet.h>    // inet_ntop, inet_pton
#include <fcntl.h>        // fcntl
#include <netdb.h>        // getaddrinfo
#include <netinet/in.h>   // sockaddr_in(6)
#include <netinet/tcp.h>  // TCP_NODELAY
#include <unistd.h>       // close

#include <cstring>

#include <fmt/format.h>

namespace ddp::store {

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

bool SocketAddress::is_loopback() const {
  if (family() == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&storage);
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (family() == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&storage);
    if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr)) return true;
    // ::ffff:127.x.y.z
    return IN6_IS_ADDR_V4MAPPED(&a->sin6_addr) && a->sin6_addr.s6_addr[12] == 127;
  }
  return false;
}

std::string to_string(const SocketAddress& address) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (address.family() == AF_INET) {
    const auto* a = reinterpret_cast<const sockaddr_in*>(&address.storage);
    inet_ntop(AF_INET, &a->sin_addr, buf, sizeof buf);
    return fmt::format("{}:{}", buf, ntohs(a->sin_port));
  }
  if (address.family() == AF_INET6) {
    const auto* a = reinterpret_cast<const sockaddr_in6*>(&address.storage);
    inet_ntop(AF_INET6, &a->sin6_addr, buf, sizeof buf);
    return fmt::format("[{}]:{}", buf, ntohs(a->sin6_port));
  }
  return "(unknown address)";
}

std::string format_endpoint(const std::string& host, int port) {
  if (host.find(':') != std::string::npos && host.front() != '[') {
    return fmt::format("[{}]:{}", host, port);
  }
  return fmt::format("{}:{}", host, port);
}

std::vector<SocketAddress> resolve(const std::string& host, int port, std::string* error) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
  std::vector<SocketAddress> out;
  if (rc != 0) {
    if (error != nullptr) *error = gai_strerror(rc);
    return out;
  }
  for (addrinfo* p = res; p != nullptr; p = p->ai_next) {
    if (p->ai_family != AF_INET && p->ai_family != AF_INET6) continue;
    SocketAddress a;
    std::memcpy(&a.storage, p->ai_addr, p->ai_addrlen);
    a.length = p->ai_addrlen;
    bool seen = false;
    for (const auto& b : out) seen = seen || to_string(b) == to_string(a);
    if (!seen) out.push_back(a);
  }
  ::freeaddrinfo(res);
  if (out.empty() && error != nullptr) *error = "no IPv4 or IPv6 address";
  return out;
}

bool parse_ip(const std::string& text, int port, SocketAddress& out) {
  out = SocketAddress{};
  auto* v4 = reinterpret_cast<sockaddr_in*>(&out.storage);
  if (::inet_pton(AF_INET, text.c_str(), &v4->sin_addr) == 1) {
    v4->sin_family = AF_INET;
    v4->sin_port = htons(static_cast<uint16_t>(port));
    out.length = sizeof(sockaddr_in);
    return true;
  }
  std::string bare = text;
  if (bare.size() > 2 && bare.front() == '[' && bare.back() == ']') {
    bare = bare.substr(1, bare.size() - 2);
  }
  auto* v6 = reinterpret_cast<sockaddr_in6*>(&out.storage);
  if (::inet_pton(AF_INET6, bare.c_str(), &v6->sin6_addr) == 1) {
    v6->sin6_family = AF_INET6;
    v6->sin6_port = htons(static_cast<uint16_t>(port));
    out.length = sizeof(sockaddr_in6);
    return true;
  }
  return false;
}

void set_nonblocking(int fd) {
  const int flags = ::fcntl(fd, F_GETFL, 0);
  ::fcntl(fd, F_SETFL, flags | O_NONBLOCK);
}

void set_nodelay(int fd) {
  int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

}  // namespace ddp::store
