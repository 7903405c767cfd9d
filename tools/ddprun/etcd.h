// --rdzv-backend etcd: a job's rounds kept in an etcd cluster, through etcd's v3 API.
//
// Note [etcd backend]
// torchrun's etcd rendezvous keeps its state in etcd so that no node of the job is the store;
// ddprun does the same with the same round protocol (Note [Restart rounds] in rounds.h) as on
// its own agent store: only the key-value store under it changes (key_value.h).
// - The API: etcd's v3 JSON gateway (HTTP/1.1 under /v3/, keys and values in base64), through
//   libcurl, one connection kept per client. gRPC (libgrpc++, with code generated from etcd's
//   .proto files and their Google API imports) would save the gateway's hop inside etcd, a
//   loopback call, but not the Raft commit and fsync that every write waits for. Measured
//   (test_etcd, 3 members on one quiet 2-core VM): a read 0.8-1.1 ms, a write 1.8-2.0 ms; a
//   round of 3 nodes 111-144 ms on etcd against 102 ms on the agent store, next to seconds of
//   workers starting. The simpler client wins.
// - One store, consistent: etcd is a Raft cluster, every read here is linearizable (etcd's
//   default) and every decision a transaction comparing a key's revision or value (compare_set,
//   add). A member cut off from its cluster's majority answers neither reads nor writes; a node
//   that reaches only such members gets no answer, waits, and fails at the join timeout naming
//   each endpoint and what it answered. Nothing moves (Note [Moving the store] is the agent
//   store's), so the majority rule of Note [Never two groups], which keeps two copies of the
//   agent store from both forming rounds, is not needed: there is one copy.
// - Endpoints: --rdzv-endpoint lists the members (host:port, comma-separated; port 2379 when
//   left out). A call goes to the member that answered last, and to the next on no answer
//   (refused, timed out, "no leader"), sharing what is left of its deadline among those not yet
//   tried.
// - Liveness by lease: each ddprun holds a lease of kEtcdLeaseTtl, kept alive by a thread of its
//   own every third of it, and puts its sign of life (alive/<id>) under that lease at every poll.
//   A node whose ddprun dies, stops or is cut off from etcd's majority loses its lease within
//   the ttl, and with it the key: count_beats() is then -1, and the others take the node for
//   dead at once instead of after a silence. A lease that expired while this node lived (a
//   partition) is replaced at its next beat.
// - Watches: get() waits for a missing key by watching it from the revision it read, not by
//   polling.
// - TLS and auth, as etcd's clients take them, in --rdzv-conf: protocol=https, cacert=PATH,
//   cert=PATH, key=PATH; user=NAME:PASSWORD, or user=NAME with password_file=PATH (the password
//   kept out of the process list). With a user, each client authenticates for a token and does
//   again when etcd says the token is no longer valid.
// - The workers' store: the workers of a job on etcd rendezvous at their rank 0, as on a single
//   node (TORCHELASTIC_USE_AGENT_STORE=False): node rank 0's ddprun picks a free port at its
//   address toward etcd and writes "<R>/workers_store"; the others read it (Note [Round store
//   keys]).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "etcd_options.h"  // EtcdOptions
#include "key_value.h"

namespace ddp::launcher {

// The options --rdzv-endpoint (`endpoints`) and --rdzv-conf (`conf`) give; throws UsageError
// naming the flag for a bad endpoint, an unknown protocol, a missing file.
EtcdOptions etcd_options(const std::string& endpoints,
                         const std::map<std::string, std::string>& conf);

// The job's rounds in etcd: a KeyValue whose every call is bounded by its deadline.
std::unique_ptr<KeyValue> etcd_key_value(const EtcdOptions& options);

}  // namespace ddp::launcher
