// Errors a rank raises only because another rank failed and told it so.
//
// Some failures happen on one rank and are announced to the others: rank 0 cannot write a
// checkpoint and broadcasts that it failed, a rank cannot load one and the others learn it by
// all_gather. Every rank then fails, at about the same moment, and each records its error for
// the launcher (record_error). The launcher blames the earliest record, so without a mark the
// announcing rank can lose that race to a rank that merely repeats the news. A relayed error
// carries the rank it came from; record_error writes it as extraInfo.relayed_from, and ddprun's
// summary names that rank as the root cause.
#pragma once

#include <exception>
#include <optional>
#include <string>
#include <string_view>

namespace ddp {

// The mark: mixed into an error type by Relayed<E>.
class RelayedFrom {
 public:
  explicit RelayedFrom(int origin_rank) : origin_rank_(origin_rank) {}
  virtual ~RelayedFrom() = default;
  // The rank whose own failure this error reports.
  int origin_rank() const { return origin_rank_; }

 private:
  int origin_rank_;
};

// An E (CheckpointError, CollectiveError...) that reports rank `origin_rank`'s failure: catch
// it as an E, as before.
template <class E>
class Relayed : public E, public RelayedFrom {
 public:
  Relayed(int origin_rank, const std::string& message) : E(message), RelayedFrom(origin_rank) {}
};

// The rank `e` was relayed from; nullopt for an error of this rank's own.
std::optional<int> relayed_from(const std::exception& e);

// record_error (ddp/error.h) for an exception: its message, plus "relayed_from": <rank> in
// extraInfo when it is relayed. Never throws.
void record_error(const std::exception& e);

// The same with the origin given: nullopt writes the plain record of record_error(message).
void record_error(std::string_view message, std::optional<int> relayed_from_rank);

}  // namespace ddp
