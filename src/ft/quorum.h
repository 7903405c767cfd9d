// The quorums of per-step fault tolerance, over the coordination store (Note [Per-step fault
// tolerance] in ddp/fault_tolerance.h): arriving, closing, ranks. Torch-free: the store and the
// rule only; ft::Manager forms the groups (their rendezvous in the same store) and heals.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace ddp::store {
class Client;
}

namespace ddp::ft {

// One replica as a quorum sees it: its entry "q<N>/member/<i>" (or "void": an arrival counted
// whose entry never came, taken for lost).
struct Arrival {
  std::string id;
  int64_t step = 0;          // committed steps
  int64_t last_quorum = -1;  // the quorum it last ran in (-1: a newcomer)
  int last_rank = -1;        // its rank there
  // Its process (set by Quorums::join): a forming quorum does not wait for a member of the last
  // one that is known dead, its process gone from this host.
  std::string host;  // this kernel: boot id and pid namespace
  int pid = 0;
  uint64_t start_time = 0;  // with the pid, names the process (base/proc_stat.h)
  int64_t slot = -1;        // its arrival's number in the quorum ("member/<slot>")
};

// A quorum that closed with this replica in it.
struct Formed {
  int64_t number = -1;
  // The job finished past this replica's step while it waited (Quorums::finish): nothing
  // formed, nothing left to train.
  bool job_finished = false;
  std::vector<Arrival> members;  // by rank
  int rank = -1;                 // this replica's
};

struct QuorumOptions {
  std::string host;  // the coordination store
  int port = 0;
  std::string key;  // store::job_key(secret, run)
  std::string run;  // the run id: keys under "ft/<run>/"
  std::string replica_id;
  int min_replicas = 1;
  std::chrono::milliseconds quorum_timeout{1000};
  std::chrono::milliseconds join_timeout{60000};
};

class Quorums {
 public:
  explicit Quorums(QuorumOptions options);
  ~Quorums();
  Quorums(const Quorums&) = delete;
  Quorums& operator=(const Quorums&) = delete;

  // From now on this replica trains in quorum `current`: the watcher (a thread with its own
  // store connection) looks every few milliseconds whether a replica waits to enter the quorum
  // after it, so that the step's vote does not wait for the store.
  void watch(int64_t current);
  // Whether the watcher saw a replica waiting to enter the quorum after `current` (no store
  // call). A store that did not answer the watcher's last look: ddp::RendezvousError, once.
  bool someone_waits(int64_t current);
  // Arrives in the first quorum after `after` that still admits (a newcomer, after = -1: past
  // the newest the store knows) as `me`, and waits until it closes: once every member of the
  // quorum before it arrived, or quorum_timeout after this arrival, with at least min_replicas.
  // Ranks: the quorum before's members in their rank order, then newcomers by arrival. `why`:
  // what ended the last attempt, for the join timeout's message. A store that does not answer
  // is asked again until then. ddp::RendezvousError at the join timeout.
  Formed join(int64_t after, Arrival me, const std::string& why = "");
  // Rank 0, once the group formed at committed step `step`: newcomers start past `number`, and
  // no later quorum may start from an older step.
  void formed(int64_t number, int64_t step);
  // Rank 0 of quorum `number`, at each step it commits: the newest committed step, kept per
  // quorum so that a woken rank 0 of an older quorum cannot set it back. Sent by the watcher,
  // so the step does not wait for the store's answer; the newest step queued wins. A store that
  // fails it: a note (the next step's vote fails on the watcher's error).
  void record_commit(int64_t number, int64_t step);
  // The newest committed step the store knows (the newest quorum's commits, or the end), and
  // whether the job finished there.
  struct Known {
    int64_t step = 0;
    bool finished = false;
  };
  Known known();
  // A replica ended the training loop at committed step `step`.
  void finish(int64_t step);
  // This replica could not form quorum `number`'s group (`why`): said on stderr; it tries the
  // next quorum.
  void failed(int64_t number, const std::string& why);
  // A line on stderr, "[<replica>] ddp: fault tolerance: <text>".
  void note(const std::string& text) const;

 private:
  class Watcher;

  std::string key(int64_t quorum, const std::string& what) const;
  void committed(int64_t number, int64_t step);  // record_commit(), waiting for the store
  std::optional<std::string> peek(const std::string& key);
  std::vector<Arrival> arrivals(int64_t quorum, int64_t n);
  std::vector<Arrival> members_of(int64_t quorum);
  Formed ranked(int64_t number, int64_t index, int64_t count);
  // Waits in `quorum` (this replica arrival `index`): the number it admitted, or -1 if it closed
  // without this one.
  // kFinished: the job finished past `step` meanwhile (Quorums::finish).
  int64_t wait_closed(int64_t quorum, int64_t index, int64_t step, const std::string& why,
                      std::chrono::steady_clock::time_point deadline);
  static constexpr int64_t kFinished = -2;

  QuorumOptions o_;
  std::string prefix_;
  std::unique_ptr<store::Client> store_;
  std::unique_ptr<Watcher> watcher_;  // last: its thread starts once the rest is built
};

}  // namespace ddp::ft
