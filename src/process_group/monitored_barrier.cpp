// ProcessGroup::monitored_barrier: a barrier through the store that names the absent ranks.
//
// Keys (under the group's prefix): "monitored_barrier/<n>/arrived/<rank>" for each rank but 0,
// and "monitored_barrier/<n>/release", which rank 0 sets to "ok" or to its error. n counts this
// group's monitored barriers, so every rank's n-th call meets the others' n-th.
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include <thread>

#include "base/check.h"
#include "process_group/internal.h"
#include "process_group/store_exchange.h"

namespace ddp {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

using store_exchange::bytes_of;
using store_exchange::text_of;
// How much longer than the timeout ranks other than 0 wait for rank 0's release (which may say
// that some rank did not arrive).
constexpr std::chrono::seconds kReleaseGrace{2};

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Polls until `ready()` or the deadline; the sleep grows from 1 ms to 50 ms.
template <typename Ready>
bool poll_until(Clock::time_point deadline, Ready&& ready) {
  milliseconds backoff(1);
  while (!ready()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, milliseconds(50));
  }
  return true;
}

}  // namespace

void ProcessGroup::monitored_barrier(std::optional<milliseconds> timeout) {
  detail::ProcessGroupImpl& pg = detail::impl_of(*this);
  const int me = pg.env.rank;
  const int n = pg.env.world_size;
  const milliseconds limit = timeout.value_or(pg.timeout);
  DDP_CHECK(limit.count() > 0, Error, "[rank {}] monitored_barrier: the timeout must be positive",
            me);
  if (n == 1) return;
  const uint64_t number = ++pg.monitored_barriers;
  const std::string base = fmt::format("monitored_barrier/{}/", number);
  ::c10d::Store& store = *pg.diag_store;
  const auto start = Clock::now();
  const auto deadline = start + limit;
  try {
    if (me != 0) {
      store.set(fmt::format("{}arrived/{}", base, me), bytes_of("1"));
      // Rank 0 answers at its own deadline at the latest: wait a little longer for that answer.
      const bool released =
          poll_until(deadline + kReleaseGrace, [&] { return store.check({base + "release"}); });
      DDP_CHECK(released, TimeoutError,
                "[rank {}] monitored_barrier #{}: rank 0 did not release it within {:.1f} s; "
                "rank 0 has not reached this barrier (it may be stuck, stopped or dead).",
                me, number, seconds(limit));
      const std::string verdict = text_of(store.get(base + "release"));
      DDP_CHECK(verdict == "ok", TimeoutError,
                "[rank {}] monitored_barrier #{} failed on rank 0: {}", me, number, verdict);
      return;
    }
    std::vector<int> missing;
    for (int r = 1; r < n; ++r) missing.push_back(r);
    poll_until(deadline, [&] {
      std::erase_if(missing,
                    [&](int r) { return store.check({fmt::format("{}arrived/{}", base, r)}); });
      return missing.empty();
    });
    if (missing.empty()) {
      store.set(base + "release", bytes_of("ok"));
      return;
    }
    const std::string verdict =
        fmt::format("rank{} {} did not arrive within {:.1f} s ({} of {} ranks arrived)",
                    missing.size() > 1 ? "s" : "", fmt::join(missing, ", "), seconds(limit),
                    n - static_cast<int>(missing.size()), n);
    store.set(base + "release", bytes_of(verdict));
    throw TimeoutError(fmt::format(
        "[rank 0] monitored_barrier #{}: {}\nThe missing ranks are stuck before the barrier, "
        "stopped or dead, or run a different sequence of calls.",
        number, verdict));
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    throw CollectiveError(
        fmt::format("[rank {}] monitored_barrier #{}: the store did not answer after {:.1f} s: {}",
                    me, number, seconds(Clock::now() - start), e.what()));
  }
}

}  // namespace ddp
