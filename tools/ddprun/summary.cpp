// The failure summary (see summary.h).
#include "summary.h"

#include <sys/wait.h>  // W* macros

#include <algorithm>
#include <cctype>    // std::isspace
#include <charconv>  // std::from_chars
#include <csignal>
#include <ctime>  // localtime_r, strftime
#include <limits>
#include <utility>  // std::pair

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace ddp::launcher {

std::string signal_name(int signal) {
  switch (signal) {
    case SIGHUP: return "SIGHUP";
    case SIGINT: return "SIGINT";
    case SIGQUIT: return "SIGQUIT";
    case SIGILL: return "SIGILL";
    case SIGTRAP: return "SIGTRAP";
    case SIGABRT: return "SIGABRT";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGKILL: return "SIGKILL";
    case SIGUSR1: return "SIGUSR1";
    case SIGSEGV: return "SIGSEGV";
    case SIGUSR2: return "SIGUSR2";
    case SIGPIPE: return "SIGPIPE";
    case SIGALRM: return "SIGALRM";
    case SIGTERM: return "SIGTERM";
    case SIGCHLD: return "SIGCHLD";
    case SIGCONT: return "SIGCONT";
    case SIGSTOP: return "SIGSTOP";
    case SIGXCPU: return "SIGXCPU";
    case SIGXFSZ: return "SIGXFSZ";
    case SIGSYS: return "SIGSYS";
    default: return fmt::format("signal {}", signal);
  }
}

std::string describe_wait_status(int wait_status) {
  if (WIFEXITED(wait_status)) return fmt::format("exit code {}", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) {
    int sig = WTERMSIG(wait_status);
    return fmt::format("{} (signal {}){}", signal_name(sig), sig,
                       WCOREDUMP(wait_status) ? ", core dumped" : "");
  }
  return fmt::format("wait status {:#x}", wait_status);
}

std::string format_seconds(double s) { return fmt::format("{}s", s); }

std::string format_rank_list(const std::vector<int>& sorted_ranks) {
  std::string out;
  for (std::size_t i = 0; i < sorted_ranks.size();) {
    std::size_t j = i;
    while (j + 1 < sorted_ranks.size() && sorted_ranks[j + 1] == sorted_ranks[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += j > i ? fmt::format("{}-{}", sorted_ranks[i], sorted_ranks[j])
                 : std::to_string(sorted_ranks[i]);
    i = j + 1;
  }
  return out;
}

std::string format_local_time(std::int64_t unix_us) {
  const std::time_t seconds = static_cast<std::time_t>(unix_us / 1'000'000);
  std::tm tm{};
  localtime_r(&seconds, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  return buf;
}

// ---------------------------------------------------------------------------------------------
// The error file

namespace {

using Json = nlohmann::json;

// `text` without trailing whitespace, cut to `max_bytes` (marked " [...]").
std::string trim_and_cut(std::string text, std::size_t max_bytes) {
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  if (text.size() > max_bytes) text = text.substr(0, max_bytes) + " [...]";
  return text;
}

// A non-negative integer field: a JSON integer, or a string of decimal digits ("1717171717"),
// which is how torchrun writes its timestamps.
std::optional<std::int64_t> non_negative_integer(const Json& value) {
  if (value.is_number_unsigned()) {
    auto u = value.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) return {};
    return static_cast<std::int64_t>(u);
  }
  if (value.is_number_integer()) {
    auto i = value.get<std::int64_t>();
    return i >= 0 ? std::optional(i) : std::nullopt;
  }
  if (value.is_string()) {
    const auto& s = value.get_ref<const std::string&>();
    std::int64_t i = 0;
    auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), i);
    if (ec == std::errc() && end == s.data() + s.size() && !s.empty() && i >= 0) return i;
  }
  return {};
}

// `object[key]` as an integer, when `object` is an object that has it.
std::optional<std::int64_t> integer_field(const Json& object, const char* key) {
  if (!object.is_object()) return {};
  auto it = object.find(key);
  return it == object.end() ? std::nullopt : non_negative_integer(*it);
}

std::optional<std::int64_t> seconds_to_us(std::optional<std::int64_t> seconds) {
  constexpr std::int64_t kUsPerS = 1'000'000;
  if (!seconds || *seconds > std::numeric_limits<std::int64_t>::max() / kUsPerS) return {};
  return *seconds * kUsPerS;
}

}  // namespace

ErrorFileReport parse_error_file(const std::string& contents, std::size_t max_bytes) {
  ErrorFileReport report;
  report.message = trim_and_cut(contents, max_bytes);  // unless it has the expected shape
  const Json doc = Json::parse(contents, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (!doc.is_object()) return report;  // malformed (discarded), or not an object
  auto outer = doc.find("message");
  if (outer == doc.end()) return report;

  if (outer->is_string()) {  // {"message": "...", "timestamp": "<s>"}
    report.message = trim_and_cut(outer->get<std::string>(), max_bytes);
    report.timestamp_us = seconds_to_us(integer_field(doc, "timestamp"));
  } else if (outer->is_object()) {  // {"message": {"message": "...", "extraInfo": {...}}}
    auto inner = outer->find("message");
    if (inner == outer->end() || !inner->is_string()) return report;
    report.message = trim_and_cut(inner->get<std::string>(), max_bytes);
    const auto extra = outer->find("extraInfo");
    if (extra != outer->end()) {
      report.timestamp_us = integer_field(*extra, "timestamp_us");
      if (!report.timestamp_us) {
        report.timestamp_us = seconds_to_us(integer_field(*extra, "timestamp"));
      }
      const auto origin = integer_field(*extra, "relayed_from");
      if (origin && *origin <= std::numeric_limits<int>::max()) {
        report.relayed_from = static_cast<int>(*origin);
      }
    }
  }
  return report;
}

// ---------------------------------------------------------------------------------------------
// The root cause (Note [Root cause] in summary.h)

bool failed(const WorkerEnd& worker) {
  if (!worker.reaped) return false;
  const int st = worker.wait_status;
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return false;
  const bool stopped_by_ddprun =
      worker.signal_sent != 0 && WIFSIGNALED(st) && WTERMSIG(st) == worker.signal_sent;
  return !stopped_by_ddprun || worker.error_file.has_value();
}

std::optional<RootCause> pick_root_cause(const std::vector<WorkerEnd>& workers) {
  std::optional<RootCause> first_reaped;                     // rule 3
  std::optional<RootCause> earliest;                         // rule 2
  std::optional<std::pair<std::int64_t, int>> earliest_key;  // (timestamp, reap order)
  auto index_of_rank = [&](int rank) -> std::optional<std::size_t> {
    for (std::size_t j = 0; j < workers.size(); ++j) {
      if (workers[j].rank == rank) return j;
    }
    return std::nullopt;
  };
  for (std::size_t i = 0; i < workers.size(); ++i) {
    const WorkerEnd& w = workers[i];
    if (!failed(w)) continue;
    if (!first_reaped || w.reap_order < workers[first_reaped->index].reap_order) {
      first_reaped = RootCause{i, false};
    }
    if (!w.error_file || !w.error_file->timestamp_us) continue;
    RootCause candidate{i, true, std::nullopt, *w.error_file->timestamp_us};
    if (w.error_file->relayed_from && *w.error_file->relayed_from != w.rank) {
      candidate.relayed_by = i;
      if (auto origin = index_of_rank(*w.error_file->relayed_from)) candidate.index = *origin;
    }
    // Ties: the one reaped first; an origin found through a relay gets its own reap order, so
    // its record and its peers' relays of the same moment agree on it.
    std::pair key{candidate.time_us, workers[candidate.index].reap_order};
    if (!earliest_key || key < *earliest_key) {
      earliest_key = key;
      earliest = candidate;
    }
  }
  return earliest ? earliest : first_reaped;
}

// ---------------------------------------------------------------------------------------------
// The report

namespace {

std::string describe_end(const WorkerEnd& worker, const std::string& kill_reason) {
  if (!worker.reaped) return "could not be stopped";
  const int st = worker.wait_status;
  if (worker.signal_sent == 0) {
    return failed(worker) ? "also failed (" + describe_wait_status(st) + ")"
                          : "finished (exit code 0)";
  }
  if (WIFSIGNALED(st) && WTERMSIG(st) == worker.signal_sent) {
    if (worker.signal_sent == SIGKILL) {
      return fmt::format("killed by ddprun (SIGKILL {})", kill_reason);
    }
    return fmt::format("stopped by ddprun ({})", signal_name(worker.signal_sent));
  }
  return fmt::format("ended with {} after ddprun sent {}", describe_wait_status(st),
                     signal_name(worker.signal_sent));
}

}  // namespace

std::string describe_fate(const WorkerEnd& worker, const std::string& kill_reason) {
  std::string end = describe_end(worker, kill_reason);
  if (!worker.was_stopped) return end;
  return "was stopped (process state T: SIGSTOP or a debugger); ddprun resumed it: " + end;
}

namespace {

// Continuation lines of `text` indented by `indent`.
std::string indent_lines(const std::string& text, const std::string& indent) {
  std::string out;
  std::size_t start = 0;
  while (start <= text.size()) {
    auto nl = text.find('\n', start);
    std::string line = text.substr(start, nl == std::string::npos ? std::string::npos : nl - start);
    if (start > 0) out += "\n" + indent;
    out += line;
    if (nl == std::string::npos) break;
    start = nl + 1;
  }
  return out;
}

// The first line of a message, for a one-line mention.
std::string first_line(const std::string& text) {
  constexpr std::size_t kMaxBytes = 200;
  std::string line = text.substr(0, text.find('\n'));
  if (line.size() > kMaxBytes) line = line.substr(0, kMaxBytes) + " [...]";
  return line;
}

// The root cause's section. Its time is that of its error file when the error file chose it,
// else when ddprun reaped it.
std::string format_root_cause(const SummaryContext& context, const std::vector<WorkerEnd>& workers,
                              const RootCause& root) {
  const WorkerEnd& w = workers.at(root.index);
  const std::string error = w.error_file ? w.error_file->message : "";
  const std::int64_t time_us = root.by_error_file ? root.time_us : w.reaped_at_us;
  std::string how = root.by_error_file ? "earliest error file" : "first observed failure";
  if (root.relayed_by && *root.relayed_by != root.index) {
    how += fmt::format(", relayed by rank {}", workers.at(*root.relayed_by).rank);
  } else if (root.relayed_by) {  // it reports a rank of another node
    how += fmt::format(", relayed from rank {} on another node: its own summary names the cause",
                       *w.error_file->relayed_from);
  }
  std::string out = fmt::format("Root cause ({}):\n", how);
  out += fmt::format("  time      : {}\n", format_local_time(time_us));
  out += fmt::format("  rank      : {} (local_rank {}) on host {}\n", w.rank, w.local_rank,
                     context.host);
  out += fmt::format("  pid       : {}\n", w.pid);
  out +=
      fmt::format("  exit      : {}{}\n",
                  w.reaped ? describe_wait_status(w.wait_status) : "could not be stopped",
                  w.was_stopped ? "; it was stopped (process state T: SIGSTOP or a debugger)" : "");
  out += fmt::format("  error file: {}\n",
                     error.empty() ? "(none)" : indent_lines(error, std::string(14, ' ')));
  if (w.stderr_tail.empty()) {
    out += fmt::format("  last stderr lines of rank {}: (none)\n", w.rank);
  } else {
    out += fmt::format("  last stderr lines of rank {}:\n", w.rank);
    for (const std::string& line : w.stderr_tail) out += "    " + line + "\n";
  }
  return out;
}

// "Other workers: ranks 0,2-3 stopped by ddprun (SIGTERM); rank 1 also failed (exit code 1)",
// then the error file of each other failed worker that wrote one.
std::string format_others(const SummaryContext& context, const std::vector<WorkerEnd>& workers,
                          std::size_t root) {
  std::vector<std::pair<std::string, std::vector<int>>> by_fate;  // in order of first rank
  std::string error_lines;
  for (std::size_t i = 0; i < workers.size(); ++i) {
    if (i == root) continue;
    const WorkerEnd& o = workers[i];
    std::string fate = describe_fate(o, context.kill_reason);
    auto it = std::ranges::find_if(by_fate, [&](const auto& g) { return g.first == fate; });
    if (it == by_fate.end()) it = by_fate.insert(by_fate.end(), {fate, {}});
    it->second.push_back(o.rank);
    if (failed(o) && o.error_file && !o.error_file->message.empty()) {
      const auto origin = o.error_file->relayed_from;
      error_lines += fmt::format("  error file of rank {}{}: {}\n", o.rank,
                                 origin ? fmt::format(" (relayed from rank {})", *origin) : "",
                                 first_line(o.error_file->message));
    }
  }
  if (by_fate.empty()) return "";
  std::string out = "Other workers: ";
  for (std::size_t i = 0; i < by_fate.size(); ++i) {
    const auto& [fate, ranks] = by_fate[i];
    out += fmt::format("{}{} {} {}", i > 0 ? "; " : "", ranks.size() == 1 ? "rank" : "ranks",
                       format_rank_list(ranks), fate);
  }
  return out + "\n" + error_lines;
}

// Workers that exited 0 before the first failure ddprun reaped, while others still ran: their
// peers' collectives then fail ("Connection closed by peer", "destroyed its process group"),
// and the error files name the symptom, not that a rank left early.
std::string format_early_exits(const std::vector<WorkerEnd>& workers) {
  std::optional<int> first_failure;
  for (const WorkerEnd& w : workers) {
    if (failed(w) && (!first_failure || w.reap_order < *first_failure)) {
      first_failure = w.reap_order;
    }
  }
  std::vector<int> early;
  for (const WorkerEnd& w : workers) {
    const bool clean = w.reaped && WIFEXITED(w.wait_status) && WEXITSTATUS(w.wait_status) == 0;
    if (clean && w.signal_sent == 0 && first_failure && w.reap_order < *first_failure) {
      early.push_back(w.rank);
    }
  }
  if (early.empty()) return "";
  std::ranges::sort(early);
  return fmt::format(
      "Left early: {} {} exited with code 0 before any worker failed, while the others still "
      "ran; peers still in a collective fail when a rank leaves it, so check why {} stopped "
      "early (fewer batches, a return before the loop ended)\n",
      early.size() == 1 ? "rank" : "ranks", format_rank_list(early),
      early.size() == 1 ? "it" : "they");
}

}  // namespace

std::string format_failure_summary(const SummaryContext& context,
                                   const std::vector<WorkerEnd>& workers,
                                   std::optional<RootCause> root_cause) {
  std::string out = fmt::format("ddprun: worker group failed (attempt {} of {})\n", context.attempt,
                                context.attempts);
  if (root_cause) {
    out += format_root_cause(context, workers, *root_cause);
    out += format_others(context, workers, root_cause->index);
    out += format_early_exits(workers);
  }
  if (!context.earlier_attempts.empty()) {
    out += "Earlier attempts:\n";
    for (const std::string& line : context.earlier_attempts) out += "  " + line + "\n";
  }
  return out;
}

}  // namespace ddp::launcher
