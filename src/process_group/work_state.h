// A Work's state (detail::WorkState), apart from the rest of the group's internals
// (process_group/internal.h), so that a transport's pending transfer can read its deadline
// without reaching the group that includes the transport.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <memory>

#include "base/completion.h"
#include "ddp/process_group.h"
#include "process_group/collective.h"
#include "process_group/flight_recorder.h"
#include "process_group/hang_report.h"
#include "process_group/transport/transport.h"

namespace ddp {

// Note [Work completion]
// A c10d work finishes its network part on a backend thread. Some of our operations need a
// local step afterwards (divide for kAvg on Gloo, sum the received chunks of a reduce_scatter).
// That step runs exactly once, in the first wait() (a Completion, src/base/completion.h); later
// waits return at once or rethrow the stored error. ddp::Future is built on the same primitive.
struct detail::WorkState {
  // Constant after construction.
  CollectiveDesc call;  // what it is, and its sequence number
  int rank = 0;
  std::chrono::milliseconds timeout{0};
  std::chrono::steady_clock::time_point issued;
  std::shared_ptr<Pending> pending;  // the transport's transfer; null: nothing to wait for
  std::function<void()> then;        // local completion step; may be empty; run by `done` only
  std::shared_ptr<flight::Ring> recorder;      // the group's (may be null)
  std::shared_ptr<HangReporter> reporter;      // the group's (may be null)
  std::shared_ptr<flight::InFlight> inflight;  // the group's: where a work on a stream goes

  Completion done;
};

// `error` (the failure of the collective of `s`), opened by the group's hang-report verdict
// when it has one (Note [Hang reports]); `error` itself otherwise.
std::exception_ptr explain_failure(const detail::WorkState& s, std::exception_ptr error);

}  // namespace ddp
