// DistributedSampler: which dataset indices this rank draws in each epoch.
//
//   ddp::DistributedSampler sampler(dataset.size(), {.shuffle = true, .seed = 0});
//   ddp::DataLoader loader(dataset, sampler, {.batch_size = 64});  // shares the sampler
//   for (int64_t epoch = start; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);          // takes effect in `loader` (see Note [Shared cursor])
//     for (auto& batch : loader) ...
//   }
//
// Contract: for the same (dataset size, num_replicas, rank, shuffle, seed, epoch, drop_last),
// indices() is exactly the list PyTorch's Python torch.utils.data.DistributedSampler yields:
//   1. shuffle: torch.randperm(n, generator=g) with g.manual_seed(seed + epoch) (the same
//      LibTorch kernel and generator, so the permutation is bit for bit Python's); else 0..n-1.
//   2. keep all (drop_last=false): num_samples = ceil(n / R); the list is padded to
//      R * num_samples by repeating its head (cyclically when the padding exceeds n, e.g. n=3
//      over R=5), so a few samples appear twice in an epoch.
//      drop_last=true: num_samples = floor(n / R) (Python's ceil((n - R) / R)); the tail of the
//      permuted list is dropped (different samples each epoch). With n < R that is 0 samples.
//   3. rank r takes the strided shard list[r::R].
// Verified against Python in tests/unit/test_sampler.cpp.
//
// Evaluation (`pad = false`, not in Python): no padding and no truncation; rank r gets
// list[r::R], so ranks may differ by one sample and every sample is counted exactly once
// (see ddp/metrics.h). Training must not use it: DDP needs the same batch count on every rank.
//
// Note [Shared cursor]
// A DistributedSampler is a handle, like at::Tensor: copies share one state (epoch and
// position). The loader keeps a copy, so set_epoch() on your object is what the loader sees at
// its next begin(); LibTorch's own loader copies its sampler by value, so set_epoch() after
// make_data_loader() silently changes nothing there (pytorch#73141). clone() makes an
// independent sampler.
//
// Note [Sampler position and resume]
// The cursor is (epoch, position): position = samples of this epoch this rank has already
// consumed (a loader advances it as it hands out batches). state() captures it with the world
// size; every rank consumes in lockstep, so rank 0's state describes all ranks, and a checkpoint
// saves that one. After load_state():
//   * same world size: rank r continues at element `position` of its shard: the rest of the
//     epoch is exactly what the uninterrupted run would have drawn (no repeat, no skip).
//   * different world size: the ranks consumed, together, a prefix of the epoch's permuted list
//     of length consumed() = offset + position * old_replicas (capped at n; offset is 0 unless
//     that run was itself resumed at another world size). The new ranks split the rest
//     of the permutation, list[consumed()..n), exactly as above (strided; padded or dropped by
//     drop_last), as if it were a dataset of that size. So every sample of the epoch is drawn
//     exactly once overall, except the padding: if the rest does not divide by the new world
//     size, its first few samples are drawn twice (drop_last=true: its last few not at all),
//     just as in any epoch. The order of the rest differs from the uninterrupted run's order
//     (a shard of a different world size cannot match it). The next set_epoch() returns to
//     the plain Python sequence.
// set_epoch(e) with e != epoch() restarts at position 0; with e == epoch() it keeps the
// position (so `load_state(s); set_epoch(s.epoch)` resumes). A pass that runs to the end of the
// epoch leaves position == num_samples(); the next begin_pass() then starts the epoch over (as
// PyTorch repeats the order when set_epoch is not called), except right after load_state(),
// where a finished epoch stays finished (an empty pass). An abandoned pass (break) leaves the
// cursor where it stopped; the next pass continues from there.
//
// Note [Sampler iteration]
// `for (int64_t i : sampler)` (Python's `for i in sampler`) is one pass, made exactly as a
// DataLoader with batch_size 1 makes it (Note [Loader passes] in ddp/data_loader.h):
//   * begin() calls begin_pass(): the loop yields remaining(), the indices of this epoch not
//     consumed yet (a finished epoch starts over first, except right after load_state()). On a
//     fresh sampler, or after set_epoch() to a new epoch, that is all of indices().
//   * Handing out an index (begin() for the first, ++ for each next one) advances position()
//     by 1, so the index in your hands counts as consumed: state() taken in the loop body, after
//     the step that used it, is exact for a checkpoint. A loop that runs to the end leaves
//     position() == num_samples(); one left early (break) leaves the position after the last
//     index handed out, and the next loop continues from there.
//   * Copies share the cursor (Note [Shared cursor]): run one pass at a time over a sampler and
//     the loaders that share it. A pass that would move the position past num_samples() (two
//     interleaved passes) throws ddp::ConfigError. set_epoch() to another epoch in the middle
//     of a loop: the loop finishes its snapshot of the old epoch and leaves the new epoch's
//     cursor alone (as the loader does).
// To read the order without consuming it, use indices() or remaining() (both const).
//
// Thread-safety: all methods are safe to call from any thread (one mutex inside); an Iterator
// belongs to one thread. Errors: bad arguments are ddp::ConfigError naming the value and the
// fix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <memory>
#include <optional>
#include <vector>

namespace ddp {

struct SamplerOptions {
  // Unset: the default process group's world size and rank (1 and 0 before
  // init_process_group()). Set both to shard over an explicit ProcessGroup.
  std::optional<int> num_replicas;
  std::optional<int> rank;
  bool shuffle = true;     // permute with seed + epoch; false: 0, 1, ..., n-1
  uint64_t seed = 0;       // PyTorch's default; must be the same on every rank
  bool drop_last = false;  // false: pad to a multiple of num_replicas; true: drop the tail
  bool pad = true;         // false: evaluation mode (uneven shards, no duplicates)
};

// A checkpointable cursor (see Note [Sampler position and resume]). Plain values, so the
// trainer can store them in any checkpoint format.
struct SamplerState {
  int64_t epoch = 0;
  int64_t position = 0;      // samples of this epoch already consumed by each rank
  int64_t num_replicas = 1;  // world size when saved
  // Leading samples of the epoch's permuted list consumed before the current shard plan began:
  // 0, unless this epoch was itself resumed at a different world size.
  int64_t offset = 0;
  // What the state is valid for; load_state() checks them.
  int64_t dataset_size = 0;
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;
  bool pad = true;

  // Samples of the epoch's permuted list consumed by all ranks together (a prefix of it).
  int64_t consumed() const;
};

class DistributedSampler {
 public:
  // Throws ddp::ConfigError for dataset_size <= 0, num_replicas <= 0, rank outside
  // [0, num_replicas), or pad=false together with drop_last=true.
  explicit DistributedSampler(int64_t dataset_size, SamplerOptions options = {});

  // Selects the epoch (the shuffle seed is seed + epoch). See the Note for the position.
  void set_epoch(int64_t epoch);
  int64_t epoch() const;

  // This rank's full list for the current epoch (Python's list(iter(sampler))).
  std::vector<int64_t> indices() const;
  // The part of indices() not consumed yet: indices()[position:].
  std::vector<int64_t> remaining() const;
  // Its first `at_most` indices: the next batch of a loop that reads the sampler by hand, as
  // under ft::Manager (the epoch's list is drawn once, so a call per step costs O(at_most)).
  std::vector<int64_t> remaining(int64_t at_most) const;
  // Starts a pass (what a loader calls at begin()) and returns remaining(); restarts a finished
  // epoch first, as described in the Note.
  std::vector<int64_t> begin_pass();
  // Marks `count` more samples of this epoch consumed (a loader calls it per batch handed out;
  // call it yourself when you iterate indices() by hand). Throws past num_samples().
  void advance(int64_t count);

  // One pass over remaining(), advancing the cursor per index handed out (Note [Sampler
  // iteration]): `for (int64_t i : sampler)`. A C++20 input range (single pass, move-only
  // iterator), so std::ranges algorithms accept it.
  class Iterator;
  struct Sentinel {};
  Iterator begin();
  Sentinel end() const { return {}; }

  // Length of indices() (Python's len(sampler)); with pad=false it depends on the rank.
  int64_t num_samples() const;
  int64_t position() const;
  int64_t dataset_size() const;
  int num_replicas() const;
  int rank() const;
  SamplerOptions options() const;  // num_replicas and rank filled in
  // This rank becomes `rank` of `num_replicas` mid-epoch, in place (a group re-formed by
  // ddp::ft::Manager, Note [Per-step fault tolerance]): the samples of the epoch consumed so far
  // (consumed()) stay consumed, and the new ranks split the rest as load_state() would at the
  // new size (Note [Sampler position and resume]): another size splits the rest of the
  // permutation; the same size goes on in the same shards, rank r taking shard r's rest. Every
  // rank of the new group reshards from the same state. Not while a pass (a loader) is drawing
  // from it.
  void reshard(int num_replicas, int rank);

  SamplerState state() const;
  // Throws ddp::ConfigError when the state belongs to another dataset size, seed, shuffle,
  // drop_last or pad, or is inconsistent (position beyond that epoch's num_samples).
  void load_state(const SamplerState& state);

  // An independent sampler with the same options and cursor.
  DistributedSampler clone() const;

 private:
  struct Shared;
  explicit DistributedSampler(std::shared_ptr<Shared> shared);
  std::shared_ptr<Shared> shared_;  // never null; copies share it (Note [Shared cursor])
};

// A single-pass input iterator over one pass's indices; move-only, because each index handed
// out moves the shared cursor once. Default-constructed, it is at the end.
class DistributedSampler::Iterator {
 public:
  using value_type = int64_t;
  using difference_type = std::ptrdiff_t;
  using iterator_concept = std::input_iterator_tag;

  Iterator() = default;
  Iterator(Iterator&&) noexcept = default;
  Iterator& operator=(Iterator&&) noexcept = default;
  Iterator(const Iterator&) = delete;
  Iterator& operator=(const Iterator&) = delete;

  int64_t operator*() const;  // the index in hand (already counted as consumed)
  Iterator& operator++();     // hands out the next index: position() + 1
  void operator++(int) { ++*this; }
  friend bool operator==(const Iterator& it, Sentinel) { return it.next_ >= it.indices_.size(); }

 private:
  friend class DistributedSampler;
  void hand_out();  // counts indices_[next_] as consumed (when the epoch is still ours)

  std::shared_ptr<Shared> shared_;  // null when default-constructed
  std::vector<int64_t> indices_;    // this pass's snapshot: remaining() at begin()
  size_t next_ = 0;                 // the index in hand; == indices_.size() at the end
  int64_t epoch_ = 0;               // the epoch the pass belongs to
};

// The pure rule, exposed for tests and for code that shards without a sampler object: rank's
// shard of the epoch permutation `order` (size n) after skipping its first `offset` entries.
std::vector<int64_t> shard_indices(const std::vector<int64_t>& order, int64_t offset,
                                   int num_replicas, int rank, bool drop_last, bool pad);
// The permutation of one epoch: Python's randperm(n, generator seeded seed + epoch), or 0..n-1.
std::vector<int64_t> epoch_order(int64_t n, bool shuffle, uint64_t seed, int64_t epoch);

}  // namespace ddp
