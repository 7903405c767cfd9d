// ddprun --cpu-bind: Note [CPU binding] in cpu_bind.h.
#include "cpu_bind.h"

#include <sched.h>  // sched_getaffinity

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

namespace ddp::launcher {
namespace {

std::optional<int> read_int(const std::filesystem::path& file) {
  std::ifstream in(file);
  int v = 0;
  if (in >> v) return v;
  return std::nullopt;
}

// The NUMA node of cpuN: its "nodeK" entry in sysfs.
int numa_node_of(const std::filesystem::path& cpu_dir) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(cpu_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() > 4 && name.starts_with("node") &&
        std::all_of(name.begin() + 4, name.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      return std::stoi(name.substr(4));
    }
  }
  return 0;
}

// Where block b of k equal blocks over n items starts (block sizes differ by one at most).
size_t block_start(size_t b, size_t k, size_t n) { return b * n / k; }

}  // namespace

std::optional<CpuBind> parse_cpu_bind(const std::string& text) {
  if (text == "none") return CpuBind::kNone;
  if (text == "cores") return CpuBind::kCores;
  if (text == "numa") return CpuBind::kNuma;
  return std::nullopt;
}

const char* to_string(CpuBind mode) {
  switch (mode) {
    case CpuBind::kNone: return "none";
    case CpuBind::kCores: return "cores";
    case CpuBind::kNuma: return "numa";
  }
  return "?";
}

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> out;
  if (::sched_getaffinity(0, sizeof set, &set) != 0) return out;
  for (int i = 0; i < CPU_SETSIZE; ++i) {
    if (CPU_ISSET(i, &set)) out.push_back(i);
  }
  return out;
}

std::vector<Cpu> read_cpus(const std::vector<int>& allowed, const std::string& sysfs_cpu) {
  std::vector<Cpu> out;
  for (int id : allowed) {
    const std::filesystem::path dir = std::filesystem::path(sysfs_cpu) / fmt::format("cpu{}", id);
    Cpu c;
    c.id = id;
    c.package = read_int(dir / "topology" / "physical_package_id").value_or(0);
    // Without topology: a core of its own (ids beyond any real core id).
    c.core = read_int(dir / "topology" / "core_id").value_or(1'000'000 + id);
    c.numa = numa_node_of(dir);
    out.push_back(c);
  }
  return out;
}

namespace {

// --cpu-bind numa: the workers in blocks over the NUMA nodes, each given its node's CPUs.
BindingPlan plan_numa(const std::vector<Cpu>& cpus, size_t w) {
  BindingPlan plan;
  plan.workers.resize(w);
  std::map<int, std::vector<int>> by_node;
  for (const Cpu& c : cpus) by_node[c.numa].push_back(c.id);
  std::vector<std::vector<int>> nodes;
  std::vector<int> node_ids;
  for (auto& [id, list] : by_node) {
    std::sort(list.begin(), list.end());
    nodes.push_back(list);
    node_ids.push_back(id);
  }
  const size_t k = nodes.size();
  std::vector<int> sharing(k, 0);
  std::vector<size_t> node_of(w);
  for (size_t i = 0; i < w; ++i) {
    node_of[i] = i * k / w;  // workers in blocks over the nodes
    ++sharing[node_of[i]];
  }
  for (size_t i = 0; i < w; ++i) {
    const std::vector<int>& list = nodes[node_of[i]];
    plan.workers[i].cpus = list;
    plan.workers[i].threads = std::max(1, static_cast<int>(list.size()) / sharing[node_of[i]]);
  }
  std::vector<std::string> parts;
  for (size_t n = 0; n < k; ++n) {
    if (sharing[n] == 0) continue;
    parts.push_back(fmt::format("node {} (CPUs {}): {} worker(s)", node_ids[n],
                                format_cpu_list(nodes[n]), sharing[n]));
  }
  plan.note = fmt::format("--cpu-bind numa: {}{}", fmt::join(parts, "; "),
                          k == 1 ? " (one NUMA node: the workers are not separated)" : "");
  return plan;
}

// What --cpu-bind cores hands out in blocks: whole physical cores in (node, package, core)
// order, or their hardware threads one by one when there are fewer cores than workers (`how`
// says which).
std::vector<std::vector<int>> core_units(const std::vector<Cpu>& cpus, size_t w, std::string& how) {
  std::map<std::tuple<int, int, int>, std::vector<int>> by_core;
  for (const Cpu& c : cpus) by_core[{c.numa, c.package, c.core}].push_back(c.id);
  std::vector<std::vector<int>> cores;
  for (auto& [key, list] : by_core) {
    std::sort(list.begin(), list.end());
    cores.push_back(list);
  }
  how = "whole cores";
  if (cores.size() >= w) return cores;
  std::vector<std::vector<int>> threads;
  for (const auto& core : cores) {
    for (int id : core) threads.push_back({id});
  }
  how = "single hardware threads (fewer cores than workers)";
  return threads;
}

// --cpu-bind cores: equal blocks of core_units(); workers share them when there are fewer CPUs.
BindingPlan plan_cores(const std::vector<Cpu>& cpus, size_t w) {
  BindingPlan plan;
  plan.workers.resize(w);
  std::string how;
  const std::vector<std::vector<int>> units = core_units(cpus, w, how);
  if (units.size() < w) {  // fewer CPUs than workers: they share, round-robin
    for (size_t i = 0; i < w; ++i) {
      plan.workers[i].cpus = units[i % units.size()];
      plan.workers[i].threads = 1;
    }
    plan.note = fmt::format("--cpu-bind cores: {} workers on {} CPU(s): workers share CPUs", w,
                            units.size());
    return plan;
  }
  std::vector<std::string> parts;
  for (size_t i = 0; i < w; ++i) {
    std::vector<int>& mine = plan.workers[i].cpus;
    for (size_t u = block_start(i, w, units.size()); u < block_start(i + 1, w, units.size());
         ++u) {
      mine.insert(mine.end(), units[u].begin(), units[u].end());
    }
    std::sort(mine.begin(), mine.end());
    plan.workers[i].threads = static_cast<int>(mine.size());
    parts.push_back(fmt::format("local rank {} on CPUs {}", i, format_cpu_list(mine)));
  }
  plan.note = fmt::format("--cpu-bind cores ({}): {}", how, fmt::join(parts, ", "));
  return plan;
}

}  // namespace

BindingPlan plan_cpu_binding(CpuBind mode, const std::vector<Cpu>& cpus, int workers) {
  if (mode == CpuBind::kNone || cpus.empty() || workers < 1) return BindingPlan{};
  const size_t w = static_cast<size_t>(workers);
  return mode == CpuBind::kNuma ? plan_numa(cpus, w) : plan_cores(cpus, w);
}

std::string format_cpu_list(const std::vector<int>& cpus) {
  std::vector<int> sorted(cpus);
  std::sort(sorted.begin(), sorted.end());
  sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
  std::vector<std::string> parts;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j + 1 < sorted.size() && sorted[j + 1] == sorted[j] + 1) ++j;
    parts.push_back(j == i ? fmt::format("{}", sorted[i])
                           : fmt::format("{}-{}", sorted[i], sorted[j]));
    i = j + 1;
  }
  return fmt::format("{}", fmt::join(parts, ","));
}

}  // namespace ddp::launcher
