// Note [Hosting the store] in host.h.
#include "store/host.h"

#include <cerrno>

#include <fmt/format.h>

#include "base/log.h"
#include "store/bind.h"

namespace ddp::store {

std::unique_ptr<Server> host(const HostOptions& o) {
  const auto note = [&](const std::string& text) {
    if (o.log) {
      o.log("ddp: " + text);
    } else {
      log::line(o.rank, text);
    }
  };
  const BindPlan plan = plan_bind(o.master_addr, o.single_host, o.bind);
  ServerOptions so;
  so.bind_addresses = plan.addresses;
  so.port = o.port;
  so.key = o.key;
  if (o.max_bytes) so.max_stored_bytes = *o.max_bytes;
  if (o.log) so.log = o.log;
  std::unique_ptr<Server> server;
  try {
    server = std::make_unique<Server>(so);
  } catch (const BindError& e) {
    throw HostError(e.what(), e.error == EADDRINUSE);
  }
  if (!plan.why_every_interface.empty()) {
    note(
        fmt::format("{} listens on every interface ({}): {}; set DDP_STORE_BIND=<address of this "
                    "host> to listen on one",
                    o.name, server->listening(), plan.why_every_interface));
  }
  bool loopback_only = !plan.addresses.empty();
  for (const std::string& a : plan.addresses) {
    SocketAddress parsed;
    loopback_only = loopback_only && parse_ip(a, 0, parsed) && parsed.is_loopback();
  }
  if (!o.has_secret && !loopback_only) {
    note(fmt::format(
        "{} on {} has no secret (DDP_STORE_SECRET is not set): any process that reaches "
        "it and knows the run id can join the job. Give every process the same "
        "DDP_STORE_SECRET (ddprun does for single-node jobs; with several nodes, export one on "
        "each)",
        o.name, server->listening()));
  }
  return server;
}

}  // namespace ddp::store
