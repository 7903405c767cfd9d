// The job's agent store on the ddprun side: hosting it (Note [Hosting the store] in
// src/store/host.h), and which stores a node's ddprun hosts under its membership policy (Note
// [Membership policy]: store_host, store_moves).
#pragma once

#include <memory>
#include <string>

#include "ddp/env.h"  // ddp::EnvMap
#include "launch_config.h"
#include "membership_policy.h"
#include "store/server.h"

namespace ddp::launcher {

// Hosts the job's agent store on this host at config.master_addr:master_port; `who` names this
// ddprun in errors ("node 0"). Throws ddp::Error saying what to change; returns null when the
// port is taken and `none_if_in_use` (another ddprun on this host hosts it). `quiet`: without the
// store's notes (a standby store: Note [Moving the store] in elastic.cpp). `base_env` (what the
// workers get) supplies DDP_STORE_BIND and DDP_STORE_MAX_BYTES.
std::unique_ptr<store::Server> host_agent_store(const LaunchConfig& config, const EnvMap& base_env,
                                                const std::string& key, const std::string& secret,
                                                const std::string& who, bool none_if_in_use = false,
                                                bool quiet = false);

// The stores this node's ddprun hosts, for the whole run.
struct HostedStores {
  std::unique_ptr<store::Server> server;   // the job's store, when this ddprun hosts it
  std::unique_ptr<store::Server> standby;  // ready to take the job's store over
  std::string addr = "-";  // this node's address toward the store, where `standby` listens
};

// On etcd: none (Note [etcd backend] in etcd.h).
// Fixed: node 0's ddprun hosts the job's store (a port in use is an error). Elastic: the first
// ddprun on the rendezvous endpoint's host does (a second one there finds the port taken and is
// a client like the rest); every other node hosts a standby at its own address and the
// endpoint's port, empty and quiet (a socket and a thread), with "-" for an address where it
// cannot.
HostedStores host_stores(const LaunchConfig& config, const MembershipPolicy& policy,
                         const EnvMap& base_env, const std::string& key, const std::string& secret);

}  // namespace ddp::launcher
