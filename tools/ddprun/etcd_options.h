// How ddprun reaches an etcd cluster (Note [etcd backend] in etcd.h): what etcd.h builds from the
// flags and etcd_client.h uses.
#pragma once

#include <chrono>
#include <string>
#include <vector>

namespace ddp::launcher {

// How long a ddprun's lease lives without being kept alive: how soon a dead node's sign of life
// vanishes. etcd's smallest is about 2 s at its default election timeout.
inline constexpr std::chrono::seconds kEtcdLeaseTtl{3};
inline constexpr int kEtcdDefaultPort = 2379;

struct EtcdOptions {
  std::vector<std::string> endpoints;  // "host:port", as given
  bool https = false;                  // protocol=https
  std::string cacert, cert, key;       // TLS files (PEM)
  std::string user, password;          // empty user: no auth
  std::string who;                     // opens every error message: "ddprun (h1)"
  std::chrono::seconds lease_ttl = kEtcdLeaseTtl;
};

}  // namespace ddp::launcher
