// make_process_group: from options and the launch environment to a connected group.
#include <arpa/inet.h>   // inet_pton, inet_ntop
#include <netdb.h>       // getaddrinfo
#include <signal.h>      // sigaction, SIGPIPE: Note [SIGPIPE]
#include <sys/socket.h>  // socket, connect, getsockname
#include <unistd.h>      // close

#include <cstdio>   // stderr
#include <numeric>  // std::iota
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "base/check.h"
#include "process_group/internal.h"
#include "process_group/shm_setup.h"
#include "rendezvous/rendezvous.h"

#if DDP_WITH_NCCL
#include <torch/cuda.h>
#endif

namespace ddp {
namespace {

using std::chrono::milliseconds;

// The launch environment, with explicit options applied on top: options become variables and
// go through the same validation as a launcher's.
DistEnv resolve_env(const InitOptions& o) {
  EnvMap env = current_environment();
  DDP_CHECK(o.rank.has_value() == o.world_size.has_value(), ConfigError,
            "InitOptions: set both rank and world_size, or neither (got {} only)",
            o.rank ? "rank" : "world_size");
  if (o.rank) {
    // Explicit placement replaces whatever launcher variables the process inherited.
    std::erase_if(env, [](const auto& kv) {
      const std::string& k = kv.first;
      return k == "RANK" || k == "WORLD_SIZE" || k.starts_with("LOCAL_") || k == "GROUP_RANK" ||
             k.starts_with("TORCHELASTIC_") || k.starts_with("OMPI_COMM_WORLD_") ||
             k.starts_with("PMI_") || k.starts_with("SLURM_");
    });
    env["RANK"] = std::to_string(*o.rank);
    env["WORLD_SIZE"] = std::to_string(*o.world_size);
  }
  if (o.master_addr) env["MASTER_ADDR"] = *o.master_addr;
  if (o.master_port) env["MASTER_PORT"] = std::to_string(*o.master_port);
  return parse_dist_env(env);
}

bool is_loopback(const std::string& addr) {
  return addr == "localhost" || addr.starts_with("127.") || addr == "::1";
}

// The local address this host uses to reach `host` (a UDP connect sends nothing; it only asks
// the kernel for a route). Empty when unknown.
std::string address_towards(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return "";
  std::string out;
  int fd = socket(AF_INET, SOCK_DGRAM, 0);
  if (fd >= 0 && connect(fd, res->ai_addr, res->ai_addrlen) == 0) {
    sockaddr_in local{};
    socklen_t len = sizeof(local);
    char buf[INET_ADDRSTRLEN] = {0};
    if (getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
        inet_ntop(AF_INET, &local.sin_addr, buf, sizeof(buf)) != nullptr) {
      out = buf;
    }
  }
  if (fd >= 0) close(fd);
  freeaddrinfo(res);
  return out;
}

c10d_compat::GlooDeviceSpec gloo_device(const InitOptions& o, const DistEnv& env) {
  c10d_compat::GlooDeviceSpec spec;
  if (o.gloo_interface) {
    spec.interface = *o.gloo_interface;
  } else if (auto ifname = env_knob("GLOO_SOCKET_IFNAME")) {
    spec.interface = *ifname;
  } else if (env.local_world_size == env.world_size || is_loopback(env.master_addr)) {
    spec.hostname = "127.0.0.1";  // every rank is on this host
  } else {
    spec.hostname = address_towards(env.master_addr, env.master_port);
    DDP_CHECK(!spec.hostname.empty(), ConfigError,
              "[rank {}] cannot find a local address that routes to MASTER_ADDR={}; set "
              "GLOO_SOCKET_IFNAME to the network interface Gloo should use",
              env.rank, env.master_addr);
  }
  return spec;
}

// InitOptions::backend, else DDP_BACKEND, else "auto".
std::string requested_backend(const InitOptions& o) {
  if (o.backend) return *o.backend;
  return env_knob("DDP_BACKEND").value_or("auto");
}

// The backend before locality is known: "gloo", "nccl", "shm", or "cpu-auto" (shm when every
// rank shares this host, else gloo).
std::string choose_backend(const std::string& requested) {
  if (requested == "gloo" || requested == "shm") return requested;
  if (requested == "nccl") {
    DDP_CHECK(DDP_WITH_NCCL, ConfigError,
              "backend 'nccl' is not available: this build of ddp-cpp uses a CPU-only LibTorch. "
              "Use backend 'gloo' (or 'auto'), or rebuild against a CUDA LibTorch.");
    return requested;
  }
  DDP_CHECK(requested == "auto", ConfigError,
            "unknown backend '{}': choose 'shm' (CPU, ranks on one host), 'gloo' (CPU), 'nccl' "
            "(CUDA) or 'auto'",
            requested);
#if DDP_WITH_NCCL
  if (torch::cuda::is_available()) return "nccl";
#endif
  return "cpu-auto";
}

// Every rank must ask for the same transport (DDP_BACKEND set differently on two nodes would
// otherwise leave each side waiting for the other's connections until a timeout). Each rank
// publishes its request; all compare, so all fail together naming the first difference.
void agree_on_backend(::c10d::Store& store, const DistEnv& env, const std::string& requested) {
  if (env.world_size == 1) return;
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  store.set(fmt::format("backend/{}", env.rank), bytes(requested));
  std::string mismatch;
  for (int r = 0; r < env.world_size && mismatch.empty(); ++r) {
    if (r == env.rank) continue;
    const std::vector<uint8_t> v = store.get(fmt::format("backend/{}", r));
    const std::string theirs(v.begin(), v.end());
    if (theirs != requested) {
      mismatch = fmt::format("this rank '{}', rank {} '{}'", requested, r, theirs);
    }
  }
  // Nobody leaves (rank 0 would take the store down) before everyone has read the requests.
  if (store.add("backend/read", 1) == env.world_size) store.set("backend/all_read", bytes("1"));
  store.get("backend/all_read");
  // Rank 0 hosts the store: it waits (at most 2 s) until every rank has seen "all_read", so a
  // mismatch reaches everyone as this message, not as a closed connection.
  store.add("backend/done", 1);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (env.rank == 0 && store.add("backend/done", 0) < env.world_size &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  DDP_CHECK(mismatch.empty(), ConfigError,
            "[rank {}] ranks ask for different backends: {}. Set the same InitOptions::backend / "
            "DDP_BACKEND / ddprun --backend on every node.",
            env.rank, mismatch);
}

bool debug_info(const DistEnv& env) { return env.debug != DebugLevel::kOff; }

// A handle of its own on the group's store (rendezvous::join's PrefixStore over our store or a
// bounded one), its calls bounded by kStoreCallLimit: hang reports must not wait on a frozen
// store for the rendezvous timeout.
c10::intrusive_ptr<::c10d::Store> diagnostics_store(const c10::intrusive_ptr<::c10d::Store>& store,
                                                    const std::string& prefix) {
  auto* prefixed = dynamic_cast<::c10d::PrefixStore*>(store.get());
  if (prefixed == nullptr) return store;  // a group of one: an in-process store
  const c10::intrusive_ptr<::c10d::Store> under = prefixed->getUnderlyingStore();
  auto* ours = dynamic_cast<c10d_compat::StoreBase*>(under.get());
  if (ours == nullptr) return store;
  c10::intrusive_ptr<::c10d::Store> clone = ours->clone_store();
  clone->setTimeout(kStoreCallLimit);
  return c10::make_intrusive<::c10d::PrefixStore>(prefix, clone);
}

// Where hang reports write each rank's JSON dump: the folder of the launcher's error file
// (ddprun: the rank's log folder); empty without one.
std::string dump_dir() {
  const std::optional<std::string> file = env_knob("TORCHELASTIC_ERROR_FILE");
  if (!file) return "";
  const std::string& path = *file;
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, std::max<size_t>(slash, 1));
}

// The flight recorder and the hang reporter (Notes [Flight recorder], [Hang reports]), and
// DDP_DEBUG=detail's fingerprint check.
void add_diagnostics(detail::ProcessGroupImpl& impl, const InitOptions& o,
                     const std::string& prefix) {
  const DistEnv& env = impl.env;
  impl.diag_store = diagnostics_store(impl.store, prefix);
  const int entries = env.flight_recorder_entries.value_or(flight::kDefaultEntries);
  if (entries > 0) impl.recorder = std::make_shared<flight::Ring>(entries);
  if (impl.recorder && env.world_size > 1) {
    impl.reporter =
        std::make_shared<HangReporter>(c10::make_intrusive<::c10d::PrefixStore>("flight_recorder",
                                                                                impl.diag_store),
                                       impl.recorder,
                                       HangReporter::Options{.rank = env.rank,
                                                             .size = env.world_size,
                                                             .group = o.group_name,
                                                             .dump_dir = dump_dir()});
  }
  // shm compares fingerprints before every collective anyway; NCCL would need CUDA tensors.
  impl.check_fingerprints = env.debug == DebugLevel::kDetail && env.world_size > 1 &&
                            impl.backend && impl.backend_name != "nccl";
}

// Note [Hierarchical collectives]
// Ranks on H hosts, L on each (L > 1): each host's ranks share a shm group; the ranks with the
// same local index l form a Gloo group across hosts (the rail). all_reduce of n elements:
//   1. all_reduce inside the host (shm; in place when the tensor is a comm buffer);
//   2. local rank l all-reduces slice l (n/L elements) over its rail: every host's ranks carry
//      their share of the cross-host traffic at once, 1/L of the data each;
//   3. inside the host, each local rank broadcasts its slice (shm).
// The steps run as one op of the host's shm group, so they keep its order, numbering, desync
// and dead-peer checks, and a failure between hosts fails the host's group like any other.
// The other collectives (broadcast, all_gather, reduce_scatter, barrier) go over Gloo on the
// whole group. With unequal numbers of ranks per host there is no rail: plain Gloo.
// Forms this host's shm group, if every host can: returns why not, or "" when formed.
std::string form_hierarchy(detail::ProcessGroupImpl& impl, const Locality& where) {
  const DistEnv& env = impl.env;
  const int h = where.host[env.rank];
  impl.host_index = h;
  for (int other = 0; other < where.hosts(); ++other) {
    if (other != h) impl.rail_peers.push_back(where.ranks_on(other)[where.local_rank[env.rank]]);
  }
  impl.shm_peers = {fmt::format("shm/host{}/", h), where.local_rank[env.rank], where.host_size[h],
                    where.ranks_on(h), env.run_id};
  ShmSetup local = make_shm_group(*impl.store, impl.shm_peers, impl.timeout);
  // Every host must have its group, or none uses one (all_reduce would differ across hosts).
  auto bytes = [](const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); };
  impl.store->set(fmt::format("shm/hierarchy/{}", env.rank), bytes(local.why_not));
  std::string why_not;
  for (int r = 0; r < env.world_size && why_not.empty(); ++r) {
    const std::vector<uint8_t> v = impl.store->get(fmt::format("shm/hierarchy/{}", r));
    if (!v.empty())
      why_not = fmt::format("on rank {}'s host: {}", r, std::string(v.begin(), v.end()));
  }
  if (why_not.empty()) impl.local_shm = std::move(local.group);
  return why_not;
}

// Note [SIGPIPE]
// Gloo writes to its peers' sockets without MSG_NOSIGNAL in places, so when a peer closes its
// end (it exited, or left the group early) a C++ program dies of SIGPIPE, silently, where the
// same program in Python (which ignores SIGPIPE) gets an error naming the peer. A process that
// forms a group of two or more therefore ignores SIGPIPE, as Python does, unless the program
// installed a handler of its own (only the default action is replaced): a write to a closed
// socket or pipe then fails with EPIPE and surfaces as a collective error.
// Checked at every group's formation (one sigaction call), so a program that restores the
// default afterwards is covered by its next group.
void ignore_default_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL &&
      (current.sa_flags & SA_SIGINFO) == 0) {
    ::signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

std::shared_ptr<ProcessGroup> make_process_group(const InitOptions& o) {
  auto impl = std::make_unique<detail::ProcessGroupImpl>();
  impl->env = resolve_env(o);
  const DistEnv& env = impl->env;
  impl->backend_name = choose_backend(requested_backend(o));
  impl->timeout =
      o.timeout.value_or(env.collective_timeout.value_or(milliseconds(kDefaultCollectiveTimeout)));
  const milliseconds rdzv_timeout = o.rendezvous_timeout.value_or(
      env.rdzv_timeout.value_or(milliseconds(kDefaultRendezvousTimeout)));
  DDP_CHECK(impl->timeout.count() > 0 && rdzv_timeout.count() > 0, ConfigError,
            "InitOptions: timeouts must be positive");

  if (env.world_size > 1) ignore_default_sigpipe();  // Note [SIGPIPE]

  rendezvous::Config rc(env);
  rc.single_host = env.local_world_size == env.world_size;
  rc.key_prefix = fmt::format("ddp/{}/attempt_{}/{}/", env.run_id.empty() ? "none" : env.run_id,
                              env.restart_count, o.group_name);
  rc.timeout = rdzv_timeout;
  impl->store = rendezvous::join(rc);
  agree_on_backend(*impl->store, env, requested_backend(o));

  // Shared memory when every rank is on this host (explicitly asked for, or chosen by auto);
  // the hierarchy when the ranks span hosts with several on each (auto only).
  if (impl->backend_name == "shm" || impl->backend_name == "cpu-auto") {
    const Locality where = exchange_locality(*impl->store, env, o.host_id);
    std::string why_not;
    if (where.hosts() == 1) {
      std::vector<int> all(env.world_size);
      std::iota(all.begin(), all.end(), 0);
      impl->shm_peers = {"shm/", env.rank, env.world_size, all, env.run_id};
      ShmSetup shm = make_shm_group(*impl->store, impl->shm_peers, impl->timeout);
      impl->shm = std::move(shm.group);
      why_not = shm.why_not;
    } else {
      why_not = where.first_difference;
      DDP_CHECK(impl->backend_name != "shm", RendezvousError,
                "[rank {}] backend 'shm' cannot be used: {}. It needs every rank of the group on "
                "one host (same kernel, same pid namespace); use backend 'auto' (shared memory "
                "inside each host, Gloo between them) or 'gloo'.",
                env.rank, why_not);
      if (where.uniform() && where.host_size.front() > 1) {
        why_not = form_hierarchy(*impl, where);
      } else if (env.rank == 0 && debug_info(env)) {
        fmt::print(stderr,
                   "ddp: {} hosts with {} ranks; a hierarchy needs the same number, "
                   "more than one, on each; using gloo\n",
                   where.hosts(), fmt::join(where.host_size, "/"));
      }
    }
    if (impl->shm) {
      impl->backend_name = "shm";
    } else if (impl->local_shm) {
      impl->backend_name = "shm+gloo";
    } else {
      DDP_CHECK(impl->backend_name != "shm", RendezvousError,
                "[rank {}] backend 'shm' cannot be used: {}. It needs every rank of the group on "
                "one host (same kernel, same pid namespace); use backend 'auto' or 'gloo'.",
                env.rank, why_not);
      if (env.rank == 0 && (debug_info(env) || why_not.find("hosts") == std::string::npos)) {
        fmt::print(stderr, "ddp: shared-memory transport not used ({}); using gloo\n", why_not);
      }
      impl->backend_name = "gloo";
    }
  }
  if (env.rank == 0 && debug_info(env)) {
    fmt::print(stderr, "ddp: process group '{}' of {} ranks over {}\n", o.group_name,
               env.world_size, impl->backend_name);
  }

  // All ranks are present: Gloo/NCCL now connect their pairs through the same store.
  const std::string c10d_backend = impl->backend_name == "shm+gloo" ? "gloo" : impl->backend_name;
  auto backend_store = c10::make_intrusive<::c10d::PrefixStore>(c10d_backend, impl->store);
  try {
#if DDP_WITH_NCCL
    if (impl->backend_name == "nccl") {
      impl->backend =
          c10d_compat::make_nccl(backend_store, env.rank, env.world_size, impl->timeout);
    }
#endif
    if (c10d_backend == "gloo") {
      impl->backend = c10d_compat::make_gloo(backend_store, env.rank, env.world_size, impl->timeout,
                                             gloo_device(o, env));
    }
    if (impl->local_shm) {
      // The rail: the ranks of this local index, one per host, in host order.
      const int index = impl->shm_peers.rank;
      const int hosts = env.world_size / impl->shm_peers.size;
      auto rail_store =
          c10::make_intrusive<::c10d::PrefixStore>(fmt::format("gloo-rail{}", index), impl->store);
      impl->rail = c10d_compat::make_gloo(rail_store, impl->host_index, hosts, impl->timeout,
                                          gloo_device(o, env));
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw RendezvousError(fmt::format(
        "[rank {}] all {} ranks joined, but connecting the {} backend failed: {}. A peer may "
        "have exited right after joining, or the ranks cannot reach each other's addresses "
        "(set GLOO_SOCKET_IFNAME to choose the network interface).",
        env.rank, env.world_size, impl->backend_name, e.what()));
  }
  add_diagnostics(*impl, o, rc.key_prefix);
  return std::make_shared<ProcessGroup>(std::move(impl));
}

}  // namespace ddp
