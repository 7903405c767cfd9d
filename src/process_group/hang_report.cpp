// Hang reports (Note [Hang reports] in hang_report.h).
#include "process_group/hang_report.h"

#include <unistd.h>  // getpid

#include <cstdio>
#include <filesystem>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <nlohmann/json.hpp>

#include "base/proc_stat.h"           // own_start_time
#include "process_group/shm/group.h"  // kStoppedLimit
#include "process_group/shm_setup.h"  // host_identity
#include "process_group/store_exchange.h"

namespace ddp {
namespace {

using Clock = std::chrono::steady_clock;

using store_exchange::bytes_of;
using store_exchange::text_of;

std::string records_key(int rank) { return fmt::format("records/{}", rank); }

// The file publish() writes a rank's records to; `rank` is "<R>" where a message names every
// rank's.
std::string dump_file_name(const std::string& group, const std::string& rank) {
  return group == "default" ? fmt::format("flight_recorder_rank{}.json", rank)
                            : fmt::format("flight_recorder_{}_rank{}.json", group, rank);
}

}  // namespace

HangReporter::HangReporter(c10::intrusive_ptr<::c10d::Store> store,
                           std::shared_ptr<flight::Ring> ring, Options options)
    : o_(std::move(options)), ring_(std::move(ring)), host_(host_identity()),
      store_(std::move(store)) {
  try {
    // The pid with its start time names this process even after its pid is reused.
    store_->set(fmt::format("who/{}", o_.rank),
                bytes_of(fmt::format("{} {} {}", getpid(), own_start_time(), host_)));
  } catch (const std::exception&) {
    // Diagnostics never fail a job: peers will not know this rank's pid.
  }
  watcher_ = std::thread([this] { watch(); });
}

HangReporter::~HangReporter() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  wake_.signal_all();
  watcher_.join();
}

void HangReporter::watch() {
  while (true) {
    {
      MutexLock lock(&mu_);
      if (stopping_ || published_) return;
      wake_.wait_for(kWatchInterval);
      if (stopping_ || published_) return;
    }
    bool asked = false;
    try {
      MutexLock store_lock(&store_mu_);
      asked = store_->check({"dump"});
    } catch (const std::exception&) {
      return;  // the store is gone (its host exited): nobody can ask any more
    }
    if (asked) publish("");
  }
}

void HangReporter::publish(const std::string& verdict, bool left) {
  {
    MutexLock lock(&mu_);
    if (published_ && verdict.empty() && !left) return;
    published_ = true;
  }
  nlohmann::json doc = {{"rank", o_.rank},
                        {"pid", getpid()},
                        {"host", host_},
                        {"group", o_.group},
                        {"step", flight::current_step()},
                        {"records", flight::to_json(ring_->snapshot())}};
  if (!verdict.empty()) doc["verdict"] = verdict;
  if (left) doc["left"] = true;
  const std::string json = doc.dump();
  try {
    MutexLock store_lock(&store_mu_);
    store_->set(records_key(o_.rank), bytes_of(json));
  } catch (const std::exception&) {
    // The store may be what failed; the dump file still tells.
  }
  if (o_.dump_dir.empty() || left) return;
  const std::string path =
      (std::filesystem::path(o_.dump_dir) / dump_file_name(o_.group, std::to_string(o_.rank)))
          .string();
  const std::string tmp = path + ".tmp";
  if (FILE* f = std::fopen(tmp.c_str(), "w")) {
    const std::string pretty = doc.dump(1);
    const bool ok = std::fwrite(pretty.data(), 1, pretty.size(), f) == pretty.size();
    if (std::fclose(f) == 0 && ok) std::rename(tmp.c_str(), path.c_str());
  }
}

std::vector<HangReporter::Peer> HangReporter::peers() {
  std::vector<Peer> found;
  {
    MutexLock lock(&mu_);
    if (peers_.empty()) peers_.resize(o_.size);
    if (peers_store_failed_) return peers_;
    found = peers_;
  }
  // A peer is asked for until its record is there: it may form its group after our first look.
  bool failed = false;
  for (int r = 0; r < o_.size; ++r) {
    if (r == o_.rank || found[r].known) continue;
    try {
      MutexLock store_lock(&store_mu_);
      const std::string key = fmt::format("who/{}", r);
      if (!store_->check({key})) continue;
      std::istringstream in(text_of(store_->get(key)));
      Peer& p = found[r];
      std::string host;
      in >> p.pid >> p.start_time;
      std::getline(in >> std::ws, host);
      p.local = host == host_ && p.pid != getpid();  // a thread-rank of this process: not local
      p.known = true;
    } catch (const std::exception&) {
      failed = true;  // the store does not answer: what is known so far, and no more asking
      break;
    }
  }
  MutexLock lock(&mu_);
  peers_store_failed_ = peers_store_failed_ || failed;
  for (int r = 0; r < o_.size; ++r) {
    if (found[r].known) peers_[r] = found[r];
  }
  return peers_;
}

std::string HangReporter::check_local_peers() {
  const std::vector<Peer> all = peers();
  const auto now = Clock::now();
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (!all[r].local) continue;
    const flight::Liveness state = flight::process_state(all[r].pid, all[r].start_time);
    if (state == flight::Liveness::kGone) {
      return fmt::format("rank {} (pid {}) has exited", r, all[r].pid);
    }
    MutexLock lock(&mu_);
    if (state != flight::Liveness::kStopped) {
      stopped_since_.erase(r);
      continue;
    }
    const auto since = stopped_since_.try_emplace(r, now).first->second;
    if (now - since >= shm::kStoppedLimit) {
      return fmt::format(
          "rank {} (pid {}) is stopped (SIGSTOP or a debugger) and has not run "
          "for {:.1f} s",
          r, all[r].pid, std::chrono::duration<double>(now - since).count());
    }
  }
  return "";
}

HangReporter::Report HangReporter::explain(uint64_t seq) {
  {
    MutexLock lock(&mu_);
    if (explained_) return {};
    explained_ = true;
  }
  Report report;
  try {
    const std::vector<flight::Record> mine = ring_->snapshot();
    flight::Record failed;
    for (const flight::Record& r : mine) {
      if (r.call.seq == seq) failed = r;
    }
    if (failed.call.seq == 0) return report;  // overwritten: nothing to compare
    publish("");  // our records first, so that peers explaining the same failure see them
    std::string store_trouble;
    try {
      MutexLock store_lock(&store_mu_);
      store_->set("dump", bytes_of(std::to_string(o_.rank)));
    } catch (const std::exception& e) {
      store_trouble = e.what();
    }
    const std::vector<Peer> who = peers();
    std::vector<flight::PeerView> views;
    for (int r = 0; r < o_.size; ++r) {
      if (r == o_.rank) continue;
      flight::PeerView v;
      v.rank = r;
      v.pid = who[r].pid;
      if (who[r].local) v.liveness = flight::process_state(who[r].pid, who[r].start_time);
      views.push_back(std::move(v));
    }
    // Gather until every peer that can answer did, or the deadline.
    const auto deadline = Clock::now() + o_.answer_deadline;
    while (store_trouble.empty()) {
      bool waiting = false;
      for (flight::PeerView& v : views) {
        if (v.records || v.liveness == flight::Liveness::kStopped ||
            v.liveness == flight::Liveness::kGone) {
          continue;
        }
        try {
          MutexLock store_lock(&store_mu_);
          if (store_->check({records_key(v.rank)})) {
            const auto doc = nlohmann::json::parse(text_of(store_->get(records_key(v.rank))));
            v.records = flight::records_from_json(doc);
            v.left = doc.value("left", false);
          } else {
            waiting = true;
          }
        } catch (const nlohmann::json::exception& e) {
          v.silence = fmt::format("sent records that do not parse ({})", e.what());
        } catch (const std::invalid_argument& e) {  // records_from_json: an unknown name
          v.silence = fmt::format("sent records that do not parse ({})", e.what());
        } catch (const std::exception& e) {
          store_trouble = e.what();
          break;
        }
      }
      if (!waiting || Clock::now() >= deadline) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    std::vector<int> unasked;
    for (flight::PeerView& v : views) {
      if (v.records || !v.silence.empty()) continue;
      v.asked = store_trouble.empty();
      if (!v.asked) unasked.push_back(v.rank);
      v.silence = v.asked ? fmt::format("did not answer within {:g} s",
                                        std::chrono::duration<double>(o_.answer_deadline).count())
                          : "could not be asked: the store did not answer";
    }
    report.verdict = flight::verdict(o_.rank, failed, views);
    report.details = "flight recorder, per rank:\n" + flight::table(o_.rank, mine, views);
    if (!unasked.empty()) {
      // Said once, not once per rank: the store's silence is one fact about the job.
      const std::string why = store_trouble.substr(0, store_trouble.find('\n'));
      report.details += fmt::format("  (the store: {})\n", why);
      if (report.verdict.empty()) {
        report.verdict = fmt::format(
            "no peer could be asked for its records (rank{} {}): the rendezvous store did not "
            "answer, so the process hosting it has exited or the network to it is down",
            unasked.size() > 1 ? "s" : "", fmt::join(unasked, ", "));
      }
    }
    if (!report.verdict.empty()) publish(report.verdict);  // the dump file carries it too
    if (!o_.dump_dir.empty()) {
      report.details +=
          fmt::format("  (each rank's records: {} in its log folder; this rank's in {})\n",
                      dump_file_name(o_.group, "<R>"), o_.dump_dir);
    }
  } catch (const std::exception& e) {
    report.details = fmt::format("flight recorder: no report ({})\n", e.what());
  }
  return report;
}

}  // namespace ddp
