// Work: waiting on a collective and turning c10d failures into errors that carry the evidence.
#include <fmt/format.h>

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

std::exception_ptr classify(const Work::State& s, const std::string& cause) {
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

Work::Work() = default;
Work::~Work() = default;
Work::Work(const Work&) = default;
Work& Work::operator=(const Work&) = default;
Work::Work(Work&&) noexcept = default;
Work& Work::operator=(Work&&) noexcept = default;
Work::Work(std::shared_ptr<State> state) : state_(std::move(state)) {}

void Work::wait() {
  if (!state_) throw Error("ddp::Work::wait() on an empty Work (it was never issued)");
  State& s = *state_;
  s.done.run(
      [&s] {
        if (s.shm_op) {
          s.shm_group->wait(*s.shm_op);  // bounded inside, with errors that say who is behind
        } else if (s.work) {
          // Gloo enforces the timeout itself; the bound here covers backends that do not.
          s.work->wait(s.timeout);
        }
        if (s.then) {
          auto then = std::move(s.then);
          then();
        }
      },
      [&s](std::exception_ptr e) {
        try {
          std::rethrow_exception(e);
        } catch (const Error&) {
          return e;  // already names rank, op and cause
        } catch (const std::exception& x) {
          return classify(s, x.what());
        } catch (...) {
          return classify(s, "unknown exception");
        }
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
