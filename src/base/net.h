// Small network helpers shared by the library, ddprun and the tests. Torch-free.
#pragma once

#include <optional>
#include <string>

namespace ddp::net {

// A TCP port on 127.0.0.1 that was free a moment ago (the kernel picks it, as torchrun's
// --standalone does; another process could take it before it is bound, which the store
// reports as "port in use"). Throws ddp::Error when no socket can be made.
int pick_free_port();

// This host's name (gethostname), or "unknown-host"; for messages and logs.
std::string host_name();

// Why `host` does not resolve here (getaddrinfo's reason), or nullopt when it resolves or when
// the resolver did not answer now (EAI_AGAIN: worth retrying, so not a verdict).
std::optional<std::string> unresolvable(const std::string& host);

}  // namespace ddp::net
