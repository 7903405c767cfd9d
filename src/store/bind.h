// Where the rendezvous store listens. Torch-free.
//
// Note [Where the store listens]
// The store listens only where the job's ranks reach it, when that is known:
//   - DDP_STORE_BIND=ADDR[,ADDR...] (IP literals) wins; DDP_STORE_BIND=any: every interface.
//   - MASTER_ADDR an IP literal of this host (127.0.0.1 under ddprun --standalone): exactly it.
//     Ranks on other hosts connect to that same literal.
//   - MASTER_ADDR a name: the addresses it resolves to here, when they belong to this host,
//     except that a name resolving only to loopback (Debian maps the hostname to 127.0.1.1)
//     says nothing about how other hosts reach it: in a job spanning hosts that is every
//     interface.
//   - otherwise (an address of another machine: NAT, a forwarded port; a name that does not
//     resolve): every interface, with a note saying why.
// Every interface is what LibTorch's TCPStore always does; the secret (Note [Store protocol])
// still keeps strangers out there, binding narrows who can even try.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "store/net.h"

namespace ddp::store {

struct BindPlan {
  std::vector<std::string> addresses;  // IP literals; empty: every interface
  std::string why_every_interface;     // set when every interface is a fallback, for a note
};

// `is_local(a)`: whether `a` is an address of this host (default: it can be bound).
BindPlan plan_bind(
    const std::string& master_addr, bool single_host, const std::string& bind_override,
    const std::function<bool(const SocketAddress&)>& is_local = {},
    const std::function<std::vector<SocketAddress>(const std::string&)>& resolver = {});

// True when a socket can be bound to `a` (port 0) on this host.
bool can_bind(const SocketAddress& a);

// The IP literal of `a`, without port or brackets.
std::string ip_of(const SocketAddress& a);

}  // namespace ddp::store
