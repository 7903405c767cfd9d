// DataLoader: batches of a Dataset in the order a DistributedSampler gives, prefetched by
// worker threads.
//
//   auto train = std::make_shared<ddp::FashionMnist>(ddp::Split::kTrain);
//   ddp::DistributedSampler sampler(train->size(), {.seed = 42});
//   ddp::DataLoader loader(train, sampler, {.batch_size = 64, .num_workers = 2});
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);               // the loader shares the sampler's cursor
//     for (auto& batch : loader) step(batch.data, batch.target);
//   }
//
// Note [Loader passes]
// Each begin() is one pass: it asks the sampler for the indices still to be drawn this epoch
// (DistributedSampler::begin_pass, so a resumed sampler skips what was consumed), cuts them into
// batches of batch_size in order (the last one smaller unless drop_last), and hands them out in
// that order. Handing out a batch advances the sampler's position by its size, so the sampler's
// state() at any point of the loop is exact for a checkpoint; reaching the end marks the epoch
// finished (including a dropped last batch). The batch in your hands counts as consumed: save a
// checkpoint after its step, not before.
//
// Workers: with num_workers = W > 0, batch k is built by worker k % W, at most
// prefetch_factor * W batches ahead of the consumer (a bounded window). The consumer takes
// batches strictly in order, so the batches and their order do not depend on W (0 builds each
// batch in the calling thread on ++). A failure in a worker (any exception in get_batch) is
// re-thrown in the consumer as ddp::DataError naming the worker, the batch and its indices,
// with the original exception nested (std::rethrow_if_nested recovers it). Leaving the loop
// early (break, an exception) destroys the iterator, which stops the workers and joins them:
// no hang beyond the batches already being built, no thread left behind.
//
// Device: with `device` set to a CUDA device, workers pin each batch (page-locked memory) and
// the consumer copies it with non_blocking=true. It needs a CUDA LibTorch and a visible GPU
// (checked at construction: ddp::ConfigError otherwise). A CPU device (or none) returns the
// dataset's tensors as they are.
//
// Thread-safety: one thread iterates a loader; one pass at a time (begin() while another
// iterator of the same loader is alive throws ddp::ConfigError). The dataset is read from the
// workers concurrently (Dataset::get_batch must be thread-safe).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <type_traits>

#include <c10/core/Device.h>

#include "ddp/dataset.h"
#include "ddp/sampler.h"

namespace ddp {

// Batches each worker may hold ready ahead of the consumer (PyTorch's prefetch_factor).
inline constexpr int kDefaultPrefetchFactor = 2;

struct LoaderOptions {
  int64_t batch_size = 1;  // PyTorch's default; samples per batch (per rank)
  bool drop_last = false;  // drop the last batch of a pass when it is smaller than batch_size
  int num_workers = 0;     // prefetching threads; 0 = build batches in the calling thread
  int prefetch_factor = kDefaultPrefetchFactor;
  // Only without a sampler (the loader then owns a 1-replica one): shuffle with seed + pass
  // number, a new order each full pass.
  bool shuffle = false;
  uint64_t seed = 0;
  // Unset or CPU: batches stay where the dataset keeps them. CUDA: pinned + non_blocking copy.
  std::optional<c10::Device> device;
};

class DataLoader {
 public:
  class Iterator;
  struct Sentinel {};

  // The sampler is shared (Note [Shared cursor]): set_epoch on your copy reaches the loader.
  // Throws ddp::ConfigError for bad options, a sampler over a different dataset size, or a CUDA
  // device that is not available.
  DataLoader(std::shared_ptr<const Dataset> dataset, DistributedSampler sampler,
             LoaderOptions options = {});
  // Every sample of the dataset (no sharding), in order or shuffled per options.
  explicit DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions options = {});

  // Convenience: takes any Dataset by value (tensors are shared, not copied).
  template <class D, class = std::enable_if_t<std::is_base_of_v<Dataset, std::decay_t<D>>>>
  DataLoader(D&& dataset, DistributedSampler sampler, LoaderOptions options = {})
      : DataLoader(std::make_shared<std::decay_t<D>>(std::forward<D>(dataset)), std::move(sampler),
                   std::move(options)) {}

  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  // Starts a pass (Note [Loader passes]) and waits for its first batch.
  Iterator begin();
  Sentinel end() const { return {}; }

  // Batches in a whole pass over the current epoch, from position 0.
  int64_t num_batches() const;
  DistributedSampler& sampler() { return sampler_; }
  const Dataset& dataset() const { return *dataset_; }
  const LoaderOptions& options() const { return options_; }

  struct Pass;  // implementation detail: one pass's batches, workers and queue

 private:
  // Constant after construction.
  std::shared_ptr<const Dataset> dataset_;
  DistributedSampler sampler_;
  LoaderOptions options_;
  bool owns_sampler_ = false;  // built without a sampler: advance its epoch per full pass
  std::shared_ptr<std::atomic<bool>> pass_alive_;  // true while one of its Iterators lives
};

// A single-pass input iterator; move-only. Destroying it ends the pass (Note [Loader passes]).
class DataLoader::Iterator {
 public:
  Iterator(Iterator&&) noexcept;
  Iterator& operator=(Iterator&&) noexcept;
  ~Iterator();

  Batch& operator*();
  Batch* operator->() { return &**this; }
  Iterator& operator++();  // waits for the next batch; rethrows a worker's failure
  friend bool operator==(const Iterator& it, Sentinel) { return it.done(); }

 private:
  friend class DataLoader;
  explicit Iterator(std::unique_ptr<Pass> pass);
  bool done() const;
  std::unique_ptr<Pass> pass_;
};

}  // namespace ddp
