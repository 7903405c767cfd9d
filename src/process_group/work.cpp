// Work: waiting on a collective and turning c10d failures into errors that carry the evidence.
#include <fmt/format.h>

#include <thread>

#include "base/check.h"
#include "ddp/error.h"
#include "process_group/internal.h"

namespace ddp {
namespace {

bool looks_like_timeout(const std::string& what) {
  for (const char* needle : {"Timed out", "timed out", "Timeout", "timeout"}) {
    if (what.find(needle) != std::string::npos) return true;
  }
  return false;
}

// How long a Gloo wait sleeps between looks at this host's peers (Note [Hang reports]).
constexpr std::chrono::seconds kPeerCheckInterval{1};

// `error` (a ddp::Error) with `head` as its first line and `tail` after it, same type.
std::exception_ptr reworded(std::exception_ptr error, const std::string& head,
                            const std::string& tail) {
  auto text = [&](const std::exception& e) {
    return head.empty() ? std::string(e.what()) + "\n" + tail
                        : head + "\n" + e.what() + "\n" + tail;
  };
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError& e) {
    return std::make_exception_ptr(TimeoutError(text(e)));
  } catch (const CollectiveError& e) {
    return std::make_exception_ptr(CollectiveError(text(e)));
  } catch (const Error& e) {
    return std::make_exception_ptr(Error(text(e)));
  } catch (...) {
    return error;
  }
}

// Waits for a c10d work for up to the group's timeout. With a reporter, in slices, looking at
// this host's peers in between: a stopped or vanished peer fails the wait at once.
void wait_c10d(detail::WorkState& s) {
  if (!s.reporter) {
    s.work->wait(s.timeout);
    return;
  }
  const auto start = std::chrono::steady_clock::now();
  while (true) {
    const auto left = s.timeout - std::chrono::duration_cast<std::chrono::milliseconds>(
                                      std::chrono::steady_clock::now() - start);
    try {
      s.work->wait(std::max(std::chrono::milliseconds(1),
                            std::min<std::chrono::milliseconds>(left, kPeerCheckInterval)));
      return;
    } catch (...) {
      // Either the collective failed, or only this slice of waiting ended.
      if (s.work->isCompleted() || left <= kPeerCheckInterval) throw;
    }
    const std::string peer = s.reporter->check_local_peers();
    DDP_CHECK(peer.empty(), CollectiveError,
              "[rank {}] {} #{} ({}) failed: {}; this rank stopped waiting for it after {:.1f} "
              "s (the timeout is {:.1f} s).",
              s.rank, s.op, s.seq, s.detail, peer,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(),
              std::chrono::duration<double>(s.timeout).count());
  }
}

std::exception_ptr classify(const detail::WorkState& s, const std::string& cause) {
  using namespace std::chrono;
  const double elapsed = duration<double>(steady_clock::now() - s.issued).count();
  const double limit = duration<double>(s.timeout).count();
  if (looks_like_timeout(cause) || elapsed >= limit) {
    return std::make_exception_ptr(TimeoutError(fmt::format(
        "[rank {}] {} #{} ({}) timed out after {:.1f} s (limit {:.1f} s): {}. A peer rank has "
        "not reached this collective: it may be stuck, dead, or issuing collectives in a "
        "different order. If the work is legitimately slow, raise DDP_COLLECTIVE_TIMEOUT or "
        "InitOptions::timeout.",
        s.rank, s.op, s.seq, s.detail, elapsed, limit, cause)));
  }
  return std::make_exception_ptr(CollectiveError(fmt::format(
      "[rank {}] {} #{} ({}) failed: {}. A peer rank has probably exited or crashed: look for "
      "its own error (ddprun prints a root-cause summary).",
      s.rank, s.op, s.seq, s.detail, cause)));
}

}  // namespace

std::exception_ptr explain_failure(const detail::WorkState& s, std::exception_ptr error) {
  if (!s.reporter) return error;
  const HangReporter::Report report = s.reporter->explain(s.seq);
  if (report.verdict.empty() && report.details.empty()) return error;
  bool timed_out = false;
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError&) {
    timed_out = true;
  } catch (...) {
  }
  const std::string head = report.verdict.empty()
                               ? ""
                               : fmt::format("[rank {}] {} #{} {}: {}", s.rank, s.op, s.seq,
                                             timed_out ? "timed out" : "failed", report.verdict);
  return reworded(error, head, report.details);
}

Work::Work() = default;
Work::~Work() = default;
Work::Work(const Work&) = default;
Work& Work::operator=(const Work&) = default;
Work::Work(Work&&) noexcept = default;
Work& Work::operator=(Work&&) noexcept = default;
Work::Work(std::shared_ptr<detail::WorkState> state) : state_(std::move(state)) {}

void Work::wait() {
  if (!state_) throw Error("ddp::Work::wait() on an empty Work (it was never issued)");
  detail::WorkState& s = *state_;
  s.done.run(
      [&s] {
        if (s.shm_op) {
          s.shm_group->wait(*s.shm_op);  // bounded inside, with errors that say who is behind
        } else if (s.work) {
          // Gloo enforces the timeout itself; the bound here covers backends that do not.
          wait_c10d(s);
        }
        if (s.then) {
          auto then = std::move(s.then);
          then();
        }
        if (s.recorder) s.recorder->finish(s.seq, true);
      },
      [&s](std::exception_ptr e) {
        std::exception_ptr error;
        try {
          std::rethrow_exception(e);
        } catch (const Error&) {
          error = e;  // already names rank, op and cause
        } catch (const c10::Error& x) {
          error = classify(s, x.what_without_backtrace());  // c10d's backtrace helps nobody
        } catch (const std::exception& x) {
          error = classify(s, x.what());
        } catch (...) {
          error = classify(s, "unknown exception");
        }
        if (s.recorder) s.recorder->finish(s.seq, false);
        return explain_failure(s, error);
      });
}

bool Work::is_completed() const {
  if (!state_) return false;
  if (state_->done.finished()) return true;
  if (state_->shm_op) return state_->shm_op->done.load();
  return !state_->work || state_->work->isCompleted();
}

std::string Work::description() const {
  if (!state_) return "(empty work)";
  return fmt::format("{} #{} ({})", state_->op, state_->seq, state_->detail);
}

}  // namespace ddp
