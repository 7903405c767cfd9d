// The flight recorder: every rank's recent collectives, and the verdict read from them when a
// collective fails.
//
// Note [Flight recorder]
// Each process group keeps a ring of its last N collectives (N = DDP_FLIGHT_RECORDER, default
// kDefaultEntries; 0 turns it off): sequence number, op, dtype, element count, state (issued,
// completed, failed), wall-clock times, the training step (set_training_step) and, for DDP's
// buckets, the bucket index and its first parameter names. A collective on a GPU stream (NCCL)
// has two moments, as in c10d: its wait() returns once the work is enqueued on the stream
// (state enqueued, enqueued_us) and it completes when its CUDA event has fired (completed_us),
// found by the group's next look at its in-flight works; a hang report reads "enqueued" as
// "the GPU has not finished it". Writing a record is a short critical
// section on a preallocated slot (no allocation once the slots' strings have grown), so a healthy
// job pays a few hundred nanoseconds per collective.
// When a collective fails (a timeout, a peer failure), the ranks' rings are compared
// (hang_report.h gathers them through the store) and verdict() names the cause in one line:
//   - a desync: two ranks issued different collectives under the same number;
//   - a rank behind: it never issued the failed collective; where it stands instead;
//   - a rank that did not answer: stopped (SIGSTOP, a debugger), exited, or silent.
// The verdict opens the error, so a launcher's one-line summary shows it.
// Torch-free and free of I/O except process_state(): tested alone (tests/unit).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "base/thread_annotations.h"
#include "process_group/collective.h"

namespace ddp::flight {

// Slots per group when DDP_FLIGHT_RECORDER is unset: a few training steps of DDP's buckets.
inline constexpr size_t kDefaultEntries = 256;

enum class State : uint8_t { kIssued, kEnqueued, kCompleted, kFailed };
const char* to_string(State s);

struct Record {
  CollectiveDesc call;  // what was issued; call.seq == 0: an empty slot
  State state = State::kIssued;
  int64_t issued_us = 0;     // wall clock, unix microseconds
  int64_t enqueued_us = 0;   // GPU collectives: when wait() returned (enqueued on the stream)
  int64_t completed_us = 0;  // when it completed or failed; 0 until then
  int64_t step = -1;         // training step when it was issued; -1: none set
  int bucket = -1;           // DDP bucket index; -1: not a bucket
  std::string params;        // the bucket's first parameter names, "fc.weight, fc.bias, ..."

  // "all_reduce #12 (sum, 4 x Float)"
  std::string describe() const { return call.describe(); }
};

// What the next collective on this thread is for (DDP's reducer sets it around a bucket's comm
// hook); taken by the next collective that `owner` (a process group) issues on this thread.
struct Note {
  const void* owner = nullptr;  // the group it is meant for
  int bucket = -1;
  std::string params;
};
void annotate_next(const void* owner, int bucket, std::string params);
void clear_note();
// This thread's note when it is meant for `owner` (and then no longer pending), else null.
const Note* take_note(const void* owner);

// The training step recorded with each collective of this process (-1: none).
void set_step(int64_t step);
int64_t current_step();

// A fixed-size ring of records. Thread-safe.
class Ring {
 public:
  explicit Ring(size_t capacity);
  size_t capacity() const { return capacity_; }

  // Records `call` as issued (sequence numbers of one group are consecutive), with the current
  // step and `note` (may be null).
  void issue(const CollectiveDesc& call, const Note* note);
  // Marks `seq` enqueued on its GPU stream (no-op unless it is issued).
  void enqueue(uint64_t seq);
  // Marks `seq` completed or failed (no-op when it was overwritten or already finished).
  void finish(uint64_t seq, bool ok);
  // The records held, oldest first.
  std::vector<Record> snapshot() const;

 private:
  const size_t capacity_;
  mutable Mutex mu_;
  std::vector<Record> slots_ GUARDED_BY(mu_);  // slot of seq: seq % capacity
};

// Unix microseconds now.
int64_t now_us();

nlohmann::json to_json(const Record& r);
nlohmann::json to_json(const std::vector<Record>& records);
// Throws std::exception on malformed input.
std::vector<Record> records_from_json(const nlohmann::json& j);

// How a local process looks from /proc (base/proc_stat.h): running (any state but those below),
// stopped ('T' or 't'), gone (no such process, a zombie, or, given the start time the peer
// published, a process that started at another time: the pid was reused). `start_time` 0:
// unknown, any process with that pid.
enum class Liveness { kUnknown, kRunning, kStopped, kGone };
Liveness process_state(int pid, uint64_t start_time = 0);

// What the rank whose collective failed knows about one peer.
struct PeerView {
  int rank = 0;
  int pid = 0;                                 // 0: unknown
  std::optional<std::vector<Record>> records;  // absent: it did not answer in time
  Liveness liveness = Liveness::kUnknown;      // known for peers on this host only
  std::string silence;  // why records are absent: "did not answer within 3.0 s"
  bool asked = true;    // false: the store failed before it could be asked
  bool left = false;    // its records say it destroyed its process group (HangReporter::depart)
};

// The one-line verdict about `failed` (this rank's record of the failed collective), e.g.
//   "rank 1 never issued all_reduce #57; its last completed collective is #56 at step 812"
//   "rank 0 issued all_reduce #12 (4 x Float), rank 1 issued broadcast #12 (1 x Long)"
//   "rank 1 (pid 4242) is stopped (SIGSTOP or a debugger) and did not answer"
// Peers that could not be asked (the store failed) are not blamed. Empty when the records show
// no rank at fault.
std::string verdict(int my_rank, const Record& failed, const std::vector<PeerView>& peers);

// One line per rank for the body of the error: last issued and last completed collective.
std::string table(int my_rank, const std::vector<Record>& mine, const std::vector<PeerView>& peers);

// Note [GPU completion]
// A collective on a GPU stream is "done" for its wait() once enqueued; its real end is its CUDA
// event, which nobody waits for on the CPU. The group keeps such works here and looks at them
// before each new collective (a cudaEventQuery each, through `done`): those finished are marked
// completed in the ring; the oldest one past the group's timeout is returned, so the group can
// abort its communicator and fail with a TimeoutError instead of piling more work behind a
// stuck one (c10d's watchdog does the same on its own thread, and kills the process; ours
// names the collective and the ranks first). Thread-safe.
class InFlight {
 public:
  struct Work {
    CollectiveDesc call;
    std::chrono::steady_clock::time_point enqueued;
    std::function<bool()> done;  // has the collective's event fired?
  };
  void add(Work work);
  // Marks finished works completed in `ring` (may be null) and forgets them; returns the oldest
  // work still running after `timeout` since it was enqueued, if any (it stays held).
  std::optional<CollectiveDesc> sweep(
      Ring* ring, std::chrono::milliseconds timeout,
      std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now());
  size_t size() const;

 private:
  mutable Mutex mu_;
  std::vector<Work> works_ GUARDED_BY(mu_);  // enqueue order
};

}  // namespace ddp::flight
