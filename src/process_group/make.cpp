// make_process_group: from options and the launch environment to a connected group.
#include <arpa/inet.h>   // inet_pton, inet_ntop
#include <netdb.h>       // getaddrinfo
#include <signal.h>      // sigaction, SIGPIPE: Note [SIGPIPE]
#include <sys/socket.h>  // socket, connect, getsockname
#include <unistd.h>      // close

#include <algorithm>
#include <numeric>  // std::iota
#include <string_view>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "base/check.h"
#include "base/log.h"
#include "process_group/cuda_device.h"
#include "process_group/internal.h"
#include "process_group/route_choice.h"
#include "process_group/shm_setup.h"
#include "process_group/store_exchange.h"
#include "process_group/testing.h"
#include "process_group/transport/transports.h"
#include "rendezvous/rendezvous.h"

#include <torch/cuda.h>  // is_available: Note [auto on a GPU]

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
  if (o.agent_store_run_id) {
    // Strings moved in, not literals assigned: GCC 12 warns falsely (-Wstringop-overflow) on
    // std::string's assign(const char*) here once inlined at -O3.
    env["TORCHELASTIC_USE_AGENT_STORE"] = std::string("1");
    env["DDP_AGENT_STORE"] = std::string("ddp");
    env["TORCHELASTIC_RUN_ID"] = *o.agent_store_run_id;
  }
  if (o.store_secret) env["DDP_STORE_SECRET"] = *o.store_secret;
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

// Where Gloo listens: the interface asked for, else loopback when every rank is on this host,
// else the address that routes towards the store. `spans_hosts`: the ranks' locality, where the
// store exchange found it; else the launcher's LOCAL_WORLD_SIZE says, which is unknown (taken
// as the world) when InitOptions placed the rank: ft::Manager's quorum groups, a user's explicit
// rank and world size.
c10d_compat::GlooDeviceSpec gloo_device(const InitOptions& o, const DistEnv& env,
                                        std::optional<bool> spans_hosts = std::nullopt) {
  c10d_compat::GlooDeviceSpec spec;
  const bool one_host =
      spans_hosts ? !*spans_hosts
                  : env.local_world_size == env.world_size || is_loopback(env.master_addr);
  if (o.gloo_interface) {
    spec.interface = *o.gloo_interface;
  } else if (auto ifname = env_knob("GLOO_SOCKET_IFNAME")) {
    spec.interface = *ifname;
  } else if (one_host) {
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

// What a group asks for, resolved as far as it can be before the ranks' locality is known.
enum class Backend {
  kShm,      // "shm": one shared-memory group (every rank on this host), or an error
  kGloo,     // "gloo"
  kShmGloo,  // "shm+gloo": the hierarchy (shm when every rank is on this host), or an error
  kNccl,     // "nccl"
  kAuto,   // "auto" for CPU tensors: shm on one host, else the hierarchy where it forms, else gloo
  kTuned,  // "tuned" for CPU tensors: auto, the hierarchy's all_reduce route measured
};

// One backend's name (no device prefix).
Backend choose_backend(const std::string& requested) {
  if (requested == "gloo") return Backend::kGloo;
  if (requested == "shm") return Backend::kShm;
  if (requested == "shm+gloo") return Backend::kShmGloo;
  if (requested == "nccl") {
    DDP_CHECK(DDP_WITH_NCCL, ConfigError,
              "backend 'nccl' is not available: this build of ddp-cpp uses a CPU-only LibTorch. "
              "Use backend 'gloo' (or 'auto'), or rebuild against a CUDA LibTorch.");
    return Backend::kNccl;
  }
  DDP_CHECK(requested == "auto" || requested == "tuned", ConfigError,
            "unknown backend '{}': choose 'shm' (CPU, ranks on one host), 'gloo' (CPU), "
            "'shm+gloo' (CPU, shm inside hosts and Gloo between), 'nccl' (CUDA), 'auto' or "
            "'tuned' (auto, the all_reduce route across hosts measured)",
            requested);
  return requested == "tuned" ? Backend::kTuned : Backend::kAuto;
}

// A backend per device type (Note [Backend pairs] in transport/paired.cpp): "cpu:X,cuda:Y", in
// either order, or one of them alone.
struct BackendPair {
  std::string cpu;   // "" when not given
  std::string cuda;  // "" when not given
};

// `requested` split by device when it names devices (PyTorch's "cpu:gloo,cuda:nccl"); nullopt
// for one backend's name.
std::optional<BackendPair> split_by_device(const std::string& requested) {
  if (requested.find(':') == std::string::npos) return std::nullopt;
  BackendPair pair;
  size_t from = 0;
  while (from <= requested.size()) {
    const size_t comma = std::min(requested.find(',', from), requested.size());
    const std::string item = requested.substr(from, comma - from);
    const size_t colon = item.find(':');
    const std::string device = item.substr(0, colon);
    const std::string name = colon == std::string::npos ? "" : item.substr(colon + 1);
    DDP_CHECK(device == "cpu" || device == "cuda", ConfigError,
              "backend '{}': '{}' names no device type; a backend per device is written "
              "'cpu:NAME,cuda:NAME' (as PyTorch's 'cpu:gloo,cuda:nccl')",
              requested, item);
    std::string& slot = device == "cpu" ? pair.cpu : pair.cuda;
    DDP_CHECK(slot.empty(), ConfigError, "backend '{}': device '{}' is given twice", requested,
              device);
    DDP_CHECK(!name.empty(), ConfigError, "backend '{}': no backend named for '{}'", requested,
              device);
    slot = name;
    from = comma + 1;
  }
  return pair;
}

// What a group asks for: one backend (`cpu`, which is NCCL for "nccl"), or a pair whose CUDA
// side is `cuda`.
struct BackendSpec {
  Backend cpu = Backend::kAuto;
  std::optional<Backend> cuda;  // kNccl or kGloo
};

// Note [auto on a GPU]
// "auto" (and "tuned") on a CUDA build with a GPU visible bind a backend per device type, as
// PyTorch 2.x's init_process_group does without a backend ("cpu:gloo,cuda:nccl"): NCCL for CUDA
// tensors, and for CPU tensors what auto chooses on a CPU machine (shm on one host, the
// hierarchy or Gloo across hosts). A GPU job's CPU collectives (metrics, flags, the checkpoint's
// and the fault-tolerance manager's small exchanges, the user's own) then go over shared memory
// or Gloo as they are, instead of being staged through the GPU for NCCL (Note [Staging
// tensors]), and backend() says "cpu:shm,cuda:nccl". "nccl" alone still means NCCL for both.
BackendSpec choose_backends(const std::string& requested) {
  const std::optional<BackendPair> pair = split_by_device(requested);
  if (!pair) {
    const Backend one = choose_backend(requested);
    if ((one == Backend::kAuto || one == Backend::kTuned) && DDP_WITH_NCCL &&
        torch::cuda::is_available()) {
      return {one, Backend::kNccl};
    }
    return {one, std::nullopt};
  }
  BackendSpec spec;
  if (!pair->cuda.empty()) {
    DDP_CHECK(pair->cuda == "nccl" || pair->cuda == "gloo", ConfigError,
              "backend '{}': CUDA tensors go over 'nccl' or 'gloo', not '{}'", requested,
              pair->cuda);
    spec.cuda = choose_backend(pair->cuda);
  }
  if (pair->cpu.empty()) return {*spec.cuda, std::nullopt};  // "cuda:X" alone: X
  DDP_CHECK(pair->cpu != "nccl", ConfigError,
            "backend '{}': 'nccl' moves CUDA tensors; for 'cpu' choose 'shm', 'gloo', "
            "'shm+gloo', 'auto' or 'tuned'",
            requested);
  // auto and tuned here mean the CPU's choice, even on a GPU machine.
  spec.cpu = pair->cpu == "auto"    ? Backend::kAuto
             : pair->cpu == "tuned" ? Backend::kTuned
                                    : choose_backend(pair->cpu);
  // Gloo for both: one Gloo group takes both (a CUDA LibTorch's Gloo stages CUDA tensors).
  if (!spec.cuda || (*spec.cuda == Backend::kGloo && spec.cpu == Backend::kGloo)) {
    spec.cuda.reset();
  }
  return spec;
}

bool uses_nccl(const BackendSpec& spec) {
  return spec.cpu == Backend::kNccl || spec.cuda == Backend::kNccl;
}

// Every rank must ask for the same transport (DDP_BACKEND set differently on two nodes would
// otherwise leave each side waiting for the other's connections until a timeout). Each rank
// publishes its request; all compare, so all fail together naming the first difference.
void agree_on_backend(::c10d::Store& store, const DistEnv& env, const std::string& requested) {
  const std::vector<std::string> all =
      store_exchange::exchange(store, "backend", env.rank, env.world_size, requested,
                               store_exchange::Linger::kUntilAllRead);
  for (int r = 0; r < env.world_size; ++r) {
    DDP_CHECK(all[r] == requested, ConfigError,
              "[rank {}] ranks ask for different backends: this rank '{}', rank {} '{}'. Set the "
              "same InitOptions::backend / DDP_BACKEND / ddprun --backend on every node.",
              env.rank, requested, r, all[r]);
  }
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
    impl.reporter = std::make_shared<HangReporter>(
        c10::make_intrusive<::c10d::PrefixStore>("flight_recorder", impl.diag_store), impl.recorder,
        HangReporter::Options{.rank = env.rank,
                              .size = env.world_size,
                              .group = o.group_name,
                              .dump_dir = dump_dir(),
                              .answer_deadline = o.hang_report_wait.value_or(kAnswerDeadline)});
  }
  // Transports that compare calls themselves (shm) need not; the others gather them
  // (Transport::gather_calls; not NCCL, which would need CUDA tensors).
  impl.check_calls =
      env.debug == DebugLevel::kDetail && env.world_size > 1 && !impl.caps().checks_calls;
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

// The timeouts: explicit options, else the launch environment, else the defaults.
struct Timeouts {
  milliseconds collective;
  milliseconds rendezvous;
};
Timeouts resolve_timeouts(const InitOptions& o, const DistEnv& env) {
  const Timeouts t{o.timeout.value_or(
                       env.collective_timeout.value_or(milliseconds(kDefaultCollectiveTimeout))),
                   o.rendezvous_timeout.value_or(
                       env.rdzv_timeout.value_or(milliseconds(kDefaultRendezvousTimeout)))};
  DDP_CHECK(t.collective.count() > 0 && t.rendezvous.count() > 0, ConfigError,
            "InitOptions: timeouts must be positive");
  return t;
}

rendezvous::Config rendezvous_config(const InitOptions& o, const DistEnv& env,
                                     milliseconds timeout) {
  rendezvous::Config rc(env);
  rc.single_host = env.local_world_size == env.world_size;
  rc.key_prefix = fmt::format("ddp/{}/attempt_{}/{}/", env.run_id.empty() ? "none" : env.run_id,
                              env.restart_count, o.group_name);
  rc.timeout = timeout;
  return rc;
}

// Runs `connect` (a c10d backend's construction, which connects every pair through the store);
// its failure becomes a RendezvousError that says what to check.
template <typename Connect>
auto connected(const DistEnv& env, const std::string& backend, Connect&& connect) {
  try {
    return connect();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw RendezvousError(fmt::format(
        "[rank {}] all {} ranks joined, but connecting the {} backend failed: {}. A peer may "
        "have exited right after joining, or the ranks cannot reach each other's addresses "
        "(set GLOO_SOCKET_IFNAME to choose the network interface).",
        env.rank, env.world_size, backend, e.what()));
  }
}

// Gloo or NCCL over the whole group (keys under "gloo/" or "nccl/", or `keys`); `spans_hosts`
// as gloo_device() takes it.
std::unique_ptr<Transport> c10d_transport(detail::ProcessGroupImpl& impl, const InitOptions& o,
                                          Backend which, const std::string& keys = "",
                                          std::optional<bool> spans_hosts = std::nullopt) {
  const DistEnv& env = impl.env;
  const std::string backend = which == Backend::kNccl ? "nccl" : "gloo";
  auto store = c10::make_intrusive<::c10d::PrefixStore>(keys.empty() ? backend : keys, impl.store);
  return connected(env, backend, [&] {
#if DDP_WITH_NCCL
    if (which == Backend::kNccl) {
      return make_c10d_transport(backend,
                                 c10d_compat::make_nccl(store, env.rank, env.world_size,
                                                        impl.timeout, impl.cuda_device.value()),
                                 env.world_size, impl.timeout);
    }
#endif
    return make_c10d_transport(backend,
                               c10d_compat::make_gloo(store, env.rank, env.world_size, impl.timeout,
                                                      gloo_device(o, env, spans_hosts)),
                               env.world_size, impl.timeout);
  });
}

// Every rank on this host: one shared-memory group, or why not (the same on every rank).
std::string form_shm(detail::ProcessGroupImpl& impl, std::unique_ptr<Transport>& out) {
  const DistEnv& env = impl.env;
  std::vector<int> all(env.world_size);
  std::iota(all.begin(), all.end(), 0);
  ShmPeers peers{"shm/", env.rank, env.world_size, all, env.run_id};
  ShmSetup shm = make_shm_group(*impl.store, peers, impl.timeout);
  if (shm.group) {
    out = make_shm_transport(shm.group, ShmCommBuffers(impl.store, shm.group, std::move(peers)));
  }
  return shm.why_not;
}

// Note [Hierarchical collectives] (transport/hierarchy.cpp): this host's shm group, if every
// host could form one (all_reduce would differ across hosts otherwise), then the flat Gloo group
// and this rank's rail. Returns why not, or "" when formed.
std::string form_hierarchy(detail::ProcessGroupImpl& impl, const InitOptions& o,
                           const Locality& where, std::unique_ptr<Transport>& out) {
  const DistEnv& env = impl.env;
  const int h = where.host[env.rank];
  HierarchyLayout layout;
  layout.rank = env.rank;
  layout.host = h;
  layout.local = where.local_rank[env.rank];
  for (int other = 0; other < where.hosts(); ++other)
    layout.rank_at.push_back(where.ranks_on(other));
  ShmPeers peers{fmt::format("shm/host{}/", h), layout.local, where.host_size[h], where.ranks_on(h),
                 env.run_id};
  ShmSetup local = make_shm_group(*impl.store, peers, impl.timeout);
  const std::vector<std::string> outcomes =
      store_exchange::exchange(*impl.store, "shm/hierarchy", env.rank, env.world_size,
                               local.why_not);
  for (int r = 0; r < env.world_size; ++r) {
    if (!outcomes[r].empty()) return fmt::format("on rank {}'s host: {}", r, outcomes[r]);
  }
  auto flat_store = c10::make_intrusive<::c10d::PrefixStore>("gloo", impl.store);
  auto rail_store =
      c10::make_intrusive<::c10d::PrefixStore>(fmt::format("gloo-rail{}", layout.local),
                                               impl.store);
  out = connected(env, "shm+gloo", [&] {
    auto flat = c10d_compat::make_gloo(flat_store, env.rank, env.world_size, impl.timeout,
                                       gloo_device(o, env, /*spans_hosts=*/true));
    auto rail = c10d_compat::make_gloo(rail_store, layout.host, layout.hosts(), impl.timeout,
                                       gloo_device(o, env, /*spans_hosts=*/true));
    ShmCommBuffers buffers(impl.store, local.group, std::move(peers));
    return make_hierarchy_transport(std::move(local.group), std::move(buffers), std::move(rail),
                                    std::move(flat), layout);
  });
  return "";
}

// Every rank refuses the locality they all read (an explicit backend it does not allow), with
// `message`: once all have read it (rank 0 may host the store: Note [Store exchange]).
[[noreturn]] void refuse_together(detail::ProcessGroupImpl& impl, const std::string& message) {
  store_exchange::exchange(*impl.store, "shm/refused", impl.env.rank, impl.env.world_size, "",
                           store_exchange::Linger::kUntilAllRead);
  throw RendezvousError(message);
}

// The CPU transports by locality: shm when every rank is on this host (asked for, or chosen by
// auto, tuned or shm+gloo); the hierarchy when the ranks span hosts with several on each (auto;
// tuned, which then measures its route; shm+gloo, which must get it); else Gloo.
std::unique_ptr<Transport> cpu_transport(detail::ProcessGroupImpl& impl, const InitOptions& o,
                                         Backend choice,
                                         const std::optional<std::string>& host_id) {
  const DistEnv& env = impl.env;
  const Locality where = exchange_locality(*impl.store, env, host_id);
  std::unique_ptr<Transport> out;
  std::string why_not;
  if (where.hosts() == 1) {
    why_not = form_shm(impl, out);
  } else {
    why_not = where.first_difference;
    const bool uniform = where.uniform() && where.host_size.front() > 1;
    if (choice == Backend::kShm) {
      refuse_together(impl, fmt::format("[rank {}] backend 'shm' cannot be used: {}. It needs "
                                        "every rank of the group on one host (same kernel, same "
                                        "pid namespace); use backend 'auto' (shared memory "
                                        "inside each host, Gloo between them) or 'gloo'.",
                                        env.rank, why_not));
    }
    if (!uniform && choice == Backend::kShmGloo) {
      refuse_together(impl, fmt::format("[rank {}] backend 'shm+gloo' cannot be used: {} hosts "
                                        "with {} ranks; it needs the same number of ranks, more "
                                        "than one, on every host. Use backend 'auto' or 'gloo'.",
                                        env.rank, where.hosts(),
                                        fmt::join(where.host_size, "/")));
    }
    if (uniform) {
      why_not = form_hierarchy(impl, o, where, out);
      if (!why_not.empty() && choice == Backend::kShmGloo) {
        refuse_together(impl, fmt::format("[rank {}] backend 'shm+gloo' cannot be used: {}. Use "
                                          "backend 'auto' or 'gloo'.",
                                          env.rank, why_not));
      }
    } else if (env.rank == 0 && debug_info(env)) {
      log::note(env.rank,
                "{} hosts with {} ranks; a hierarchy needs the same number, more than one, on "
                "each; using gloo",
                where.hosts(), fmt::join(where.host_size, "/"));
    }
  }
  if (out) return out;
  DDP_CHECK(choice != Backend::kShm, RendezvousError,
            "[rank {}] backend 'shm' cannot be used: {}. It needs every rank of the group on one "
            "host (same kernel, same pid namespace); use backend 'auto' or 'gloo'.",
            env.rank, why_not);
  if (env.rank == 0 && (debug_info(env) || why_not.find("hosts") == std::string::npos)) {
    log::note(env.rank, "shared-memory transport not used ({}); using gloo", why_not);
  }
  return c10d_transport(impl, o, Backend::kGloo, "", where.hosts() > 1);
}

// Note [Choosing the all_reduce route] (route_choice.h): backend tuned's hierarchy measures
// which way its all_reduces go.
void choose_route(ProcessGroup& pg, RouteTuning& routes, const DistEnv& env) {
  std::vector<RouteSample> samples;
  try {
    samples = measure_routes(pg, routes);
  } catch (const Error& e) {
    throw RendezvousError(fmt::format(
        "[rank {}] all {} ranks joined and the shm+gloo transport formed, but measuring its "
        "all_reduce against flat Gloo failed: {}",
        env.rank, env.world_size, e.what()));
  }
  const uint64_t from = flat_route_from(samples);
  routes.set_flat_route_from(from);
  if (env.rank == 0 && debug_info(env)) log::note(env.rank, "{}", describe_routes(samples, from));
}

// The steps after the ranks met on `impl.store`: one transport agreed by all (Gloo and NCCL
// connect their pairs through the same store), the diagnostics (their keys under `prefix`),
// backend tuned's route.
void form_transport(detail::ProcessGroupImpl& impl, const InitOptions& o,
                    const std::string& requested, const BackendSpec& spec,
                    const std::string& prefix) {
  const DistEnv& env = impl.env;
  const Backend choice = spec.cpu;
  agree_on_backend(*impl.store, env, requested);
  impl.transport = choice == Backend::kGloo || choice == Backend::kNccl
                       ? c10d_transport(impl, o, choice)
                       : cpu_transport(impl, o, choice, impl.host_id);
  if (spec.cuda) {  // Note [Backend pairs]: the CUDA side, under keys of its own
    impl.transport = make_paired_transport(std::move(impl.transport),
                                           c10d_transport(impl, o, *spec.cuda, "cuda-side"));
  }
  if (env.rank == 0 && debug_info(env)) {
    log::note(env.rank, "process group '{}' of {} ranks over {}", o.group_name, env.world_size,
              impl.caps().name);
  }
  add_diagnostics(impl, o, prefix);
  if (RouteTuning* routes = impl.transport->route_tuning(); routes && choice == Backend::kTuned) {
    choose_route(impl, *routes, env);
  }
}

// Forming a group, step by step: where this rank stands, the timeouts, the rendezvous, one
// transport agreed by all, the diagnostics. `host_id`: detail::TestingOptions'.
std::shared_ptr<ProcessGroup> make_group(const InitOptions& o,
                                         const std::optional<std::string>& host_id) {
  auto impl = std::make_shared<detail::ProcessGroupImpl>();
  impl->env = resolve_env(o);
  impl->host_id = host_id;
  impl->gloo_interface = o.gloo_interface;
  impl->group_name = o.group_name;
  const DistEnv& env = impl->env;
  impl->requested_backend = requested_backend(o);
  const BackendSpec spec = choose_backends(impl->requested_backend);
  const Timeouts timeouts = resolve_timeouts(o, env);
  impl->timeout = timeouts.collective;
  // Note [Device binding]: before the backend (NCCL) or anything else touches CUDA.
  if (o.device_id || uses_nccl(spec)) {
    impl->cuda_device = choose_cuda_device(o.device_id, env.local_rank, visible_cuda_devices(),
                                           uses_nccl(spec), env.rank);
    if (impl->cuda_device) bind_cuda_device(*impl->cuda_device);
  }
  if (env.world_size > 1) ignore_default_sigpipe();  // Note [SIGPIPE]

  const rendezvous::Config rc = rendezvous_config(o, env, timeouts.rendezvous);
  impl->store = rendezvous::join(rc);
  impl->store_prefix = rc.key_prefix;
  form_transport(*impl, o, impl->requested_backend, spec, rc.key_prefix);
  return impl;
}

// Note [Subgroups]
// new_group and split_group form a group among some ranks of a formed one (the parent), as
// torch.distributed's do, without a rendezvous of their own: the parent's ranks met already.
// Every parent rank calls them in the same order, and each call takes the parent's next
// subgroup number, which names the subgroup's keys in the parent's store ("subgroup<k>/", and
// "/<list>" for split_group's lists), so that two calls never share a key. Members use the
// parent's store connection (our client serialises calls; forming is its main use), agree
// on the backend there like any group (a member missing from the call fails that exchange
// within the store's timeout, the rendezvous timeout), and form the transport their own
// locality allows: members on one host get shm even under a parent that spans hosts. The backend asked for is the parent's
// ("shm+gloo" and "tuned" become "auto": the hierarchy may not fit the subgroup, and a route
// measured for the parent says nothing about it), or NewGroupOptions::backend. The subgroup
// lives on its own (its own numbering, flight recorder and timeout); destroying the parent
// first is allowed while the store's host (rank 0 or the launcher's agent) lives.
std::string subgroup_backend(const std::string& parent) {
  if (std::optional<BackendPair> pair = split_by_device(parent); pair && !pair->cpu.empty()) {
    const std::string cpu = subgroup_backend(pair->cpu);
    return pair->cuda.empty() ? "cpu:" + cpu : fmt::format("cpu:{},cuda:{}", cpu, pair->cuda);
  }
  return parent == "shm+gloo" || parent == "tuned" ? "auto" : parent;
}

// The subgroup `members` (sorted parent ranks, this rank among them) under `label`.
std::shared_ptr<ProcessGroup> form_subgroup(detail::ProcessGroupImpl& parent,
                                            const std::vector<int>& members,
                                            const std::string& label,
                                            const NewGroupOptions& options) {
  auto impl = std::make_shared<detail::ProcessGroupImpl>();
  impl->env = parent.env;
  DistEnv& env = impl->env;
  env.rank = static_cast<int>(std::find(members.begin(), members.end(), parent.env.rank) -
                              members.begin());
  env.world_size = static_cast<int>(members.size());
  // Members on one host when the parent is on one; else unknown (gloo_device routes to
  // MASTER_ADDR instead of assuming 127.0.0.1).
  env.local_world_size = parent.env.local_world_size == parent.env.world_size ? env.world_size : 0;
  impl->host_id = parent.host_id;
  impl->gloo_interface = parent.gloo_interface;
  impl->group_name = parent.group_name + "/" + label;
  impl->requested_backend = options.backend.value_or(subgroup_backend(parent.requested_backend));
  const BackendSpec spec = choose_backends(impl->requested_backend);
  impl->timeout = options.timeout.value_or(parent.timeout);
  DDP_CHECK(impl->timeout.count() > 0, ConfigError,
            "[rank {}] new_group: the timeout must be "
            "positive",
            parent.env.rank);
  impl->cuda_device = parent.cuda_device;
  // The parent's prefix and the label over the parent's store connection: one PrefixStore, so
  // that the diagnostics get their own bounded connection as for any group.
  impl->store_prefix = parent.store_prefix + "/" + label;
  if (auto* prefixed = dynamic_cast<::c10d::PrefixStore*>(parent.store.get())) {
    impl->store = c10::make_intrusive<::c10d::PrefixStore>(impl->store_prefix,
                                                           prefixed->getUnderlyingStore());
  } else {  // a group of one's in-process store
    impl->store = c10::make_intrusive<::c10d::PrefixStore>(label, parent.store);
  }
  InitOptions o;
  o.gloo_interface = impl->gloo_interface;
  o.group_name = impl->group_name;
  form_transport(*impl, o, impl->requested_backend, spec, impl->store_prefix);
  return impl;
}

// `ranks` checked against the parent and sorted (empty: every rank).
std::vector<int> members_of(const detail::ProcessGroupImpl& parent, std::vector<int> ranks,
                            const char* call) {
  const int n = parent.env.world_size;
  if (ranks.empty()) {
    ranks.resize(n);
    std::iota(ranks.begin(), ranks.end(), 0);
  }
  std::sort(ranks.begin(), ranks.end());
  for (size_t i = 0; i < ranks.size(); ++i) {
    DDP_CHECK(ranks[i] >= 0 && ranks[i] < n, ConfigError,
              "[rank {}] {}: rank {} is not in this group of {} ranks", parent.env.rank, call,
              ranks[i], n);
    DDP_CHECK(i == 0 || ranks[i] != ranks[i - 1], ConfigError,
              "[rank {}] {}: rank {} is listed twice", parent.env.rank, call, ranks[i]);
  }
  return ranks;
}

}  // namespace

std::shared_ptr<ProcessGroup> ProcessGroup::new_group(std::vector<int> ranks,
                                                      const NewGroupOptions& options) {
  detail::ProcessGroupImpl& parent = detail::impl_of(*this);
  const std::vector<int> members = members_of(parent, std::move(ranks), "new_group");
  const std::string label = fmt::format("subgroup{}", ++parent.subgroups);
  if (!std::binary_search(members.begin(), members.end(), parent.env.rank)) return nullptr;
  return form_subgroup(parent, members, label, options);
}

std::shared_ptr<ProcessGroup> ProcessGroup::split_group(
    const std::vector<std::vector<int>>& split_ranks, const NewGroupOptions& options) {
  detail::ProcessGroupImpl& parent = detail::impl_of(*this);
  std::vector<int> seen(static_cast<size_t>(parent.env.world_size), -1);
  std::shared_ptr<ProcessGroup> mine;
  std::optional<std::pair<size_t, std::vector<int>>> own;
  for (size_t g = 0; g < split_ranks.size(); ++g) {
    DDP_CHECK(!split_ranks[g].empty(), ConfigError, "[rank {}] split_group: list {} is empty",
              parent.env.rank, g);
    const std::vector<int> members = members_of(parent, split_ranks[g], "split_group");
    for (int r : members) {
      DDP_CHECK(seen[r] < 0, ConfigError,
                "[rank {}] split_group: rank {} is in list {} and in list {}; the lists must "
                "not overlap",
                parent.env.rank, r, seen[r], g);
      seen[r] = static_cast<int>(g);
    }
    if (std::binary_search(members.begin(), members.end(), parent.env.rank)) {
      own.emplace(g, members);
    }
  }
  const uint64_t k = ++parent.subgroups;  // a refused call (above) takes no number
  if (!own) return nullptr;
  return form_subgroup(parent, own->second, fmt::format("subgroup{}/{}", k, own->first), options);
}

std::shared_ptr<ProcessGroup> make_process_group(const InitOptions& options) {
  return make_group(options, std::nullopt);
}

std::shared_ptr<ProcessGroup> make_process_group(const detail::TestingOptions& options) {
  return make_group(options, options.host_id);
}

}  // namespace ddp
