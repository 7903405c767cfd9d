// Quorums over the coordination store (Note [Per-step fault tolerance] in ddp/fault_tolerance.h).
#include "ft/quorum.h"

#include <unistd.h>  // getpid

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "base/check.h"  // DDP_ASSERT
#include "base/log.h"
#include "base/proc_stat.h"  // live_process, own_start_time
#include "base/thread_annotations.h"
#include "ddp/error.h"
#include "store/client.h"

namespace ddp::ft {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// How long one store call may take (the store is the launcher's, on the job's network).
constexpr milliseconds kCallTime{5000};
// Between two looks at a forming quorum.
constexpr milliseconds kPoll{5};
// Between two tries of a store that did not answer.
constexpr milliseconds kStoreRetry{200};
// How long a counted arrival's entry may be missing before the quorum takes the arrival for
// lost (a live replica writes it right after counting itself in).
constexpr milliseconds kEntryGrace{2000};
// A lost arrival's entry, once the quorum gave up on it (an entry has spaces; this has none).
constexpr std::string_view kVoid = "void";
// Between two looks of the watcher for a replica waiting to enter the next quorum: how late a
// newcomer may be seen, at most (it is admitted at the first step boundary after that).
constexpr milliseconds kWatchEvery{20};

Clock::time_point soon() { return Clock::now() + kCallTime; }

// A quorum that did not form by the join timeout while the store answered (too few replicas,
// no majority): told apart from a store that never answered, whose error says what to do.
class QuorumTimeout : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

std::string encode(const Arrival& a) {
  return fmt::format("{} {} {} {} {} {} {}", a.id, a.step, a.last_quorum, a.last_rank, a.host,
                     a.pid, a.start_time);
}

Arrival decode(const std::string& text, const std::string& key) {
  Arrival a;
  std::istringstream in(text);
  if (!(in >> a.id >> a.step >> a.last_quorum >> a.last_rank >> a.host >> a.pid >> a.start_time)) {
    throw InternalError(
        fmt::format("fault tolerance: malformed quorum entry {} = '{}'", key, text));
  }
  return a;
}

// This kernel and pid namespace: where a pid means the same process.
std::string this_host() {
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string id;
  std::getline(boot, id);
  std::error_code ec;
  const std::string ns = std::filesystem::read_symlink("/proc/self/ns/pid", ec).string();
  return fmt::format("{}/{}", id.empty() ? "?" : id, ec ? "?" : ns);
}

// A member of the last quorum whose process is gone from this host: not waited for.
bool known_dead(const Arrival& a, const std::string& here) {
  return a.host == here && a.pid > 0 && !live_process(a.pid, a.start_time);
}

}  // namespace

// The store calls of a step, off its path: a thread with a connection of its own looks every
// kWatchEvery whether a replica waits to enter the quorum after the watched one, and sends rank
// 0's record of each commit. Each call bounded by kCallTime; a store that does not answer is
// told to the step's vote (once per failed look), not waited for there.
class Quorums::Watcher {
 public:
  explicit Watcher(Quorums& q)
      : q_(q),
        store_(store::ClientOptions{.host = q.o_.host,
                                    .port = q.o_.port,
                                    .key = q.o_.key,
                                    .identity = fmt::format("fault-tolerance replica {} (watcher)",
                                                            q.o_.replica_id),
                                    .who = fmt::format("[{}]", q.o_.replica_id),
                                    .owner = "the launcher (the coordination store)"}) {
    thread_ = std::thread([this] { run(); });
  }
  ~Watcher() {
    {
      MutexLock l(&mu_);
      stopping_ = true;
      changed_.signal_all();
    }
    thread_.join();  // a record still queued is sent first, bounded by kCallTime
  }

  void watch(int64_t current) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    watched_ = current;
    error_.clear();
    changed_.signal_all();
  }
  bool waits(int64_t current) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    if (!error_.empty()) throw RendezvousError(std::exchange(error_, ""));
    return waits_after_ == current;
  }
  void record(int64_t number, int64_t step) EXCLUDES(mu_) {
    MutexLock l(&mu_);
    record_ = {number, step};
    changed_.signal_all();
  }

 private:
  void run() EXCLUDES(mu_) {
    auto next_look = Clock::now();
    for (;;) {
      int64_t watched = -1;
      std::optional<std::pair<int64_t, int64_t>> record;
      bool stopping = false;
      {
        MutexLock l(&mu_);
        while (!stopping_ && !record_ && (watched_ < 0 || Clock::now() < next_look)) {
          if (watched_ < 0) {
            changed_.wait();
          } else {
            changed_.wait_until(next_look);
          }
        }
        watched = watched_;
        record = std::exchange(record_, std::nullopt);
        stopping = stopping_;
      }
      if (record) {
        try {
          store_.set(q_.key(record->first, "committed"), std::to_string(record->second), soon());
        } catch (const std::exception& e) {
          q_.note(fmt::format("step {} committed, but the store did not record it: {}",
                              record->second, e.what()));
        }
      }
      if (stopping) return;
      if (watched < 0 || Clock::now() < next_look) continue;
      next_look = Clock::now() + kWatchEvery;
      try {
        const bool waits = store_.check({q_.key(watched + 1, "arrived")}, soon());
        MutexLock l(&mu_);
        if (waits && watched_ == watched) waits_after_ = watched;
      } catch (const std::exception& e) {
        MutexLock l(&mu_);
        if (watched_ == watched) error_ = e.what();
      }
    }
  }

  Quorums& q_;  // key() and note(): constant after construction
  store::Client store_;
  Mutex mu_;
  CondVar changed_{&mu_};
  int64_t watched_ GUARDED_BY(mu_) = -1;      // the quorum trained in (-1: none yet)
  int64_t waits_after_ GUARDED_BY(mu_) = -1;  // a replica waits to enter the one after this
  std::string error_ GUARDED_BY(mu_);         // the last look's store error, for the vote
  std::optional<std::pair<int64_t, int64_t>> record_ GUARDED_BY(mu_);  // quorum, step
  bool stopping_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts once the rest is built
};

Quorums::Quorums(QuorumOptions options)
    : o_(std::move(options)), prefix_(fmt::format("ft/{}/", o_.run)),
      store_(std::make_unique<store::Client>(
          store::ClientOptions{.host = o_.host,
                               .port = o_.port,
                               .key = o_.key,
                               .identity = fmt::format("fault-tolerance replica {}", o_.replica_id),
                               .who = fmt::format("[{}]", o_.replica_id),
                               .owner = "the launcher (the coordination store)"})) {
  for (const char c : o_.replica_id) {
    if (std::isspace(static_cast<unsigned char>(c))) {
      throw ConfigError(fmt::format("ft: replica id '{}' has a space", o_.replica_id));
    }
  }
  watcher_ = std::make_unique<Watcher>(*this);
}

Quorums::~Quorums() = default;

std::string Quorums::key(int64_t quorum, const std::string& what) const {
  return fmt::format("{}q{}/{}", prefix_, quorum, what);
}

std::optional<std::string> Quorums::peek(const std::string& k) {
  if (!store_->check({k}, soon())) return std::nullopt;
  return store_->get(k, milliseconds(0), soon());
}

// The entries of the first n arrivals, each waited for up to kEntryGrace: an arrival writes its
// entry right after counting itself in. One still missing then is a lost arrival, voided by one
// compare-and-set that every reader (and the late writer itself) sees the same: an add whose
// answer the link lost was counted, and the replica's retry counted it again (a cut's TCP
// retransmission can deliver the first one seconds later). Before, the members waited for such
// an entry until their join timeout, and the job failed.
std::vector<Arrival> Quorums::arrivals(int64_t quorum, int64_t n) {
  std::vector<Arrival> out;
  for (int64_t i = 0; i < n; ++i) {
    const std::string k = key(quorum, fmt::format("member/{}", i));
    std::string entry;
    try {
      entry = store_->get(k, kEntryGrace, soon() + kEntryGrace);
    } catch (const RendezvousError&) {  // missing after the grace, or a silent store: decide
      entry = store_->compare_set(k, "", std::string(kVoid), soon());
      if (entry == kVoid) {
        note(
            fmt::format("quorum {}: arrival {} wrote no entry within {} s (an answer lost with "
                        "the link, its replica counted again): left out",
                        quorum, i, std::chrono::duration<double>(kEntryGrace).count()));
      }
    }
    if (entry == kVoid) continue;
    out.push_back(decode(entry, k));
    out.back().slot = i;
  }
  return out;
}

std::vector<Arrival> Quorums::members_of(int64_t quorum) {
  if (quorum < 0) return {};
  const auto closed = peek(key(quorum, "closed"));
  if (!closed) return {};
  return arrivals(quorum, std::stoll(*closed));
}

void Quorums::watch(int64_t current) { watcher_->watch(current); }

bool Quorums::someone_waits(int64_t current) { return watcher_->waits(current); }

void Quorums::record_commit(int64_t number, int64_t step) { watcher_->record(number, step); }

void Quorums::failed(int64_t number, const std::string& why) {
  log::line(-1, fmt::format("[{}] fault tolerance: quorum {}'s group did not form or heal ({}); "
                            "trying the next quorum",
                            o_.replica_id, number, why));
}

void Quorums::note(const std::string& text) const {
  log::line(-1, fmt::format("[{}] fault tolerance: {}", o_.replica_id, text));
}

void Quorums::formed(int64_t number, int64_t step) {
  committed(number, step);
  store_->set(prefix_ + "newest", std::to_string(number), soon());
}

void Quorums::committed(int64_t number, int64_t step) {
  store_->set(key(number, "committed"), std::to_string(step), soon());
}

Quorums::Known Quorums::known() {
  Known k;
  if (const auto finished = peek(prefix_ + "finished")) {
    k.step = std::stoll(*finished);
    k.finished = true;
  } else if (const auto newest = peek(prefix_ + "newest")) {
    if (const auto committed = peek(key(std::stoll(*newest), "committed"))) {
      k.step = std::stoll(*committed);
    }
  }
  return k;
}

void Quorums::finish(int64_t step) {
  store_->set(prefix_ + "finished", std::to_string(step), soon());
}

// A store that does not answer (a cut link, its host busy) is asked again until the join
// timeout: a replica cut off from the store waits there, it does not fail and burn a restart;
// once the network heals it arrives in the newest quorum and is healed. A store that refuses
// this replica (another job's) is final. Each call is asked again from where it failed; an
// arrival counted but unanswered (the reply lost with the link) leaves a count without its
// entry, which the quorum voids after kEntryGrace (arrivals()).
Formed Quorums::join(int64_t after, Arrival me, const std::string& why) {
  static const std::string here = this_host();
  me.host = here;
  me.pid = static_cast<int>(::getpid());
  me.start_time = own_start_time();
  const auto deadline = Clock::now() + o_.join_timeout;
  std::optional<int64_t> target;  // the quorum this replica arrives in
  int64_t index = -1;             // its arrival there (-1: not counted in yet)
  bool entered = false;           // its entry written
  bool waiting_for_store = false;
  for (;;) {
    try {
      if (!target) {
        target = after + 1;
        if (after < 0) {  // a newcomer: past the newest quorum the store knows
          const auto newest = peek(prefix_ + "newest");
          target = newest ? std::stoll(*newest) + 1 : 0;
        }
      }
      if (index < 0) index = store_->add(key(*target, "arrived"), 1, soon()) - 1;
      if (!entered) {
        const std::string mine = encode(me);
        if (store_->compare_set(key(*target, fmt::format("member/{}", index)), "", mine, soon()) !=
            mine) {  // voided: this replica was away between counting in and writing it
          index = -1;
          continue;
        }
        entered = true;
      }
      const int64_t count = wait_closed(*target, index, me.step, why, deadline);
      if (waiting_for_store) {
        note("the coordination store answers again");
        waiting_for_store = false;
      }
      if (count == kFinished) return Formed{.number = *target, .job_finished = true};
      if (count < 0) {  // closed without this arrival: the next one
        ++*target;
        index = -1;
        entered = false;
        continue;
      }
      return ranked(*target, index, count);
    } catch (const store::RefusedError&) {
      throw;
    } catch (const QuorumTimeout&) {
      throw;
    } catch (const RendezvousError& e) {
      if (Clock::now() >= deadline) {
        throw RendezvousError(fmt::format(
            "[{}] fault tolerance: the coordination store did not answer within the join timeout "
            "({} s): {}. The quorums' records are kept there, so the replicas cannot go on "
            "without it: its host (under ddprun --ft, node 0's, whose ddprun hosts it) is lost "
            "or cut off. Start the job again and resume it from its last checkpoint (ddp-train: "
            "--resume auto)",
            o_.replica_id, std::chrono::duration<double>(o_.join_timeout).count(), e.what()));
      }
      if (!waiting_for_store) {
        note(
            fmt::format("the coordination store did not answer ({}); asking again until the "
                        "join timeout ({} s)",
                        e.what(), std::chrono::duration<double>(o_.join_timeout).count()));
        waiting_for_store = true;
      }
      std::this_thread::sleep_for(kStoreRetry);
    }
  }
}

// Quorum `number`, closed at `count` arrivals, this replica arrival `index`: its members by
// rank. Ranks: the quorum before's members in their rank order, then newcomers by arrival.
Formed Quorums::ranked(int64_t number, int64_t index, int64_t count) {
  Formed f;
  f.number = number;
  const std::vector<Arrival> all = arrivals(number, count);  // the lost ones left out
  std::vector<int> order(all.size());
  std::iota(order.begin(), order.end(), 0);
  std::ranges::stable_sort(order, [&](int a, int b) {
    const bool ka = all[a].last_quorum == number - 1, kb = all[b].last_quorum == number - 1;
    if (ka != kb) return ka;
    return ka && all[a].last_rank < all[b].last_rank;
  });
  for (size_t r = 0; r < all.size(); ++r) {
    f.members.push_back(all[order[r]]);
    if (all[order[r]].slot == index) f.rank = static_cast<int>(r);
  }
  DDP_ASSERT(f.rank >= 0, "fault tolerance: quorum {} closed with arrival {}, whose entry is gone",
             number, index);
  return f;
}

int64_t Quorums::wait_closed(int64_t quorum, int64_t index, int64_t step, const std::string& why,
                             Clock::time_point deadline) {
  const auto arrived_at = Clock::now();
  bool majority = true, told_minority = false;
  // The last quorum's members, but those whose process is gone from this host (a worker that
  // died: nothing to wait for; one on another host is waited for up to quorum_timeout).
  std::vector<std::string> expected;
  static const std::string here = this_host();
  for (const Arrival& a : members_of(quorum - 1)) {
    if (!known_dead(a, here)) expected.push_back(a.id);
  }
  for (;;) {
    if (const auto closed = peek(key(quorum, "closed"))) {
      const int64_t admitted = std::stoll(*closed);
      return index < admitted ? admitted : -1;
    }
    // The others finished while this replica was away: nobody is left to heal it.
    if (const auto finished = peek(prefix_ + "finished");
        finished && std::stoll(*finished) > step) {
      return kFinished;
    }
    const int64_t n = store_->add(key(quorum, "arrived"), 0, soon());
    std::vector<std::string> ids;
    for (const Arrival& a : arrivals(quorum, n)) ids.push_back(a.id);
    const auto held = std::ranges::count_if(expected, [&](const std::string& id) {
      return std::ranges::find(ids, id) != ids.end();
    });
    const bool all_in = held == static_cast<int64_t>(expected.size());
    // Never two quorums training at once: a quorum holds a majority of the last one's live
    // members (as ddprun's rounds do: Note [Never two groups]), so a replica that was away (a
    // SIGSTOP, a cut link) cannot start one of its own while the others train.
    majority = expected.empty() || 2 * held > static_cast<int64_t>(expected.size());
    // The first quorum knows nobody to wait for: it waits quorum_timeout for the replicas
    // starting together (later ones join the next quorum, healed there).
    const bool waited = Clock::now() - arrived_at >= o_.quorum_timeout;
    const auto real = static_cast<int64_t>(ids.size());  // the lost arrivals left out
    if (real >= o_.min_replicas && majority && ((all_in && !expected.empty()) || waited)) {
      store_->compare_set(key(quorum, "closed"), "", std::to_string(n), soon());
      continue;  // whoever won, "closed" is there now
    }
    if (waited && !majority && !told_minority) {  // said once: the job stalls, and why
      note(fmt::format(
          "quorum {} waits for a majority: {} of the {} live replica(s) of quorum {} arrived, not "
          "a majority (the others may be cut off); it forms when more arrive, or fails in {:.0f} "
          "s",
          quorum, held, expected.size(), quorum - 1,
          std::chrono::duration<double>(deadline - Clock::now()).count()));
      told_minority = true;
    }
    if (Clock::now() > deadline) {
      throw QuorumTimeout(fmt::format(
          "[{}] fault tolerance: quorum {} did not form within {} s: {} replica(s) arrived, {}{}",
          o_.replica_id, quorum, std::chrono::duration<double>(o_.join_timeout).count(), real,
          !majority ? fmt::format("holding {} of the {} live replica(s) of quorum {}, not a "
                                  "majority (the others may train without this side)",
                                  held, expected.size(), quorum - 1)
                    : fmt::format("at least {} needed (ft::ManagerOptions::min_replicas); start "
                                  "more replicas or lower it",
                                  o_.min_replicas),
          why.empty() ? "" : fmt::format(" (before: {})", why)));
    }
    std::this_thread::sleep_for(kPoll);
  }
}

}  // namespace ddp::ft
