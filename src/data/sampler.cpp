// DistributedSampler (see include/ddp/sampler.h): Python's rule, a shared cursor, resume.
#include "ddp/sampler.h"

#include <algorithm>
#include <limits>

#include <ATen/CPUGeneratorImpl.h>  // at::CPUGeneratorImpl, the generator behind torch.Generator()
#include <ATen/ops/randperm.h>      // at::randperm, the kernel torch.randperm calls

#include "base/check.h"
#include "base/thread_annotations.h"  // Mutex, GUARDED_BY
#include "ddp/distributed.h"  // get_world_size, get_rank: the defaults for replicas and rank

namespace ddp {
namespace {

// Samples per rank for a plan over m remaining samples (Python's num_samples when m = n).
int64_t plan_num_samples(int64_t m, int num_replicas, int rank, bool drop_last, bool pad) {
  if (m <= 0) return 0;
  if (drop_last) return m / num_replicas;                              // ceil((m - R) / R) if m % R
  if (pad) return (m + num_replicas - 1) / num_replicas;               // ceil(m / R)
  return m > rank ? (m - rank + num_replicas - 1) / num_replicas : 0;  // |list[r::R]|
}

}  // namespace

int64_t SamplerState::consumed() const {
  const int64_t rest = dataset_size - offset;
  return offset + std::min(position * num_replicas, std::max<int64_t>(rest, 0));
}

std::vector<int64_t> epoch_order(int64_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(n);
  if (!shuffle) {
    for (int64_t i = 0; i < n; ++i) order[i] = i;
    return order;
  }
  // Python: g = torch.Generator(); g.manual_seed(seed + epoch); torch.randperm(n, generator=g).
  // Same generator class, same seeding, same kernel: the same permutation bit for bit.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + static_cast<uint64_t>(epoch));
  const at::Tensor perm = at::randperm(n, gen, at::TensorOptions().dtype(at::kLong));
  const int64_t* p = perm.data_ptr<int64_t>();
  std::copy(p, p + n, order.begin());
  return order;
}

std::vector<int64_t> shard_indices(const std::vector<int64_t>& order, int64_t offset,
                                   int num_replicas, int rank, bool drop_last, bool pad) {
  const int64_t n = static_cast<int64_t>(order.size());
  DDP_ASSERT(offset >= 0 && offset <= n, "offset {} of {}", offset, n);
  const int64_t m = n - offset;  // the plan covers order[offset..n)
  const int64_t count = plan_num_samples(m, num_replicas, rank, drop_last, pad);
  std::vector<int64_t> out(count);
  // Python pads by repeating the head, cyclically when padding > m: element i of the padded
  // list is rest[i % m]; the truncated (drop_last) list is a prefix, where i < m anyway.
  for (int64_t j = 0; j < count; ++j) out[j] = order[offset + (j * num_replicas + rank) % m];
  return out;
}

// Note [Shared cursor]: every copy of a DistributedSampler points at one Shared.
struct DistributedSampler::Shared {
  // Constant after construction, but for options.num_replicas and options.rank: set under mu
  // by reshard() (read them through R() and r()).
  int64_t n = 0;
  SamplerOptions options;  // num_replicas and rank resolved

  mutable Mutex mu;
  int64_t epoch GUARDED_BY(mu) = 0;
  int64_t position GUARDED_BY(mu) = 0;   // samples of this epoch consumed by this rank
  int64_t offset GUARDED_BY(mu) = 0;     // Note [Sampler position and resume]
  bool restored GUARDED_BY(mu) = false;  // load_state() since the last begin_pass()

  int R() const REQUIRES(mu) { return *options.num_replicas; }
  int r() const REQUIRES(mu) { return *options.rank; }
  int64_t num_samples_locked() const REQUIRES(mu) {
    return plan_num_samples(n - offset, R(), r(), options.drop_last, options.pad);
  }
  // This rank's list, drawn once per epoch and split: a loop that reads remaining() at every
  // step (ft::Manager's, ddp-train --ft) would otherwise draw the epoch's permutation each time
  // (a millisecond at 60,000 samples). Kept: this rank's shard, n / R indices.
  const std::vector<int64_t>& indices_locked() const REQUIRES(mu) {
    if (drawn.epoch != epoch || drawn.offset != offset || drawn.R != R() || drawn.r != r()) {
      drawn = {.epoch = epoch,
               .offset = offset,
               .R = R(),
               .r = r(),
               .indices = shard_indices(epoch_order(n, options.shuffle, options.seed, epoch),
                                        offset, R(), r(), options.drop_last, options.pad)};
    }
    return drawn.indices;
  }

  struct Drawn {  // what indices_locked() drew last, and for which epoch, offset and split
    int64_t epoch = -1, offset = -1;
    int R = 0, r = 0;
    std::vector<int64_t> indices;
  };
  mutable Drawn drawn GUARDED_BY(mu);
};

DistributedSampler::DistributedSampler(std::shared_ptr<Shared> shared)
    : shared_(std::move(shared)) {}

DistributedSampler::DistributedSampler(int64_t dataset_size, SamplerOptions options)
    : shared_(std::make_shared<Shared>()) {
  DDP_CHECK(dataset_size > 0, ConfigError,
            "DistributedSampler: dataset_size is {}; it must be at least 1 (an empty dataset "
            "gives every rank nothing to train on)",
            dataset_size);
  if (!options.num_replicas) options.num_replicas = get_world_size();
  if (!options.rank) options.rank = get_rank();
  const int R = *options.num_replicas;
  const int r = *options.rank;
  DDP_CHECK(R > 0, ConfigError,
            "DistributedSampler: num_replicas is {}; it must be at least 1 (leave it unset to "
            "use the default process group's world size)",
            R);
  DDP_CHECK(r >= 0 && r < R, ConfigError,
            "DistributedSampler: rank {} is outside [0, {}] for num_replicas {}; pass the "
            "group's rank (leave both unset to use the default process group)",
            r, R - 1, R);
  DDP_CHECK(options.pad || !options.drop_last, ConfigError,
            "DistributedSampler: pad=false (evaluation: every sample once, uneven shards) and "
            "drop_last=true (drop the tail) contradict each other; choose one");
  shared_->n = dataset_size;
  shared_->options = options;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  DDP_CHECK(epoch >= 0, ConfigError, "DistributedSampler::set_epoch({}): epochs count from 0",
            epoch);
  MutexLock lock(&shared_->mu);
  if (epoch == shared_->epoch) return;  // keeps a restored position (Note [... and resume])
  shared_->epoch = epoch;
  shared_->position = 0;
  shared_->offset = 0;
  shared_->restored = false;
}

int64_t DistributedSampler::epoch() const {
  MutexLock lock(&shared_->mu);
  return shared_->epoch;
}

std::vector<int64_t> DistributedSampler::indices() const {
  MutexLock lock(&shared_->mu);
  return shared_->indices_locked();
}

std::vector<int64_t> DistributedSampler::remaining() const {
  return remaining(std::numeric_limits<int64_t>::max());
}

std::vector<int64_t> DistributedSampler::remaining(int64_t at_most) const {
  DDP_CHECK(at_most >= 0, ConfigError, "DistributedSampler::remaining({}): a count is at least 0",
            at_most);
  MutexLock lock(&shared_->mu);
  const std::vector<int64_t>& all = shared_->indices_locked();
  const auto from = all.begin() + shared_->position;
  return std::vector<int64_t>(from, from + std::min<int64_t>(at_most, all.end() - from));
}

std::vector<int64_t> DistributedSampler::begin_pass() {
  Shared& s = *shared_;
  MutexLock lock(&s.mu);
  const bool finished = s.position == s.num_samples_locked();
  if (finished && !s.restored) {  // a new pass over a finished epoch: start it over
    s.position = 0;
    s.offset = 0;
  }
  s.restored = false;
  const std::vector<int64_t>& all = s.indices_locked();
  return std::vector<int64_t>(all.begin() + s.position, all.end());
}

void DistributedSampler::advance(int64_t count) {
  MutexLock lock(&shared_->mu);
  const int64_t total = shared_->num_samples_locked();
  DDP_CHECK(count >= 0 && shared_->position + count <= total, ConfigError,
            "DistributedSampler::advance({}): position {} + {} exceeds the {} samples of "
            "epoch {} on rank {}",
            count, shared_->position, count, total, shared_->epoch, shared_->r());
  shared_->position += count;
}

// Note [Sampler iteration]: begin_pass(), then one advance per index handed out.
DistributedSampler::Iterator DistributedSampler::begin() {
  Iterator it;
  it.shared_ = shared_;
  it.epoch_ = epoch();
  it.indices_ = begin_pass();
  if (!it.indices_.empty()) it.hand_out();
  return it;
}

int64_t DistributedSampler::Iterator::operator*() const {
  DDP_ASSERT(next_ < indices_.size(), "dereferencing a DistributedSampler iterator at its end");
  return indices_[next_];
}

DistributedSampler::Iterator& DistributedSampler::Iterator::operator++() {
  DDP_ASSERT(next_ < indices_.size(), "incrementing a DistributedSampler iterator at its end");
  ++next_;
  if (next_ < indices_.size()) hand_out();
  return *this;
}

void DistributedSampler::Iterator::hand_out() {
  Shared& s = *shared_;
  MutexLock lock(&s.mu);
  if (s.epoch != epoch_) return;  // set_epoch() mid-pass restarted the cursor: leave it alone
  const int64_t total = s.num_samples_locked();
  DDP_CHECK(s.position < total, ConfigError,
            "DistributedSampler iteration: rank {} already consumed all {} samples of epoch {} "
            "while this pass still had {} to hand out; another pass over the same sampler (a "
            "second loop, or a DataLoader sharing it) ran at the same time; run one pass at a "
            "time",
            s.r(), total, s.epoch, indices_.size() - next_);
  ++s.position;
}

int64_t DistributedSampler::num_samples() const {
  MutexLock lock(&shared_->mu);
  return shared_->num_samples_locked();
}

int64_t DistributedSampler::position() const {
  MutexLock lock(&shared_->mu);
  return shared_->position;
}

int64_t DistributedSampler::dataset_size() const { return shared_->n; }
int DistributedSampler::num_replicas() const {
  MutexLock lock(&shared_->mu);
  return shared_->R();
}
int DistributedSampler::rank() const {
  MutexLock lock(&shared_->mu);
  return shared_->r();
}
SamplerOptions DistributedSampler::options() const {
  MutexLock lock(&shared_->mu);
  return shared_->options;
}

// Note [Sampler position and resume]'s resume at another world size, in place: the new ranks
// split the rest of the epoch's permutation.
void DistributedSampler::reshard(int num_replicas, int rank) {
  DDP_CHECK(num_replicas > 0 && rank >= 0 && rank < num_replicas, ConfigError,
            "DistributedSampler::reshard({}, {}): rank must be in [0, num_replicas) and "
            "num_replicas at least 1",
            num_replicas, rank);
  Shared& s = *shared_;
  MutexLock lock(&s.mu);
  if (num_replicas != s.R()) {  // else the same plan goes on: every shard is at `position`
    SamplerState st;
    st.position = s.position;
    st.num_replicas = s.R();
    st.offset = s.offset;
    st.dataset_size = s.n;
    s.offset = st.consumed();
    s.position = 0;
  }
  s.options.num_replicas = num_replicas;
  s.options.rank = rank;
  s.restored = true;
}

SamplerState DistributedSampler::state() const {
  const Shared& s = *shared_;
  MutexLock lock(&s.mu);
  SamplerState st;
  st.epoch = s.epoch;
  st.position = s.position;
  st.num_replicas = s.R();
  st.offset = s.offset;
  st.dataset_size = s.n;
  st.seed = s.options.seed;
  st.shuffle = s.options.shuffle;
  st.drop_last = s.options.drop_last;
  st.pad = s.options.pad;
  return st;
}

void DistributedSampler::load_state(const SamplerState& st) {
  Shared& s = *shared_;
  const SamplerOptions& o = s.options;
  auto mismatch = [&](const char* what, auto saved, auto here) {
    return fmt::format(
        "DistributedSampler::load_state: the state was saved with {} = {}, this "
        "sampler has {}; build the sampler with the options of the run being "
        "resumed (only num_replicas and rank may change)",
        what, saved, here);
  };
  DDP_CHECK(st.dataset_size == s.n, ConfigError, "{}",
            mismatch("dataset_size", st.dataset_size, s.n));
  DDP_CHECK(st.seed == o.seed, ConfigError, "{}", mismatch("seed", st.seed, o.seed));
  DDP_CHECK(st.shuffle == o.shuffle, ConfigError, "{}", mismatch("shuffle", st.shuffle, o.shuffle));
  DDP_CHECK(st.drop_last == o.drop_last, ConfigError, "{}",
            mismatch("drop_last", st.drop_last, o.drop_last));
  DDP_CHECK(st.pad == o.pad, ConfigError, "{}", mismatch("pad", st.pad, o.pad));
  DDP_CHECK(st.epoch >= 0 && st.num_replicas > 0 && st.offset >= 0 && st.offset <= s.n, ConfigError,
            "DistributedSampler::load_state: corrupt state (epoch {}, num_replicas {}, offset "
            "{} of {} samples)",
            st.epoch, st.num_replicas, st.offset, s.n);
  // Rank 0 has the most samples when shards are uneven (pad=false), so it bounds the position.
  const int64_t saved_total =
      plan_num_samples(s.n - st.offset, static_cast<int>(st.num_replicas), 0, st.drop_last, st.pad);
  DDP_CHECK(st.position >= 0 && st.position <= saved_total, ConfigError,
            "DistributedSampler::load_state: position {} is outside [0, {}], the samples per "
            "rank of epoch {} at world size {}: the state is corrupt",
            st.position, saved_total, st.epoch, st.num_replicas);

  MutexLock lock(&s.mu);
  s.epoch = st.epoch;
  if (st.num_replicas == s.R()) {  // same shard plan: continue inside it
    s.offset = st.offset;
    s.position = st.position;
  } else {  // reshard the unconsumed rest of the permutation (Note [Sampler position ...])
    s.offset = st.consumed();
    s.position = 0;
  }
  s.restored = true;
}

DistributedSampler DistributedSampler::clone() const {
  auto copy = std::make_shared<Shared>();
  copy->n = shared_->n;
  copy->options = shared_->options;
  MutexLock lock(&shared_->mu);
  MutexLock copy_lock(&copy->mu);  // not shared yet: never contended
  copy->epoch = shared_->epoch;
  copy->position = shared_->position;
  copy->offset = shared_->offset;
  copy->restored = shared_->restored;
  return DistributedSampler(std::move(copy));
}

}  // namespace ddp
