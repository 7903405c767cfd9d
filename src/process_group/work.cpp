// Work: waiting on a collective and turning c10d failures into errors that carry the evidence.
#include <fmt/format.h>

#include "base/check.h"
#include "ddp/error.h"
#include "process_group/internal.h"

#include <torch/version.h>

namespace ddp {
namespace {

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

// Note [Failure classes]
// A failed wait is a timeout when our own clock says the group's limit has passed since the
// collective was issued (every backend's deadline is that limit, started no earlier), never by
// reading the backend's message (whose words differ between Gloo, NCCL and versions). Anything
// else is a CollectiveError: a peer failed or left. c10d's exception types (2.x:
// c10::DistNetworkError for a broken connection, DistBackendError for a backend's own failure)
// say which, in the text.
std::exception_ptr classify(const detail::WorkState& s, const std::string& cause) {
  using namespace std::chrono;
  const auto elapsed_ms = duration_cast<milliseconds>(steady_clock::now() - s.issued);
  const double elapsed = duration<double>(elapsed_ms).count();
  const double limit = duration<double>(s.timeout).count();
  const bool p2p = s.call.op == Collective::kSend || s.call.op == Collective::kRecv;
  if (elapsed_ms >= s.timeout) {
    const std::string who =
        p2p ? fmt::format(
                  "Rank {} has not posted the matching {} (the same tag): it may be "
                  "stuck, dead, or {} with another tag or rank",
                  s.call.root, s.call.op == Collective::kSend ? "recv" : "send",
                  s.call.op == Collective::kSend ? "receive" : "send")
            : std::string(
                  "A peer rank has not reached this collective: it may be stuck, dead, "
                  "or issuing collectives in a different order");
    return std::make_exception_ptr(TimeoutError(fmt::format(
        "[rank {}] {} timed out after {:.1f} s (limit {:.1f} s): {}. {}. If the work is "
        "legitimately slow, raise DDP_COLLECTIVE_TIMEOUT or InitOptions::timeout.",
        s.rank, s.call.describe(), elapsed, limit, cause, who)));
  }
  return std::make_exception_ptr(CollectiveError(fmt::format(
      "[rank {}] {} failed: {}. A peer rank has probably exited or crashed: look for its own "
      "error (ddprun prints a root-cause summary).",
      s.rank, s.call.describe(), cause)));
}

}  // namespace

std::exception_ptr explain_failure(const detail::WorkState& s, std::exception_ptr error) {
  if (!s.reporter) return error;
  const HangReporter::Report report = s.reporter->explain(s.call.seq);
  if (report.verdict.empty() && report.details.empty()) return error;
  bool timed_out = false;
  try {
    std::rethrow_exception(error);
  } catch (const TimeoutError&) {
    timed_out = true;
  } catch (...) {
  }
  const std::string head =
      report.verdict.empty()
          ? ""
          : fmt::format("[rank {}] {} #{} {}: {}", s.rank, name(s.call.op), s.call.seq,
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
Work::Work(std::shared_ptr<detail::WorkState> state, at::Tensor result)
    : state_(std::move(state)), result_(std::move(result)) {}

void Work::wait() {
  if (!state_) throw Error("ddp::Work::wait() on an empty Work (it was never issued)");
  detail::WorkState& s = *state_;
  s.done.run(
      [&s] {
        if (s.pending) s.pending->wait(s);  // bounded by s.timeout
        const bool on_stream = s.pending && s.pending->on_stream();
        if (on_stream) {
          // Enqueued; the group completes it when its event fires (Note [GPU completion]), and
          // aborts it past the timeout even when the step below fails waiting for it (Note
          // [Staging tensors]).
          if (s.recorder) s.recorder->enqueue(s.call.seq);
          s.inflight->add({s.call, std::chrono::steady_clock::now(),
                           [p = s.pending] { return p->is_completed(); }});
        }
        if (s.then) {
          auto then = std::move(s.then);
          then();
        }
        if (!on_stream && s.recorder) s.recorder->finish(s.call.seq, true);
      },
      [&s](std::exception_ptr e) {
        std::exception_ptr error;
        try {
          std::rethrow_exception(e);
        } catch (const Error&) {
          error = e;  // already names rank, op and cause
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
        } catch (const c10::DistNetworkError& x) {
          error = classify(s, fmt::format("the connection to a peer failed ({})",
                                          x.what_without_backtrace()));
        } catch (const c10::DistBackendError& x) {
          error = classify(s, fmt::format("the backend failed ({})", x.what_without_backtrace()));
#endif
        } catch (const c10::Error& x) {
          error = classify(s, x.what_without_backtrace());  // c10d's backtrace helps nobody
        } catch (const std::exception& x) {
          error = classify(s, x.what());
        } catch (...) {
          error = classify(s, "unknown exception");
        }
        if (s.recorder) s.recorder->finish(s.call.seq, false);
        return explain_failure(s, error);
      });
}

bool Work::is_completed() const {
  if (!state_) return false;
  if (state_->done.finished()) return true;
  return !state_->pending || state_->pending->is_completed();
}

std::string Work::description() const {
  if (!state_) return "(empty work)";
  return state_->call.describe();
}

Future Work::get_future() const {
  DDP_CHECK(state_ != nullptr, Error, "ddp::Work::get_future() on an empty Work");
  return Future(*this, result_);
}

}  // namespace ddp
