// launcher_test_worker: a worker that does what its arguments say, to test ddprun without
// LibTorch.
//
//   ddprun --nproc-per-node 2 launcher_test_worker ACTION [ARG...] [ACTION [ARG...]]...
//
// Actions run left to right; with none the worker exits 0.
//   echo TEXT            TEXT and a newline on stdout
//   echo-partial TEXT    TEXT on stdout, no newline (a partial last line)
//   stderr TEXT          TEXT and a newline on stderr
//   lines N TEXT         N lines "TEXT <i>" on stdout, i = 0..N-1, one write each
//   print-env VAR...     "VAR=value" (or "VAR=<unset>") per VAR on stdout; the VARs run up to
//                        the next action word
//   print-cpus           "CPUS=<the CPUs of its affinity mask>" on stdout, e.g. "CPUS=0,1"
//   sleep S              sleep S seconds (fractions allowed)
//   exit N               exit with code N
//   kill-self SIG        send SIG to itself: KILL, SIGKILL or 9
//   ignore-sigterm       ignore SIGTERM from now on
//   touch FILE           create FILE
//   wait-file FILE       wait until FILE exists (30 s at most, then exit 99)
//   touch-pidfile DIR    write this process's pid to DIR/<RANK>.pid
//   wait-reaped FILE     wait until the process whose pid FILE holds is gone, reaped by its
//                        parent (30 s at most, then exit 99): "after ddprun saw rank 0 exit"
//   spawn-sleeper DIR    fork a child (same process group, same pipes) that writes its pid to
//                        DIR/<RANK>.child.pid and sleeps 300 s; returns once the file exists
//   fail-once FILE       if FILE does not exist: create it and exit 1; else go on
//   write-error-file MSG write an error file to $TORCHELASTIC_ERROR_FILE as torchrun's workers
//                        do: {"message": {"message": MSG, "extraInfo": {"py_callstack": "...",
//                        "timestamp": "<unix seconds>"}}}
//   record-error MSG     ddp::record_error(MSG): the library's error file, which adds
//                        "timestamp_us" (what a ddp-cpp program writes when it fails)
//   record-relayed-error R MSG
//                        ddp::record_error(MSG, R): the record of an error relayed from rank R
//                        (extraInfo.relayed_from, ddp/relayed_error.h)
//   stop-self            SIGSTOP to itself: frozen until someone sends SIGCONT
//   wait-stopped FILE    wait until the process whose pid FILE holds is frozen (state T; 30 s
//                        at most, then exit 99)
//   only-rank R          the following actions, up to `end`, run only where $RANK == R
//   end                  closes only-rank
// A malformed script exits 98 with a message on stderr. Output goes straight to write(2), one
// call per line, so nothing waits in a stdio buffer when the worker is killed.
#include <fcntl.h>     // open
#include <sched.h>     // sched_getaffinity
#include <signal.h>    // kill, signal
#include <sys/stat.h>  // stat
#include <unistd.h>    // write, fork, getpid

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <nlohmann/json.hpp>

#include "ddp/error.h"          // ddp::record_error
#include "ddp/relayed_error.h"  // ddp::record_error with relayed_from

namespace {

struct Action {
  std::string name;
  std::vector<std::string> args;
};

[[noreturn]] void die(const std::string& message) {
  std::string line = "launcher_test_worker: " + message + "\n";
  (void)!::write(STDERR_FILENO, line.data(), line.size());
  std::_Exit(98);
}

void put(int fd, const std::string& text) {
  std::size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<std::size_t>(n);
  }
}

int rank() {
  const char* r = std::getenv("RANK");
  return r != nullptr ? std::atoi(r) : 0;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

// Written whole, then renamed: a test polling for the file never reads half of it.
void write_file(const std::string& path, const std::string& contents) {
  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) die(fmt::format("cannot write {}: {}", tmp, std::strerror(errno)));
  put(fd, contents);
  ::close(fd);
  ::rename(tmp.c_str(), path.c_str());
}

std::string read_text(const std::string& path) {
  std::string text;
  int fd = ::open(path.c_str(), O_RDONLY);
  if (fd < 0) return text;
  char buf[256];
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) {
    text.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fd);
  return text;
}

void sleep_s(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

int signal_number(const std::string& name) {
  std::string n = name.rfind("SIG", 0) == 0 ? name.substr(3) : name;
  static const std::map<std::string, int> kNames = {{"KILL", SIGKILL}, {"TERM", SIGTERM},
                                                    {"INT", SIGINT},   {"SEGV", SIGSEGV},
                                                    {"ABRT", SIGABRT}, {"HUP", SIGHUP}};
  if (auto it = kNames.find(n); it != kNames.end()) return it->second;
  int sig = std::atoi(n.c_str());
  if (sig <= 0) die(fmt::format("unknown signal '{}'", name));
  return sig;
}

void wait_file(const std::string& path) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (!exists(path)) {
    if (std::chrono::steady_clock::now() > deadline) std::exit(99);
    sleep_s(0.005);
  }
}

// A zombie still answers kill(pid, 0): this returns only once the parent has reaped it.
void wait_reaped(const std::string& pid_file) {
  wait_file(pid_file);
  const pid_t pid = std::atoi(read_text(pid_file).c_str());
  if (pid <= 0) die(fmt::format("no pid in {}", pid_file));
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (::kill(pid, 0) == 0 || errno != ESRCH) {
    if (std::chrono::steady_clock::now() > deadline) std::exit(99);
    sleep_s(0.005);
  }
}

// Returns once the process is in state T (stopped), as /proc/<pid>/stat says.
void wait_stopped(const std::string& pid_file) {
  wait_file(pid_file);
  const std::string pid = read_text(pid_file);
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (true) {
    const std::string stat = read_text("/proc/" + pid + "/stat");
    const auto paren = stat.rfind(')');
    if (paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] == 'T') return;
    if (std::chrono::steady_clock::now() > deadline) std::exit(99);
    sleep_s(0.005);
  }
}

// Returns once the child's pid file exists.
void spawn_sleeper(const std::string& dir) {
  const std::string pid_file = fmt::format("{}/{}.child.pid", dir, rank());
  pid_t pid = ::fork();
  if (pid < 0) die("fork failed");
  if (pid == 0) {
    write_file(pid_file, std::to_string(::getpid()));
    sleep_s(300);
    std::_Exit(0);
  }
  wait_file(pid_file);
}

using Args = std::vector<std::string>;

void write_error_file(const std::string& message) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (path == nullptr) die("TORCHELASTIC_ERROR_FILE is not set");
  const auto now = std::chrono::system_clock::now().time_since_epoch();
  const nlohmann::json doc = {
      {"message",
       {{"message", message},
        {"extraInfo",
         {{"py_callstack", "Traceback (most recent call last):\n  File \"train.py\"\n"},
          {"timestamp",
           std::to_string(std::chrono::duration_cast<std::chrono::seconds>(now).count())}}}}}};
  write_file(path, doc.dump());
}

struct ActionDef {
  int arity;                      // -1: a list running up to the next action word
  void (*run)(const Args& args);  // nullptr: only-rank / end, handled by main
};

// Every action of the header comment.
const std::map<std::string, ActionDef> kActions = {
    {"echo", {1, [](const Args& a) { put(STDOUT_FILENO, a[0] + "\n"); }}},
    {"echo-partial", {1, [](const Args& a) { put(STDOUT_FILENO, a[0]); }}},
    {"stderr", {1, [](const Args& a) { put(STDERR_FILENO, a[0] + "\n"); }}},
    {"lines",
     {2,
      [](const Args& a) {
        for (int i = 0; i < std::atoi(a[0].c_str()); ++i) {
          put(STDOUT_FILENO, fmt::format("{} {}\n", a[1], i));
        }
      }}},
    {"print-env",
     {-1,
      [](const Args& a) {
        for (const std::string& var : a) {
          const char* v = std::getenv(var.c_str());
          put(STDOUT_FILENO, fmt::format("{}={}\n", var, v != nullptr ? v : "<unset>"));
        }
      }}},
    {"print-cpus",
     {0,
      [](const Args&) {
        cpu_set_t set;
        CPU_ZERO(&set);
        std::vector<int> ids;
        if (::sched_getaffinity(0, sizeof set, &set) == 0) {
          for (int i = 0; i < CPU_SETSIZE; ++i) {
            if (CPU_ISSET(i, &set)) ids.push_back(i);
          }
        }
        put(STDOUT_FILENO, fmt::format("CPUS={}\n", fmt::join(ids, ",")));
      }}},
    {"sleep", {1, [](const Args& a) { sleep_s(std::atof(a[0].c_str())); }}},
    {"exit", {1, [](const Args& a) { std::exit(std::atoi(a[0].c_str())); }}},
    {"kill-self", {1, [](const Args& a) { ::kill(::getpid(), signal_number(a[0])); }}},
    {"ignore-sigterm", {0, [](const Args&) { ::signal(SIGTERM, SIG_IGN); }}},
    {"touch", {1, [](const Args& a) { write_file(a[0], ""); }}},
    {"wait-file", {1, [](const Args& a) { wait_file(a[0]); }}},
    {"touch-pidfile",
     {1,
      [](const Args& a) {
        write_file(fmt::format("{}/{}.pid", a[0], rank()), std::to_string(::getpid()));
      }}},
    {"wait-reaped", {1, [](const Args& a) { wait_reaped(a[0]); }}},
    {"spawn-sleeper", {1, [](const Args& a) { spawn_sleeper(a[0]); }}},
    {"fail-once",
     {1,
      [](const Args& a) {
        if (exists(a[0])) return;
        write_file(a[0], "");
        std::exit(1);
      }}},
    {"write-error-file", {1, [](const Args& a) { write_error_file(a[0]); }}},
    {"record-error", {1, [](const Args& a) { ddp::record_error(a[0]); }}},
    {"record-relayed-error",
     {2, [](const Args& a) { ddp::record_error(a[1], std::atoi(a[0].c_str())); }}},
    {"stop-self", {0, [](const Args&) { ::kill(::getpid(), SIGSTOP); }}},
    {"wait-stopped", {1, [](const Args& a) { wait_stopped(a[0]); }}},
    {"only-rank", {1, nullptr}},
    {"end", {0, nullptr}},
};

std::vector<Action> parse(int argc, char** argv) {
  std::vector<Action> script;
  for (int i = 1; i < argc;) {
    auto it = kActions.find(argv[i]);
    if (it == kActions.end()) die(fmt::format("unknown action '{}'", argv[i]));
    Action a{argv[i++], {}};
    const int arity = it->second.arity;
    if (arity < 0) {
      while (i < argc && kActions.count(argv[i]) == 0) a.args.emplace_back(argv[i++]);
    }
    for (int k = 0; k < arity; ++k) {
      if (i >= argc) die(fmt::format("'{}' needs {} argument(s)", a.name, arity));
      a.args.emplace_back(argv[i++]);
    }
    script.push_back(std::move(a));
  }
  return script;
}

}  // namespace

int main(int argc, char** argv) {
  const int my_rank = rank();
  bool skipping = false;  // inside an only-rank block for another rank
  for (const Action& a : parse(argc, argv)) {
    if (a.name == "only-rank") {
      skipping = std::atoi(a.args[0].c_str()) != my_rank;
    } else if (a.name == "end") {
      skipping = false;
    } else if (!skipping) {
      kActions.at(a.name).run(a.args);
    }
  }
  return 0;
}
