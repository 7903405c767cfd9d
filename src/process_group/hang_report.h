// Hang reports: when a collective fails, the ranks' flight recorders (flight_recorder.h) are
// gathered through the store and turned into a verdict that opens the error.
//
// Note [Hang reports]
// Every rank of a group of two or more has a reporter with a store handle of its own whose calls
// are bounded by kStoreCallLimit (the store's host may be the rank that hangs), and a watcher
// thread that checks the key "dump" once per kWatchInterval: one small request per second per
// rank while healthy.
//   - A rank whose collective fails (timeout, dead peer) publishes its records under
//     "records/<rank>", sets "dump", and reads the peers' records for up to kAnswerDeadline
//     (InitOptions::hang_report_wait).
//   - Every other rank's watcher sees "dump" and publishes its records: a rank stuck in user
//     code or in another collective answers too, so the report says where it stands.
//   - A rank that does not answer: a peer on this host is looked up in /proc (stopped:
//     SIGSTOP or a debugger; gone); elsewhere it is "silent".
//   - A rank whose group is destroyed (its program returned early) publishes its records marked
//     "left" first, within kDepartLimit, before its transport closes: over Gloo its peers see
//     only "Connection closed by peer", and the verdict names it ("rank 1 left the group").
//   - When the store itself does not answer (its host exited, the network is down), no peer can
//     be asked: the report says so once, in its verdict, not once per rank.
// Each rank also writes its records as JSON next to its error file (TORCHELASTIC_ERROR_FILE's
// folder: ddprun's per-rank log folder), flight_recorder_rank<R>.json (a group other than the
// default: flight_recorder_<group>_rank<R>.json); none without one.
// While a Gloo collective waits, the waiting thread checks this host's peers once per second:
// a peer stopped for shm::kStoppedLimit, or gone, fails the collective at once instead of at
// the timeout.
// Keys live under the group's job- and attempt-scoped prefix, plus "flight_recorder/".
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base/thread_annotations.h"  // Mutex, CondVar, GUARDED_BY
#include "process_group/flight_recorder.h"

namespace ddp {

// How long a failing rank waits for its peers' records, by default.
inline constexpr std::chrono::seconds kAnswerDeadline{3};
// Bound of each store call a reporter makes (the store may be unhealthy).
inline constexpr std::chrono::seconds kStoreCallLimit{2};
// A departing rank's last store call (depart()) waits at most this: at a job's normal end the
// store's host may have gone first.
inline constexpr std::chrono::milliseconds kDepartLimit{200};
// How often a watcher looks for a dump request.
inline constexpr std::chrono::seconds kWatchInterval{1};

class HangReporter {
 public:
  struct Options {
    int rank = 0;
    int size = 1;
    std::string group;     // the group's name, for the dump file
    std::string dump_dir;  // where the JSON dump goes; empty: none
    std::chrono::milliseconds answer_deadline = kAnswerDeadline;  // see kAnswerDeadline
  };
  // `store`: a handle of the reporter's own (calls bounded by kStoreCallLimit), prefixed for
  // the group. Publishes this process's pid, its start time and host.
  HangReporter(c10::intrusive_ptr<::c10d::Store> store, std::shared_ptr<flight::Ring> ring,
               Options options);
  ~HangReporter();  // stops the watcher
  HangReporter(const HangReporter&) = delete;
  HangReporter& operator=(const HangReporter&) = delete;

  struct Report {
    std::string verdict;  // one line; empty when no rank is at fault by the records
    std::string details;  // per-rank lines and where the dump went
  };
  // For this group's first failure (`seq`): publishes, gathers, judges (Note [Hang reports]).
  // Later failures return an empty report at once. Never throws.
  Report explain(uint64_t seq) EXCLUDES(mu_, store_mu_);

  // This rank leaves the group (its ProcessGroup is being destroyed, before the transport
  // closes): its records, marked "left", so that a peer still waiting in a collective learns
  // why this rank went silent (Note [Hang reports]). Bounded by the store handle's timeout
  // (the group sets kDepartLimit); never throws.
  void depart() EXCLUDES(mu_, store_mu_) { publish("", /*left=*/true); }

  // A peer on this host that has been stopped for shm::kStoppedLimit, or is gone: its verdict
  // line; else empty. Cheap once every peer's record was read; never throws.
  std::string check_local_peers() EXCLUDES(mu_, store_mu_);

 private:
  struct Peer {
    int pid = 0;
    uint64_t start_time = 0;  // of pid (base/proc_stat.h): a reused pid is not this peer
    bool local = false;
    bool known = false;
  };
  void watch() EXCLUDES(mu_, store_mu_);
  // Records to the store and (unless `left`) the dump file; `left`: marked as departed.
  void publish(const std::string& verdict, bool left = false) EXCLUDES(mu_, store_mu_);
  // Read from the store (bounded) and remembered; a peer not recorded yet is asked for again
  // on the next call, until a store call fails.
  std::vector<Peer> peers() EXCLUDES(mu_, store_mu_);

  // Constant after construction.
  const Options o_;
  const std::shared_ptr<flight::Ring> ring_;
  const std::string host_;  // this kernel's identity

  // One store call at a time (the watcher's, explain()'s, depart()'s); never taken under mu_.
  Mutex store_mu_;
  c10::intrusive_ptr<::c10d::Store> store_ GUARDED_BY(store_mu_);

  Mutex mu_;
  CondVar wake_{&mu_};                               // stopping_ was set
  std::vector<Peer> peers_ GUARDED_BY(mu_);          // empty until read
  bool peers_store_failed_ GUARDED_BY(mu_) = false;  // peers() asks no more
  bool published_ GUARDED_BY(mu_) = false;
  bool explained_ GUARDED_BY(mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;
  std::map<int, std::chrono::steady_clock::time_point> stopped_since_ GUARDED_BY(mu_);
  std::thread watcher_;  // last: starts after everything above exists
};

}  // namespace ddp
