// The job's agent store on the ddprun side (see agent_store.h).
#include "agent_store.h"

#include <sys/socket.h>  // socket, connect, getsockname
#include <unistd.h>      // close

#include <fmt/format.h>

#include "ddp/env.h"  // parse_store_max_bytes
#include "ddp/error.h"
#include "output.h"  // note
#include "store/bind.h"
#include "store/host.h"
#include "store/net.h"

namespace ddp::launcher {
namespace {

// This host's address on the route to host:port (the source address the kernel picks: a UDP
// socket connected there sends nothing); "-" when there is none.
std::string address_toward(const std::string& host, int port) {
  std::string error;
  for (const store::SocketAddress& a : store::resolve(host, port, &error)) {
    const int fd = ::socket(a.family(), SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    store::SocketAddress mine;
    mine.length = sizeof mine.storage;
    const bool ok =
        ::connect(fd, a.get(), a.length) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&mine.storage), &mine.length) == 0;
    ::close(fd);
    if (ok) return store::ip_of(mine);
  }
  return "-";
}

// Whether `host` is an address of this machine: then this ddprun may host the store.
bool endpoint_is_here(const std::string& host, int port) {
  std::string error;
  for (const store::SocketAddress& a : store::resolve(host, port, &error)) {
    if (store::can_bind(a)) return true;
  }
  return false;
}

}  // namespace

// Note [Hosting the store]: the same rules as rank 0's store (DDP_STORE_BIND,
// DDP_STORE_MAX_BYTES, the notes), read from the environment the workers get.
std::unique_ptr<store::Server> host_agent_store(const LaunchConfig& c, const EnvMap& base_env,
                                                const std::string& key, const std::string& secret,
                                                const std::string& who, bool none_if_in_use,
                                                bool quiet) {
  auto knob = [&](const char* name) {
    auto it = base_env.find(name);
    return it != base_env.end() ? it->second : std::string();
  };
  store::HostOptions o;
  o.master_addr = c.master_addr;
  o.port = c.master_port;
  o.bind = knob("DDP_STORE_BIND");
  o.key = key;
  o.has_secret = !secret.empty();
  o.max_bytes = parse_store_max_bytes(base_env);
  o.name = "the agent store";
  o.log = [quiet](const std::string& line) {  // "ddp: ...": ours, not a worker's
    if (quiet) return;
    note(line.rfind("ddp: ", 0) == 0 ? line.substr(5) : line);
  };
  try {
    return store::host(o);
  } catch (const store::HostError& e) {
    if (e.port_in_use && none_if_in_use) return nullptr;
    if (e.port_in_use) {
      throw Error(fmt::format(
          "{} cannot host the job's agent store: port {} (--master-port) is already in use "
          "on this host. Another job, or an earlier run still shutting down, holds it: give "
          "every node another --master-port.",
          who, c.master_port));
    }
    throw Error(fmt::format(
        "{} cannot host the job's agent store on {}:{} (--master-addr, --master-port): {}. "
        "Give --master-addr an address of this host, or set DDP_STORE_BIND.",
        who, c.master_addr, c.master_port, e.what()));
  }
}

HostedStores host_stores(const LaunchConfig& c, const MembershipPolicy& policy,
                         const EnvMap& base_env, const std::string& key,
                         const std::string& secret) {
  HostedStores out;
  if (policy.store_host == MembershipPolicy::StoreHost::kEtcd) return out;  // nobody hosts it
  if (policy.store_host == MembershipPolicy::StoreHost::kNodeZero) {
    if (policy.node_rank == 0) out.server = host_agent_store(c, base_env, key, secret, "node 0");
    return out;
  }
  out.addr = address_toward(c.master_addr, c.master_port);
  if (endpoint_is_here(c.master_addr, c.master_port)) {
    out.server =
        host_agent_store(c, base_env, key, secret, "the ddprun on the rendezvous endpoint's host",
                         /*none_if_in_use=*/true);
    if (out.server) {
      note(fmt::format("hosting the elastic job's agent store on {}", out.server->listening()));
    }
  }
  if (!policy.store_moves || out.server || out.addr == "-") return out;
  LaunchConfig here = c;
  here.master_addr = out.addr;
  try {
    out.standby = host_agent_store(here, base_env, key, secret, "a standby store",
                                   /*none_if_in_use=*/true, /*quiet=*/true);
  } catch (const Error&) {
    out.standby.reset();
  }
  if (!out.standby) out.addr = "-";
  return out;
}

}  // namespace ddp::launcher
