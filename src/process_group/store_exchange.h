// Exchanging small values between the ranks of a group through its store.
//
// Note [Store exchange]
// Forming a group is a series of "publish mine, read everyone's" steps over the rendezvous
// store (backend agreement, host identities, the hierarchy's outcome, shm segments and comm
// buffers). exchange() is that step: rank r sets "<key>/<r>", then reads every other rank's
// value (each read bounded by the store's timeout). When some rank may throw on what it read (a
// mismatch every rank detects), the ranks must not leave before all have read: rank 0 may host
// the store, and a peer still reading would then see a closed connection instead of the
// mismatch. Linger::kUntilAllRead adds that: every rank counts itself in "<key>/read", the last
// sets "<key>/all_read", everyone waits for it; rank 0 then waits until every rank has seen it
// ("<key>/done"), at most kLingerLimit (or the store's timeout, when shorter): a rank that has
// seen "all_read" answers at once unless it died, and a dead rank must not hold the group's
// formation for the store's timeout (minutes by default).
// The diagnostics (monitored_barrier, the hang reporter) poll with deadlines of their own and
// name the ranks that did not answer, so they use the value helpers below, not exchange().
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace ddp::store_exchange {

std::vector<uint8_t> bytes_of(std::string_view s);
std::string text_of(const std::vector<uint8_t>& b);

enum class Linger { kNo, kUntilAllRead };
inline constexpr std::chrono::seconds kLingerLimit{2};

// Every rank's value, by rank (`mine` at `rank`). Collective over the `size` ranks sharing
// `key`; throws what the store throws (c10d's timeout when a rank never publishes).
std::vector<std::string> exchange(::c10d::Store& store, const std::string& key, int rank, int size,
                                  const std::string& mine, Linger linger = Linger::kNo);

}  // namespace ddp::store_exchange
