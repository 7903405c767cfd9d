// Binding each worker to its share of the node's CPUs: ddprun --cpu-bind none|cores|numa.
//
// Note [CPU binding]
// By default (none) every worker may run on every CPU ddprun may run on, and the kernel's
// scheduler places their threads, as torchrun does. --cpu-bind cores gives each local worker a
// contiguous block of whole physical cores (all their hardware threads), blocks as equal as the
// core count allows, in NUMA node order, so a worker's threads share caches and memory and never
// migrate onto another worker's cores. --cpu-bind numa (torchrun 2.x's --numa-binding node)
// spreads the workers over the NUMA nodes in blocks and lets each run on all the CPUs of its
// node. Only the CPUs of ddprun's own affinity mask are handed out (a Slurm or cgroup limit
// stays a limit). With fewer cores than workers the blocks are single hardware threads; with
// fewer CPUs than workers, workers share CPUs round-robin (ddprun says so). Each worker's
// OMP_NUM_THREADS, unless the user exported one, is the CPU count of its block (numa: of its
// node divided among the workers on it), so LibTorch's and the BLAS's threads match the CPUs
// the worker has. Measured on this project's 2-core machine (docs/ddprun.md, "CPU binding"): not
// a win there, so none stays the default.
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace ddp::launcher {

enum class CpuBind { kNone, kCores, kNuma };

// "none" | "cores" | "numa"; nullopt for anything else.
std::optional<CpuBind> parse_cpu_bind(const std::string& text);
const char* to_string(CpuBind mode);

// One CPU ddprun may run on, with what it shares: its physical core and its NUMA node.
struct Cpu {
  int id = 0;
  int package = 0;  // socket
  int core = 0;     // core id within the package
  int numa = 0;     // NUMA node (0 without NUMA)
};

// The CPUs of this process's affinity mask, with their topology from `sysfs_cpu` (the
// /sys/devices/system/cpu folder; tests pass a fake one). A CPU whose topology files are
// missing counts as a core of its own on node 0.
std::vector<Cpu> read_cpus(const std::vector<int>& allowed,
                           const std::string& sysfs_cpu = "/sys/devices/system/cpu");
// The CPUs of this process's affinity mask (sched_getaffinity).
std::vector<int> allowed_cpus();

// What each of `workers` local workers gets: its CPUs and its thread count. Pure.
struct Binding {
  std::vector<int> cpus;  // sorted
  int threads = 1;        // its OMP_NUM_THREADS
};
struct BindingPlan {
  std::vector<Binding> workers;  // empty for kNone
  std::string note;              // one line for ddprun's startup notes (empty for kNone)
};
BindingPlan plan_cpu_binding(CpuBind mode, const std::vector<Cpu>& cpus, int workers);

// "0-3,8,10-11".
std::string format_cpu_list(const std::vector<int>& cpus);

}  // namespace ddp::launcher
