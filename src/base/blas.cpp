// BLAS inspection and OpenBLAS core selection (see include/ddp/blas.h).
#include "ddp/blas.h"

#include "ddp/env.h"
#include "ddp/error.h"
#include "ddp/threads.h"

#include <dlfcn.h>     // dlsym, dladdr, dlopen
#include <fcntl.h>     // O_CLOEXEC
#include <poll.h>      // poll
#include <signal.h>    // kill
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // execv, fork, pipe2

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cstdlib>  // getenv, setenv, realpath
#include <filesystem>
#include <vector>

#include <fmt/format.h>

namespace ddp {
namespace {

// Set in the re-executed image so that we never loop.
constexpr const char* kReexecMarker = "DDP_BLAS_REEXECUTED";
// What ddp chose, by the re-exec or in a launcher: "core", "wait" or "core,wait".
constexpr const char* kChosenMarker = "DDP_BLAS_CHOSEN";

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

int cpu_level() {
  __builtin_cpu_init();
  // __builtin_cpu_supports also checks that the OS saves the wider registers (XCR0).
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512cd")) {
    return 4;
  }
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 3;
  if (__builtin_cpu_supports("avx")) return 2;
  return 1;
}

using CorenameFn = char* (*)();

}  // namespace

int openblas_core_level(std::string_view core) {
  static constexpr std::array<std::pair<std::string_view, int>, 29> kLevels = {{
      {"skylakex", 4},   {"cooperlake", 4},  {"sapphirerapids", 4}, {"haswell", 3},
      {"zen", 3},        {"skylake", 3},     {"sandybridge", 2},    {"bulldozer", 2},
      {"piledriver", 2}, {"steamroller", 2}, {"excavator", 2},      {"prescott", 1},
      {"core2", 1},      {"penryn", 1},      {"dunnington", 1},     {"nehalem", 1},
      {"atom", 1},       {"athlon", 1},      {"opteron", 1},        {"opteron_sse3", 1},
      {"barcelona", 1},  {"bobcat", 1},      {"nano", 1},           {"katmai", 1},
      {"coppermine", 1}, {"northwood", 1},   {"banias", 1},         {"yonah", 1},
      {"generic", 1},
  }};
  const std::string name = lower(core);
  for (const auto& [known, level] : kLevels) {
    if (name == known) return level;
  }
  return 0;
}

std::string best_openblas_core() {
  switch (cpu_level()) {
    case 4:
      // Cooperlake = SkylakeX kernels plus bf16 ones; only for CPUs that have AVX512-BF16.
      return __builtin_cpu_supports("avx512bf16") ? "Cooperlake" : "SkylakeX";
    case 3: return "Haswell";
    case 2: return "Sandybridge";
    default: return "";
  }
}

namespace {
// GOMP_SPINCOUNT: not a knob of ours, only seen (a user's spin count is a wait policy).
bool omp_wait_chosen(const BlasReport& r) {
  return !r.wait_policy.empty() || std::getenv("GOMP_SPINCOUNT") != nullptr;
}
}  // namespace

bool BlasReport::needs_quiet_threads() const {
  return threading == "pthreads" && rank_threads > 1 &&
         (!omp_wait_chosen(*this) || thread_timeout.empty());
}

bool BlasReport::needs_core_override() const {
  if (vendor != "OpenBLAS" || !user_coretype.empty() || cpu_best_core.empty()) return false;
  const int have = openblas_core_level(core);
  return have > 0 && have < openblas_core_level(cpu_best_core);
}

std::string BlasReport::summary() const {
  std::string s = fmt::format("BLAS: {}", vendor);
  if (!core.empty()) s += fmt::format(" (core {})", core);
  if (!library.empty()) s += fmt::format(" from {}", library);
  if (!user_coretype.empty()) {
    s += fmt::format("; OPENBLAS_CORETYPE={}{}", user_coretype,
                     chose_core ? " chosen by ddp from this CPU's features" : " set by the user");
    const int user_level = openblas_core_level(user_coretype);
    if (!chose_core && user_level > 0 && user_level < openblas_core_level(cpu_best_core)) {
      s += fmt::format(" (kept; this CPU could run the faster {} kernels)", cpu_best_core);
    }
  }
  if (!threading.empty()) s += fmt::format(", {}", threading);
  if (!wait_policy.empty()) s += fmt::format("; OMP_WAIT_POLICY={}", wait_policy);
  if (!thread_timeout.empty()) s += fmt::format("; OPENBLAS_THREAD_TIMEOUT={}", thread_timeout);
  if (chose_wait) s += " (idle threads sleep: chosen by ddp)";
  if (is_reference()) {
    s += "; WARNING: the reference BLAS is 20-50x slower than OpenBLAS: install "
         "libopenblas0-pthread (scripts/install-deps.sh does)";
  } else if (needs_quiet_threads()) {
    s += "; WARNING: OpenMP's and OpenBLAS's idle threads spin on each other's cores: call "
         "ddp::ensure_fast_blas(argc, argv) first in main() or export OMP_WAIT_POLICY=passive "
         "OPENBLAS_THREAD_TIMEOUT=4";
  } else if (needs_core_override()) {
    s += fmt::format(
        "; WARNING: this CPU supports the faster {0} kernels: call "
        "ddp::ensure_fast_blas(argc, argv) first in main() or export "
        "OPENBLAS_CORETYPE={0}",
        cpu_best_core);
  }
  return s;
}

BlasReport inspect_blas() {
  BlasReport r;
  if (auto v = env_knob("OPENBLAS_CORETYPE")) r.user_coretype = *v;
  r.reexecuted = std::getenv(kReexecMarker) != nullptr;
  if (const char* marker = std::getenv(kChosenMarker)) {  // "core,wait"
    r.chose_core = std::string_view(marker).find("core") != std::string_view::npos;
    r.chose_wait = std::string_view(marker).find("wait") != std::string_view::npos;
  }
  r.cpu_best_core = best_openblas_core();
  if (auto v = env_knob("OMP_WAIT_POLICY")) r.wait_policy = *v;
  if (auto v = env_knob("OPENBLAS_THREAD_TIMEOUT")) r.thread_timeout = *v;
  int local_ranks = 1;
  try {
    local_ranks = parse_dist_env(current_environment()).local_world_size;
  } catch (const Error&) {
    // A malformed launch environment: init_process_group says so; count this rank alone.
  }
  r.rank_threads = threads_per_rank(local_ranks);

  void* sgemm = dlsym(RTLD_DEFAULT, "sgemm_");
  if (sgemm == nullptr) {
    // Nothing loaded it yet (e.g. a tool that does not link LibTorch): load the system's.
    void* handle = dlopen("libblas.so.3", RTLD_LAZY | RTLD_GLOBAL);
    if (handle != nullptr) sgemm = dlsym(handle, "sgemm_");
  }
  if (sgemm == nullptr) {
    r.vendor = "none";
    return r;
  }
  Dl_info info{};
  if (dladdr(sgemm, &info) != 0 && info.dli_fname != nullptr) {
    std::error_code ec;
    auto path = std::filesystem::canonical(info.dli_fname, ec);
    r.library = ec ? std::string(info.dli_fname) : path.string();
  }
  if (auto corename = reinterpret_cast<CorenameFn>(dlsym(RTLD_DEFAULT, "openblas_get_corename"))) {
    r.vendor = "OpenBLAS";
    if (const char* c = corename()) r.core = c;
    using ParallelFn = int (*)();
    if (auto parallel = reinterpret_cast<ParallelFn>(dlsym(RTLD_DEFAULT, "openblas_get_parallel"))) {
      const int mode = parallel();
      r.threading = mode == 1 ? "pthreads" : mode == 2 ? "OpenMP" : "sequential";
    }
  } else if (r.library.find("/blas/") != std::string::npos) {
    r.vendor = "reference BLAS (netlib)";
  } else {
    r.vendor = "unknown";
  }
  return r;
}

BlasReport inspect_blas_apart() {
  BlasReport failed;
  failed.vendor = "unknown";
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return failed;
  const pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return failed;
  }
  if (pid == 0) {
    close(fds[0]);
    const BlasReport r = inspect_blas();
    const std::string out =
        fmt::format("{}\n{}\n{}\n{}\n", r.vendor, r.core, r.threading, r.library);
    const char* p = out.data();
    for (size_t left = out.size(); left > 0;) {
      const ssize_t n = write(fds[1], p, left);
      if (n <= 0) break;
      p += n;
      left -= static_cast<size_t>(n);
    }
    _exit(0);
  }
  close(fds[1]);
  std::string got;
  char buf[512];
  pollfd pfd{fds[0], POLLIN, 0};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  int left_ms = 10'000;
  while (left_ms > 0 && poll(&pfd, 1, left_ms) > 0) {
    const ssize_t n = read(fds[0], buf, sizeof buf);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
    left_ms = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   deadline - std::chrono::steady_clock::now())
                                   .count());
  }
  close(fds[0]);
  kill(pid, SIGKILL);  // gone already, unless it hung
  waitpid(pid, nullptr, 0);
  // This process's view of the rest (the environment, the CPU); the library's from the child.
  BlasReport r;
  std::vector<std::string> lines;
  for (size_t at = 0, nl; (nl = got.find('\n', at)) != std::string::npos; at = nl + 1) {
    lines.push_back(got.substr(at, nl - at));
  }
  if (lines.size() != 4 || lines[0].empty()) return failed;
  r.vendor = lines[0];
  r.core = lines[1];
  r.threading = lines[2];
  r.library = lines[3];
  if (auto v = env_knob("OPENBLAS_CORETYPE")) r.user_coretype = *v;
  r.cpu_best_core = best_openblas_core();
  return r;
}

EnvMap fast_blas_environment(const BlasReport& blas, const EnvMap& env) {
  // The worker's own view: its environment's choices, its thread count.
  BlasReport r = blas;
  auto get = [&](const char* name) {
    auto it = env.find(name);
    return it == env.end() ? std::string() : it->second;
  };
  r.user_coretype = get("OPENBLAS_CORETYPE");
  r.wait_policy = get("OMP_WAIT_POLICY");
  r.thread_timeout = get("OPENBLAS_THREAD_TIMEOUT");
  if (const int n = std::atoi(get("OMP_NUM_THREADS").c_str()); n >= 1) {
    r.rank_threads = n;
  } else {
    r.rank_threads = threads_per_rank(std::max(1, std::atoi(get("LOCAL_WORLD_SIZE").c_str())));
  }
  const bool core = r.needs_core_override(), quiet = r.needs_quiet_threads();
  EnvMap out;
  if (core) out["OPENBLAS_CORETYPE"] = r.cpu_best_core;
  // GOMP_SPINCOUNT is a wait policy of the user's too.
  if (quiet && r.wait_policy.empty() && get("GOMP_SPINCOUNT").empty()) {
    out["OMP_WAIT_POLICY"] = "passive";
  }
  if (quiet && r.thread_timeout.empty()) out["OPENBLAS_THREAD_TIMEOUT"] = "4";
  if (core || quiet) out[kChosenMarker] = core && quiet ? "core,wait" : core ? "core" : "wait";
  return out;
}

BlasReport ensure_fast_blas(int argc, char** argv, int threads) {
  (void)argc;
  BlasReport r = inspect_blas();
  if (threads > 0) r.rank_threads = threads;
  const bool core = r.needs_core_override(), quiet = r.needs_quiet_threads();
  const bool passive = quiet && !omp_wait_chosen(r), timeout = quiet && r.thread_timeout.empty();
  if (!(core || quiet) || r.reexecuted || argv == nullptr || argv[0] == nullptr) return r;
  // OpenBLAS picked its core, and libgomp its wait policy, when they were loaded, before
  // main(): only a fresh image can change them. execv keeps the pid, so launchers (ddprun,
  // mpirun, srun) still track the same process.
  if (core) setenv("OPENBLAS_CORETYPE", r.cpu_best_core.c_str(), /*overwrite=*/0);
  if (passive) setenv("OMP_WAIT_POLICY", "passive", /*overwrite=*/0);
  if (timeout) setenv("OPENBLAS_THREAD_TIMEOUT", "4", /*overwrite=*/0);  // 2^4 cycles, its least
  // What a launcher chose stays chosen (fast_blas_environment).
  const std::string before = std::getenv(kChosenMarker) ? std::getenv(kChosenMarker) : "";
  const bool chose_core = core || before.find("core") != std::string::npos;
  const bool chose_wait = quiet || before.find("wait") != std::string::npos;
  setenv(kReexecMarker, "1", 1);
  setenv(kChosenMarker, chose_core && chose_wait ? "core,wait" : chose_core ? "core" : "wait", 1);
  execv("/proc/self/exe", argv);
  // exec failed (no /proc?): carry on as we are; summary() carries the advice.
  if (core) unsetenv("OPENBLAS_CORETYPE");
  if (passive) unsetenv("OMP_WAIT_POLICY");
  if (timeout) unsetenv("OPENBLAS_THREAD_TIMEOUT");
  unsetenv(kReexecMarker);
  if (before.empty()) {
    unsetenv(kChosenMarker);
  } else {
    setenv(kChosenMarker, before.c_str(), 1);
  }
  return r;
}

}  // namespace ddp
