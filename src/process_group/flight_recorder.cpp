// The flight recorder's ring and verdicts (Note [Flight recorder] in flight_recorder.h).
#include "process_group/flight_recorder.h"

#include <algorithm>
#include <atomic>
#include <chrono>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <nlohmann/json.hpp>

#include "base/proc_stat.h"  // live_process
#include "process_group/desync.h"

namespace ddp::flight {
namespace {

std::atomic<int64_t> g_step{-1};
thread_local Note t_note;

const Record* find(const std::vector<Record>& records, uint64_t seq) {
  for (const Record& r : records) {
    if (r.call.seq == seq) return &r;
  }
  return nullptr;
}

const Record* last_issued(const std::vector<Record>& records) {
  const Record* best = nullptr;
  for (const Record& r : records) {
    if (best == nullptr || r.call.seq > best->call.seq) best = &r;
  }
  return best;
}

const Record* last_completed(const std::vector<Record>& records) {
  const Record* best = nullptr;
  for (const Record& r : records) {
    if (r.state == State::kCompleted && (best == nullptr || r.call.seq > best->call.seq)) best = &r;
  }
  return best;
}

// "#56 (all_reduce, bucket 2: fc.weight, fc.bias) at step 812"
std::string where(const Record& r) {
  std::string out = fmt::format("#{} ({}", r.call.seq, name(r.call.op));
  if (r.bucket >= 0) out += fmt::format(", bucket {}: {}", r.bucket, r.params);
  out += ")";
  if (r.step >= 0) out += fmt::format(" at step {}", r.step);
  return out;
}

// Where a rank that never issued the failed collective stands.
std::string standing(const std::vector<Record>& records) {
  const Record* issued = last_issued(records);
  if (issued == nullptr) return "it has issued no collective yet";
  std::string out;
  if (issued->state != State::kCompleted) {
    out = fmt::format("it {} {}{}; ",
                      issued->state == State::kFailed     ? "failed in"
                      : issued->state == State::kEnqueued ? "has on its GPU stream, not finished,"
                                                          : "waits in",
                      issued->describe(),
                      issued->step >= 0 ? fmt::format(" at step {}", issued->step) : "");
  }
  const Record* done = last_completed(records);
  if (done == nullptr) return out + "it has completed no collective yet";
  return out + "its last completed collective is " + where(*done);
}

// `parse(text)` or a json error naming the field.
template <typename Parse>
auto named_or_throw(Parse parse, const std::string& text, const char* field) {
  auto v = parse(text);
  if (!v) throw std::invalid_argument(fmt::format("flight record: unknown {} '{}'", field, text));
  return *v;
}

}  // namespace

const char* to_string(State s) {
  switch (s) {
    case State::kIssued: return "issued";
    case State::kEnqueued: return "enqueued";
    case State::kCompleted: return "completed";
    case State::kFailed: return "failed";
  }
  return "?";
}

void annotate_next(const void* owner, int bucket, std::string params) {
  t_note.owner = owner;
  t_note.bucket = bucket;
  t_note.params = std::move(params);
}

void clear_note() { t_note.owner = nullptr; }

const Note* take_note(const void* owner) {
  if (owner == nullptr || t_note.owner != owner) return nullptr;
  t_note.owner = nullptr;
  return &t_note;
}

void set_step(int64_t step) { g_step.store(step, std::memory_order_relaxed); }
int64_t current_step() { return g_step.load(std::memory_order_relaxed); }

int64_t now_us() {
  using namespace std::chrono;
  return duration_cast<microseconds>(system_clock::now().time_since_epoch()).count();
}

Ring::Ring(size_t capacity) : capacity_(std::max<size_t>(capacity, 1)), slots_(capacity_) {}

void Ring::issue(const CollectiveDesc& call, const Note* note) {
  const int64_t step = current_step();
  const int64_t now = now_us();
  MutexLock lock(&mu_);
  Record& r = slots_[call.seq % slots_.size()];
  r.call = call;
  r.state = State::kIssued;
  r.issued_us = now;
  r.enqueued_us = 0;
  r.completed_us = 0;
  r.step = step;
  r.bucket = note != nullptr ? note->bucket : -1;
  if (note != nullptr) {
    r.params.assign(note->params);
  } else {
    r.params.clear();
  }
}

void Ring::enqueue(uint64_t seq) {
  const int64_t now = now_us();
  MutexLock lock(&mu_);
  Record& r = slots_[seq % slots_.size()];
  if (r.call.seq != seq || r.state != State::kIssued) return;
  r.state = State::kEnqueued;
  r.enqueued_us = now;
}

void Ring::finish(uint64_t seq, bool ok) {
  const int64_t now = now_us();
  MutexLock lock(&mu_);
  Record& r = slots_[seq % slots_.size()];
  if (r.call.seq != seq || (r.state != State::kIssued && r.state != State::kEnqueued)) return;
  r.state = ok ? State::kCompleted : State::kFailed;
  r.completed_us = now;
}

std::vector<Record> Ring::snapshot() const {
  std::vector<Record> out;
  {
    MutexLock lock(&mu_);
    for (const Record& r : slots_) {
      if (r.call.seq != 0) out.push_back(r);
    }
  }
  std::sort(out.begin(), out.end(),
            [](const Record& a, const Record& b) { return a.call.seq < b.call.seq; });
  return out;
}

nlohmann::json to_json(const Record& r) {
  nlohmann::json j = {{"seq", r.call.seq},
                      {"op", name(r.call.op)},
                      {"dtype", name(r.call.dtype)},
                      {"count", r.call.count},
                      {"reduce", to_string(r.call.reduce)},
                      {"root", r.call.root},
                      {"state", to_string(r.state)},
                      {"issued_us", r.issued_us},
                      {"enqueued_us", r.enqueued_us},
                      {"completed_us", r.completed_us},
                      {"step", r.step}};
  if (r.bucket >= 0) {
    j["bucket"] = r.bucket;
    j["params"] = r.params;
  }
  return j;
}

nlohmann::json to_json(const std::vector<Record>& records) {
  nlohmann::json j = nlohmann::json::array();
  for (const Record& r : records) j.push_back(to_json(r));
  return j;
}

std::vector<Record> records_from_json(const nlohmann::json& j) {
  std::vector<Record> out;
  for (const nlohmann::json& e : j.at("records")) {
    Record r;
    r.call.seq = e.at("seq").get<uint64_t>();
    r.call.op = named_or_throw(collective_named, e.at("op").get<std::string>(), "op");
    r.call.dtype = named_or_throw(dtype_named, e.at("dtype").get<std::string>(), "dtype");
    r.call.count = e.at("count").get<uint64_t>();
    r.call.reduce =
        named_or_throw(reduce_op_named, e.value("reduce", std::string("sum")), "reduce");
    r.call.root = e.value("root", 0);
    const std::string state = e.at("state").get<std::string>();
    r.state = state == "completed"  ? State::kCompleted
              : state == "failed"   ? State::kFailed
              : state == "enqueued" ? State::kEnqueued
                                    : State::kIssued;
    r.issued_us = e.at("issued_us").get<int64_t>();
    r.enqueued_us = e.value("enqueued_us", int64_t{0});
    r.completed_us = e.at("completed_us").get<int64_t>();
    r.step = e.at("step").get<int64_t>();
    r.bucket = e.value("bucket", -1);
    r.params = e.value("params", std::string());
    out.push_back(std::move(r));
  }
  return out;
}

Liveness process_state(int pid, uint64_t start_time) {
  if (pid <= 0) return Liveness::kUnknown;
  const std::optional<ProcStat> stat = live_process(pid, start_time);
  if (!stat) return Liveness::kGone;
  return stat->stopped() ? Liveness::kStopped : Liveness::kRunning;
}

std::string verdict(int my_rank, const Record& failed, const std::vector<PeerView>& peers) {
  std::vector<std::string> desync, dead, behind, silent;
  for (const PeerView& p : peers) {
    if (!p.records) {
      if (p.liveness == Liveness::kStopped) {
        dead.push_back(
            fmt::format("rank {} (pid {}) is stopped (SIGSTOP or a debugger) and did not answer",
                        p.rank, p.pid));
      } else if (p.liveness == Liveness::kGone) {
        dead.push_back(fmt::format("rank {} (pid {}) has exited", p.rank, p.pid));
      } else if (p.asked) {
        silent.push_back(
            fmt::format("rank {} {} (no records): it may be stopped, dead or "
                        "unreachable",
                        p.rank, p.silence));
      }
      continue;
    }
    if (const Record* theirs = find(*p.records, failed.call.seq)) {
      if (!theirs->call.same_call(failed.call)) {
        desync.push_back(desync_pair(my_rank, failed.describe(), p.rank, theirs->describe()));
      }
      continue;
    }
    const Record* last = last_issued(*p.records);
    if (last == nullptr || last->call.seq < failed.call.seq) {
      if (p.left) {
        behind.push_back(fmt::format(
            "rank {} left the group without issuing {} #{}: it destroyed its process group (its "
            "program returned or is exiting); {}",
            p.rank, name(failed.call.op), failed.call.seq, standing(*p.records)));
      } else {
        behind.push_back(fmt::format("rank {} never issued {} #{}; {}", p.rank,
                                     name(failed.call.op), failed.call.seq, standing(*p.records)));
      }
    }
  }
  std::vector<std::string> all;
  for (auto* part : {&desync, &dead, &behind, &silent}) {
    all.insert(all.end(), part->begin(), part->end());
  }
  return fmt::format("{}", fmt::join(all, "; "));
}

std::string table(int my_rank, const std::vector<Record>& mine,
                  const std::vector<PeerView>& peers) {
  auto line = [](int rank, const std::vector<Record>& records) {
    const Record* issued = last_issued(records);
    const Record* done = last_completed(records);
    return fmt::format("  rank {}: last issued {}, last completed {}\n", rank,
                       issued ? fmt::format("{} ({})", issued->describe(), to_string(issued->state))
                              : "none",
                       done ? where(*done) : "none");
  };
  std::string out = line(my_rank, mine);
  for (const PeerView& p : peers) {
    out += p.records ? line(p.rank, *p.records)
                     : fmt::format("  rank {}: no records ({})\n", p.rank, p.silence);
  }
  return out;
}

void InFlight::add(Work work) {
  MutexLock lock(&mu_);
  works_.push_back(std::move(work));
}

std::optional<CollectiveDesc> InFlight::sweep(Ring* ring, std::chrono::milliseconds timeout,
                                              std::chrono::steady_clock::time_point now) {
  std::vector<uint64_t> finished;
  std::optional<CollectiveDesc> overdue;
  {
    MutexLock lock(&mu_);
    std::erase_if(works_, [&](const Work& w) {
      if (w.done()) {
        finished.push_back(w.call.seq);
        return true;
      }
      if (!overdue && now - w.enqueued > timeout) overdue = w.call;
      return false;
    });
  }
  if (ring != nullptr) {
    for (uint64_t seq : finished) ring->finish(seq, true);
  }
  return overdue;
}

size_t InFlight::size() const {
  MutexLock lock(&mu_);
  return works_.size();
}

}  // namespace ddp::flight
