#include "preemption.h"

#include <signal.h>

#include <atomic>

namespace ddp::train {
namespace {

// Written by the signal handler: lock-free, so async-signal-safe.
std::atomic<bool> g_requested{false};
static_assert(std::atomic<bool>::is_always_lock_free);
struct sigaction g_previous;

void on_sigterm(int) { g_requested.store(true, std::memory_order_relaxed); }

}  // namespace

PreemptionWatch::PreemptionWatch() {
  g_requested.store(false);
  struct sigaction sa {};
  sa.sa_handler = on_sigterm;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART | SA_RESETHAND;  // one-shot: a second SIGTERM kills
  sigaction(SIGTERM, &sa, &g_previous);
}

PreemptionWatch::~PreemptionWatch() { sigaction(SIGTERM, &g_previous, nullptr); }

bool PreemptionWatch::requested() const { return g_requested.load(std::memory_order_relaxed); }

}  // namespace ddp::train
