// The run folder's lease (Note [Run folder lease] in ddp/run_lease.h).
#include "ddp/run_lease.h"

#include <fcntl.h>     // open
#include <sys/file.h>  // flock
#include <unistd.h>    // write, close, getpid, unlink

#include <atomic>
#include <cerrno>
#include <cstdio>  // std::rename
#include <cstring>
#include <ctime>
#include <optional>
#include <thread>

#include <fmt/chrono.h>  // the history's UTC times
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "base/net.h"                 // host_name
#include "base/proc_stat.h"           // live_process, own_start_time
#include "base/random_id.h"           // random_hex: the holder's nonce
#include "base/thread_annotations.h"  // Mutex, CondVar
#include "checkpoint/file_io.h"       // Fd, errno_text
#include "ddp/env.h"                  // current_environment, parse_dist_env, parse_seconds

namespace ddp {
namespace {

namespace fs = std::filesystem;
using Steady = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kLeaseName = "run.lease";
constexpr const char* kLockName = "run.lease.lock";
constexpr const char* kLogName = "run.lease.log";
// How often a watcher looks at the lease.
constexpr milliseconds kWatchStep{100};

int64_t unix_ms_now() {
  return std::chrono::duration_cast<milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// What run.lease holds.
struct Record {
  RunIdentity who;
  std::string host;
  int pid = 0;
  uint64_t pid_start = 0;
  std::string nonce;
  int64_t renewals = 0;
  int64_t renewed_unix_ms = 0;
  int64_t ttl_ms = 0;

  std::string dump() const {
    return nlohmann::json{{"run_id", who.run_id},
                          {"lineage", who.lineage},
                          {"round", who.round},
                          {"host", host},
                          {"pid", pid},
                          {"pid_start", pid_start},
                          {"nonce", nonce},
                          {"renewals", renewals},
                          {"renewed_unix_ms", renewed_unix_ms},
                          {"ttl_ms", ttl_ms}}
        .dump();
  }
  static std::optional<Record> parse(const std::string& text) {
    try {
      const nlohmann::json j = nlohmann::json::parse(text);
      Record r;
      r.who = {.run_id = j.at("run_id"), .lineage = j.at("lineage"), .round = j.at("round")};
      r.host = j.at("host");
      r.pid = j.at("pid");
      r.pid_start = j.at("pid_start");
      r.nonce = j.at("nonce");
      r.renewals = j.at("renewals");
      r.renewed_unix_ms = j.at("renewed_unix_ms");
      r.ttl_ms = j.at("ttl_ms");
      return r;
    } catch (const nlohmann::json::exception&) {
      return std::nullopt;
    }
  }
  // "job 'x' (lineage 3fa2, round 2), rank 0 on host h (pid 123), renewed 1.2 s ago"
  std::string describe(int64_t now_ms) const {
    return fmt::format("{}, rank 0 on host {} (pid {}), renewed {:.1f} s ago", who.describe(), host,
                       pid, static_cast<double>(now_ms - renewed_unix_ms) / 1000.0);
  }
};

// The lease file: nullopt when there is none; `garbled` is set when one exists but does not
// parse (a write cut short by a crash: nobody holds it).
std::optional<Record> read_record(const fs::path& dir, bool* garbled = nullptr) {
  if (garbled) *garbled = false;
  ckpt::Fd fd(::open((dir / kLeaseName).c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return std::nullopt;
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<size_t>(n));
  }
  std::optional<Record> r = Record::parse(text);
  if (!r && garbled) *garbled = true;
  return r;
}

void write_file(const fs::path& file, const std::string& text, int flags) {
  ckpt::Fd fd(::open(file.c_str(), flags | O_WRONLY | O_CLOEXEC, 0644));
  if (fd.get() < 0) {
    throw Error(fmt::format("{}: cannot write the run folder's lease: {}", file.string(),
                            ckpt::errno_text(errno)));
  }
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd.get(), text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      throw Error(fmt::format("{}: cannot write the run folder's lease: {}", file.string(),
                              ckpt::errno_text(errno)));
    }
    done += static_cast<size_t>(n);
  }
}

// Replaces run.lease in one step (rename).
void write_record(const fs::path& dir, const Record& r) {
  const fs::path temp = dir / ckpt::temp_name_for(kLeaseName);
  try {
    write_file(temp, r.dump() + "\n", O_CREAT | O_EXCL);
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  if (std::rename(temp.c_str(), (dir / kLeaseName).c_str()) != 0) {
    const int err = errno;
    ::unlink(temp.c_str());
    throw Error(fmt::format("{}: cannot replace the run folder's lease: {}",
                            (dir / kLeaseName).string(), ckpt::errno_text(err)));
  }
}

// One line of run.lease.log: the folder's history of holders. Best effort: a history that
// cannot be written does not stop training.
void log_line(const fs::path& dir, const std::string& what) {
  try {
    const int64_t ms = unix_ms_now();
    const std::time_t secs = static_cast<std::time_t>(ms / 1000);
    write_file(dir / kLogName,
               fmt::format("{:%Y-%m-%dT%H:%M:%S}.{:03d}Z {}\n", fmt::gmtime(secs),
                           static_cast<int>(ms % 1000), what),
               O_CREAT | O_APPEND);
  } catch (const Error&) {
  }
}

// flock(2) on run.lease.lock, bounded.
class FileLock {
 public:
  FileLock(const fs::path& dir, milliseconds timeout) {
    const fs::path file = dir / kLockName;
    fd_ = ckpt::Fd(::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
    if (fd_.get() < 0) {
      throw Error(fmt::format("{}: cannot open the run folder's lock: {}", file.string(),
                              ckpt::errno_text(errno)));
    }
    const auto deadline = Steady::now() + timeout;
    while (::flock(fd_.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK && errno != EINTR) {
        throw Error(fmt::format("{}: cannot lock the run folder: {}", file.string(),
                                ckpt::errno_text(errno)));
      }
      if (Steady::now() >= deadline) {
        throw Error(fmt::format(
            "{}: another process held the run folder's lock for {} ms (a holder stopped while "
            "claiming?); if no job uses this folder, remove the file and start again",
            file.string(), timeout.count()));
      }
      std::this_thread::sleep_for(milliseconds(10));
    }
  }
  ~FileLock() {
    if (fd_.get() >= 0) ::flock(fd_.get(), LOCK_UN);
  }

 private:
  ckpt::Fd fd_;
};

// Whether the holder's process is known to be gone: only a process of this host can be checked.
bool holder_gone(const Record& r, const std::string& host) {
  if (r.host != host || r.pid == static_cast<int>(::getpid())) return false;
  return !live_process(r.pid, r.pid_start).has_value();
}

enum class Verdict { kTake, kRefuse, kWatch };
struct Decision {
  Verdict verdict;
  std::string why;  // for the history (take) or the error (refuse)
};

// Note [Run folder lease]: what a newcomer `me` does about the holder `r`.
Decision decide(const Record& r, const RunIdentity& me, const std::string& host, int64_t now_ms) {
  const std::string holder = r.describe(now_ms);
  if (holder_gone(r, host)) return {Verdict::kTake, fmt::format("its holder is gone ({})", holder)};
  const bool fresh = now_ms - r.renewed_unix_ms < r.ttl_ms;
  if (r.who.run_id != me.run_id) {
    if (fresh) {
      return {Verdict::kRefuse,
              fmt::format("the folder is in use by another job: {}. Give this job its own "
                          "--output-dir, or stop the other job first",
                          holder)};
    }
    return {Verdict::kWatch, holder};
  }
  if (r.who.lineage == me.lineage && !me.lineage.empty()) {
    if (r.who.round < me.round) {
      return {Verdict::kTake, fmt::format("a newer round of the job takes over from {}", holder)};
    }
    if (r.who.round > me.round) {
      return {Verdict::kRefuse,
              fmt::format("round {} of this job is no longer current: {} holds the folder. "
                          "This group is stale and must not write",
                          me.round, holder)};
    }
  }
  return {Verdict::kWatch, holder};
}

// A newcomer watching a holder that may be gone: a takeover never trusts clocks, only a whole
// ttl without a renewal seen from here (the longer of the two ttls: a holder renews every
// quarter of its own).
class Watch {
 public:
  explicit Watch(milliseconds ttl) : ttl_(ttl) {}
  // Why `held` may be taken now; nullopt: look again. Throws FencedError when it renewed.
  std::optional<std::string> look(const Record& held, const RunIdentity& me, const fs::path& dir,
                                  int64_t now_ms) {
    const bool same = seen_ && seen_->nonce == held.nonce && seen_->renewals == held.renewals;
    if (seen_ && !same && seen_->nonce == held.nonce) {
      throw FencedError(fmt::format(
          "run folder {}: {} cannot take it: its holder is alive (it renewed while this one "
          "watched): {}. Give this job its own --output-dir, or stop the other first",
          dir.string(), me.describe(), held.describe(now_ms)));
    }
    if (!same) {  // a holder seen for the first time (a new one took it meanwhile: watch it)
      seen_ = held;
      since_ = Steady::now();
      return std::nullopt;
    }
    const milliseconds window = std::max(ttl_, milliseconds(held.ttl_ms));
    if (Steady::now() - since_ < window) return std::nullopt;
    return fmt::format("its holder did not renew for {:.1f} s ({})",
                       std::chrono::duration<double>(window).count(), held.describe(now_ms));
  }

 private:
  milliseconds ttl_;
  std::optional<Record> seen_;  // the holder watched, as first seen
  Steady::time_point since_{};  // since when it has not changed
};

// One look at `dir`'s lease under its lock: why `mine` takes the folder now; nullopt to look
// again later. Throws FencedError when refused.
std::optional<std::string> look(const fs::path& dir, const Record& mine, Watch& watch) {
  bool garbled = false;
  const std::optional<Record> held = read_record(dir, &garbled);
  if (!held) return garbled ? "an unreadable lease replaced" : "a free folder";
  const int64_t now = unix_ms_now();
  const Decision d = decide(*held, mine.who, mine.host, now);
  switch (d.verdict) {
    case Verdict::kTake: return d.why;
    case Verdict::kRefuse:
      throw FencedError(fmt::format("run folder {}: {} cannot take it: {}", dir.string(),
                                    mine.who.describe(), d.why));
    case Verdict::kWatch: break;
  }
  return watch.look(*held, mine.who, dir, now);
}

}  // namespace

// --- RunIdentity ---------------------------------------------------------------------------

RunIdentity RunIdentity::from_environment() {
  const DistEnv env = parse_dist_env(current_environment());
  return {.run_id = env.run_id, .lineage = env.run_lineage, .round = env.restart_count};
}

std::string RunIdentity::describe() const {
  return fmt::format("job '{}' (lineage {}, round {})", run_id, lineage.empty() ? "-" : lineage,
                     round);
}

RunLeaseOptions default_run_lease_options() {
  RunLeaseOptions o;
  if (std::optional<std::string> v = env_knob("DDP_RUN_LEASE_TTL")) {
    o.ttl = parse_seconds("DDP_RUN_LEASE_TTL", *v);
  }
  return o;
}

// --- renewing ------------------------------------------------------------------------------

// A thread that renews the lease every ttl/4 while it is this holder's.
struct RunLease::Renewer {
  explicit Renewer(RunLease& lease) : thread([this, &lease] { run(lease); }) {}
  ~Renewer() {
    {
      MutexLock l(&mu);
      stopping = true;
    }
    cv.signal_all();
    thread.join();
  }
  void run(RunLease& lease) {
    const milliseconds every = std::max(lease.options_.ttl / 4, milliseconds(10));
    for (;;) {
      {
        MutexLock l(&mu);
        const auto until = Steady::now() + every;
        while (!stopping && Steady::now() < until) cv.wait_until(until);
        if (stopping) return;
      }
      try {
        FileLock lock(lease.dir_, lease.options_.lock_timeout);
        std::optional<Record> r = read_record(lease.dir_);
        if (!r || r->nonce != lease.nonce_) return;  // taken: check() says by whom
        r->renewals += 1;
        r->renewed_unix_ms = unix_ms_now();
        write_record(lease.dir_, *r);
      } catch (const Error&) {
        // A renewal that fails is retried at the next tick; the lease expires only if none
        // succeeds for a whole ttl, and then check() finds the new holder.
      }
    }
  }

  Mutex mu;
  CondVar cv{&mu};
  bool stopping GUARDED_BY(mu) = false;
  std::thread thread;  // last: started once the rest is built
};

// --- RunLease ------------------------------------------------------------------------------

fs::path RunLease::lease_path(const fs::path& dir) { return dir / kLeaseName; }
fs::path RunLease::log_path(const fs::path& dir) { return dir / kLogName; }

RunLease::RunLease(fs::path dir, RunIdentity me, RunLeaseOptions options, std::string nonce)
    : dir_(std::move(dir)), me_(std::move(me)), options_(options), nonce_(std::move(nonce)) {}

std::shared_ptr<RunLease> RunLease::acquire(const fs::path& dir, const RunIdentity& me,
                                            RunLeaseOptions options) {
  if (options.ttl <= milliseconds(0)) {
    throw ConfigError(
        fmt::format("run folder lease: ttl = {} ms; it must be positive", options.ttl.count()));
  }
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw Error(fmt::format("{}: cannot create the run folder: {}", dir.string(), ec.message()));
  }
  const std::string host = net::host_name();
  Record mine{.who = me,
              .host = host,
              .pid = static_cast<int>(::getpid()),
              .pid_start = own_start_time(),
              .nonce = random_hex(8),
              .ttl_ms = options.ttl.count()};
  Watch watch(options.ttl);
  for (;;) {
    {
      FileLock lock(dir, options.lock_timeout);
      if (const std::optional<std::string> took = look(dir, mine, watch)) {
        mine.renewed_unix_ms = unix_ms_now();
        write_record(dir, mine);
        log_line(dir,
                 fmt::format("take {} on {} (pid {}): {}", me.describe(), host, mine.pid, *took));
        std::shared_ptr<RunLease> lease(new RunLease(dir, me, options, mine.nonce));
        lease->renewer_ = std::make_unique<Renewer>(*lease);
        return lease;
      }
    }
    std::this_thread::sleep_for(std::min(kWatchStep, options.ttl / 4));
  }
}

RunLease::~RunLease() {
  try {
    release();
  } catch (...) {
    // Never from a destructor: an unreleased lease expires after its ttl.
  }
}

bool RunLease::held() const {
  const std::optional<Record> r = read_record(dir_);
  return r && r->nonce == nonce_;
}

void RunLease::check(const std::string& what) const {
  const std::optional<Record> r = read_record(dir_);
  if (r && r->nonce == nonce_) return;
  const std::string holder =
      r ? r->describe(unix_ms_now())
        : std::string(
              "nobody (the lease file is gone: removed by hand, or released by a newer "
              "holder)");
  throw FencedError(fmt::format(
      "{} refused: {} no longer holds the run folder {}; it is held by {}. This group is "
      "fenced out and writes nothing more; the run goes on in the group that holds the folder",
      what, me_.describe(), dir_.string(), holder));
}

void RunLease::release() {
  if (!renewer_) return;
  renewer_.reset();  // stops the thread first: no renewal after the release
  FileLock lock(dir_, options_.lock_timeout);
  const std::optional<Record> r = read_record(dir_);
  if (!r || r->nonce != nonce_) return;
  ::unlink((dir_ / kLeaseName).c_str());
  log_line(dir_, fmt::format("release {} on {} (pid {})", me_.describe(), r->host, r->pid));
}

}  // namespace ddp
