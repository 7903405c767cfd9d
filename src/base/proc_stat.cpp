// /proc/<pid>/stat (proc_stat.h).
#include "base/proc_stat.h"

#include <unistd.h>  // getpid

#include <charconv>  // from_chars
#include <fstream>
#include <string>

#include <fmt/format.h>

namespace ddp {

std::optional<ProcStat> parse_proc_stat(std::string_view line) {
  // "<pid> (<comm>) <state> <ppid> ... <starttime> ...": fields 1 and 2, then from field 3 on.
  const size_t close = line.rfind(')');
  if (close == std::string_view::npos) return std::nullopt;
  std::string_view rest = line.substr(close + 1);
  ProcStat out;
  for (int field = 3; field <= 22; ++field) {
    const size_t begin = rest.find_first_not_of(' ');
    if (begin == std::string_view::npos) return std::nullopt;
    rest.remove_prefix(begin);
    const std::string_view value = rest.substr(0, rest.find(' '));
    rest.remove_prefix(value.size());
    if (field == 3) {
      if (value.size() != 1) return std::nullopt;
      out.state = value[0];
    }
    if (field == 22) {
      const auto [end, ec] =
          std::from_chars(value.data(), value.data() + value.size(), out.start_time);
      if (ec != std::errc() || end != value.data() + value.size()) return std::nullopt;
    }
  }
  return out;
}

std::optional<ProcStat> read_proc_stat(int pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream in(fmt::format("/proc/{}/stat", pid));
  std::string line;
  if (!in || !std::getline(in, line)) return std::nullopt;
  return parse_proc_stat(line);
}

std::optional<ProcStat> live_process(int pid, uint64_t start_time) {
  const std::optional<ProcStat> stat = read_proc_stat(pid);
  if (!stat || stat->dead()) return std::nullopt;
  if (start_time != 0 && stat->start_time != start_time) return std::nullopt;  // pid reused
  return stat;
}

uint64_t own_start_time() {
  const std::optional<ProcStat> stat = read_proc_stat(static_cast<int>(getpid()));
  return stat ? stat->start_time : 0;
}

}  // namespace ddp
