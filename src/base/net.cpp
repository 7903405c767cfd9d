// Small network helpers (see net.h).
#include "base/net.h"

#include <arpa/inet.h>   // htonl, ntohs
#include <netdb.h>       // getaddrinfo
#include <netinet/in.h>  // sockaddr_in
#include <sys/socket.h>  // socket, bind, getsockname
#include <unistd.h>      // close, gethostname

#include <cerrno>
#include <cstring>  // strerror

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::net {

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown-host";
  return name;
}

std::optional<std::string> unresolvable(const std::string& host) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (rc == 0) {
    ::freeaddrinfo(found);
    return std::nullopt;
  }
  if (rc == EAI_AGAIN) return std::nullopt;
  if (rc == EAI_SYSTEM) return std::string(std::strerror(errno));
  return std::string(::gai_strerror(rc));
}

int pick_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    throw Error(
        fmt::format("cannot create a socket to pick a free port: {}", std::strerror(errno)));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok)
    throw Error(fmt::format("cannot bind 127.0.0.1:0 to pick a free port: {}", std::strerror(err)));
  return ntohs(addr.sin_port);
}

}  // namespace ddp::net
