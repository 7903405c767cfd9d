// Where the store listens (Note [Where the store listens] in bind.h).
#include "store/bind.h"

#include <arpa/inet.h>   // inet_ntop
#include <netinet/in.h>  // sockaddr_in(6)
#include <sys/socket.h>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/check.h"

namespace ddp::store {
namespace {

bool is_unspecified(const SocketAddress& a) {
  if (a.family() == AF_INET) {
    return reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_addr.s_addr == INADDR_ANY;
  }
  return a.family() == AF_INET6 &&
         IN6_IS_ADDR_UNSPECIFIED(&reinterpret_cast<const sockaddr_in6*>(&a.storage)->sin6_addr);
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= list.size()) {
    const size_t comma = list.find(',', start);
    const std::string item =
        list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

std::string ip_of(const SocketAddress& a) {
  char buf[INET6_ADDRSTRLEN] = {0};
  if (a.family() == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(&a.storage)->sin_addr, buf,
              sizeof buf);
  } else if (a.family() == AF_INET6) {
    inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(&a.storage)->sin6_addr, buf,
              sizeof buf);
  }
  return buf;
}

bool can_bind(const SocketAddress& a) {
  Fd fd(::socket(a.family(), SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  SocketAddress any_port = a;
  if (a.family() == AF_INET)
    reinterpret_cast<sockaddr_in*>(&any_port.storage)->sin_port = 0;
  else
    reinterpret_cast<sockaddr_in6*>(&any_port.storage)->sin6_port = 0;
  return ::bind(fd.get(), any_port.get(), any_port.length) == 0;
}

BindPlan plan_bind(const std::string& master_addr, bool single_host,
                   const std::string& bind_override,
                   const std::function<bool(const SocketAddress&)>& is_local_in,
                   const std::function<std::vector<SocketAddress>(const std::string&)>& resolver) {
  auto is_local = is_local_in ? is_local_in : can_bind;
  BindPlan plan;
  if (!bind_override.empty()) {
    if (bind_override == "any" || bind_override == "*") return plan;
    for (const std::string& item : split(bind_override)) {
      SocketAddress a;
      DDP_CHECK(parse_ip(item, 0, a), ConfigError,
                "invalid environment: DDP_STORE_BIND='{}': '{}' is not an IP address (give IP "
                "addresses of this host separated by commas, or 'any' for every interface)",
                bind_override, item);
      if (is_unspecified(a)) return BindPlan{};
      plan.addresses.push_back(ip_of(a));
    }
    return plan;
  }
  SocketAddress literal;
  if (parse_ip(master_addr, 0, literal)) {
    if (is_unspecified(literal)) return plan;
    if (literal.is_loopback() || is_local(literal)) {
      plan.addresses.push_back(ip_of(literal));
      return plan;
    }
    plan.why_every_interface =
        fmt::format("MASTER_ADDR={} is not an address of this host (a NAT or a forwarded port?)",
                    master_addr);
    return plan;
  }
  std::string error;
  const std::vector<SocketAddress> resolved =
      resolver ? resolver(master_addr) : resolve(master_addr, 0, &error);
  if (resolved.empty()) {
    plan.why_every_interface = fmt::format("MASTER_ADDR={} does not resolve here{}", master_addr,
                                           error.empty() ? "" : " (" + error + ")");
    return plan;
  }
  std::vector<std::string> local, names;
  bool reachable_from_elsewhere = false;  // a local address that is not loopback
  for (const SocketAddress& a : resolved) {
    names.push_back(ip_of(a));
    if (a.is_loopback()) {
      local.push_back(ip_of(a));
    } else if (is_local(a)) {
      local.push_back(ip_of(a));
      reachable_from_elsewhere = true;
    }
  }
  if (!single_host && !reachable_from_elsewhere) {
    plan.why_every_interface =
        fmt::format("MASTER_ADDR={} resolves here to {}, {}", master_addr, fmt::join(names, ", "),
                    local.empty()
                        ? "not an address of this host"
                        : "loopback only, which ranks on other hosts cannot reach (they must "
                          "resolve the name otherwise)");
    return plan;
  }
  if (local.empty()) {
    plan.why_every_interface =
        fmt::format("MASTER_ADDR={} resolves to {}, not an address of this host", master_addr,
                    fmt::join(names, ", "));
    return plan;
  }
  plan.addresses = local;
  return plan;
}

}  // namespace ddp::store
