// make_process_group: from options and the launch environment to a connected group.
#include <arpa/inet.h>   // inet_pton, inet_ntop
#include <netdb.h>       // getaddrinfo
#include <sys/socket.h>  // socket, connect, getsockname
#include <unistd.h>      // close

#include <cstdio>   // stderr
#include <cstdlib>  // getenv
#include <string_view>
#include <thread>

#include <fmt/format.h>
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

milliseconds from_seconds(double s) { return milliseconds(static_cast<int64_t>(s * 1000.0)); }

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
      return k == "RANK" || k == "WORLD_SIZE" || k.starts_with("LOCAL_") ||
             k == "GROUP_RANK" || k.starts_with("TORCHELASTIC_") ||
             k.starts_with("OMPI_COMM_WORLD_") || k.starts_with("PMI_") ||
             k.starts_with("SLURM_");
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
  } else if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME")) {
    spec.interface = ifname;
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
  const char* v = std::getenv("DDP_BACKEND");
  return v != nullptr && *v != '\0' ? v : "auto";
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

bool debug_info() {
  const char* v = std::getenv("DDP_DEBUG");
  if (v == nullptr) v = std::getenv("TORCH_DISTRIBUTED_DEBUG");
  return v != nullptr && (std::string_view(v) == "info" || std::string_view(v) == "detail" ||
                          std::string_view(v) == "INFO" || std::string_view(v) == "DETAIL");
}

}  // namespace

std::shared_ptr<ProcessGroup> make_process_group(const InitOptions& o) {
  auto impl = std::make_unique<ProcessGroup::Impl>();
  impl->env = resolve_env(o);
  const DistEnv& env = impl->env;
  impl->backend_name = choose_backend(requested_backend(o));
  impl->timeout = o.timeout.value_or(
      env.collective_timeout_s ? from_seconds(*env.collective_timeout_s)
                               : milliseconds(kDefaultCollectiveTimeout));
  const milliseconds rdzv_timeout = o.rendezvous_timeout.value_or(
      env.rdzv_timeout_s ? from_seconds(*env.rdzv_timeout_s)
                         : milliseconds(kDefaultRendezvousTimeout));
  DDP_CHECK(impl->timeout.count() > 0 && rdzv_timeout.count() > 0, ConfigError,
            "InitOptions: timeouts must be positive");

  rendezvous::Config rc;
  rc.rank = env.rank;
  rc.world_size = env.world_size;
  rc.master_addr = env.master_addr;
  rc.master_port = env.master_port;
  rc.use_agent_store = env.use_agent_store;
  rc.key_prefix = fmt::format("ddp/{}/attempt_{}/{}/", env.run_id.empty() ? "none" : env.run_id,
                              env.restart_count, o.group_name);
  rc.timeout = rdzv_timeout;
  impl->store = rendezvous::join(rc);
  agree_on_backend(*impl->store, env, requested_backend(o));

  // Shared memory when every rank is on this host (explicitly asked for, or chosen by auto).
  if (impl->backend_name == "shm" || impl->backend_name == "cpu-auto") {
    ShmSetup shm = make_shm_group(*impl->store, env, impl->timeout);
    if (shm.group) {
      impl->shm = std::move(shm.group);
      impl->backend_name = "shm";
    } else {
      DDP_CHECK(impl->backend_name != "shm", RendezvousError,
                "[rank {}] backend 'shm' cannot be used: {}. It needs every rank of the group on "
                "one host (same kernel, same pid namespace); use backend 'auto' or 'gloo'.",
                env.rank, shm.why_not);
      if (env.rank == 0 && (debug_info() || shm.why_not.find("hosts") == std::string::npos)) {
        fmt::print(stderr, "ddp: shared-memory transport not used ({}); using gloo\n",
                   shm.why_not);
      }
      impl->backend_name = "gloo";
    }
  }
  if (env.rank == 0 && debug_info()) {
    fmt::print(stderr, "ddp: process group '{}' of {} ranks over {}\n", o.group_name,
               env.world_size, impl->backend_name);
  }

  // All ranks are present: Gloo/NCCL now connect their pairs through the same store.
  auto backend_store = c10::make_intrusive<::c10d::PrefixStore>(impl->backend_name, impl->store);
  try {
#if DDP_WITH_NCCL
    if (impl->backend_name == "nccl") {
      impl->backend =
          c10d_compat::make_nccl(backend_store, env.rank, env.world_size, impl->timeout);
    }
#endif
    if (impl->backend_name == "gloo") {
      impl->backend = c10d_compat::make_gloo(backend_store, env.rank, env.world_size,
                                             impl->timeout, gloo_device(o, env));
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
  return std::make_shared<ProcessGroup>(std::move(impl));
}

}  // namespace ddp
