// DataLoader (see include/ddp/data_loader.h and its Note [Loader passes]).
//
// One pass = one Pass object owned by the Iterator:
//   begin(): sampler.begin_pass() -> the indices left this epoch -> batches [k*bs, (k+1)*bs)
//   workers: worker w builds batches w, w+W, w+2W, ... each at most `window` ahead of the
//            consumer, and files them (or the exception) under their number
//   consumer: takes batch `next` (waiting if needed), moves it to the device, advances the
//            sampler, and hands it out; the end marks the sampler's epoch finished
//   ~Pass: stop, wake, join (workers finish at most the batch in their hands).
#include "ddp/data_loader.h"

#include <exception>
#include <map>
#include <thread>
#include <vector>

#include <torch/cuda.h>  // torch::cuda::is_available (declaration only; cheap to include)

#include "base/check.h"
#include "base/thread_annotations.h"  // Mutex, CondVar, GUARDED_BY

namespace ddp {
namespace {

std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception (not derived from std::exception)";
  }
}

int64_t batches_in(int64_t samples, int64_t batch_size, bool drop_last) {
  return drop_last ? samples / batch_size : (samples + batch_size - 1) / batch_size;
}

void check_options(const LoaderOptions& o) {
  DDP_CHECK(o.batch_size >= 1, ConfigError, "DataLoader: batch_size is {}; it must be at least 1",
            o.batch_size);
  DDP_CHECK(o.num_workers >= 0, ConfigError,
            "DataLoader: num_workers is {}; use 0 to build batches in the calling thread",
            o.num_workers);
  DDP_CHECK(o.prefetch_factor >= 1, ConfigError,
            "DataLoader: prefetch_factor is {}; it must be at least 1 (batches per worker)",
            o.prefetch_factor);
  if (o.device && o.device->is_cuda()) {
    DDP_CHECK(torch::cuda::is_available(), ConfigError,
              "DataLoader: device is {} but CUDA is not available here (a CPU-only LibTorch, "
              "or no GPU visible); leave LoaderOptions::device unset to keep batches on the CPU",
              o.device->str());
  }
}

}  // namespace

struct DataLoader::Pass {
  struct Item {
    Batch batch;
    std::exception_ptr error;
  };

  Pass(std::shared_ptr<const Dataset> d, DistributedSampler s, const LoaderOptions& o,
       std::shared_ptr<std::atomic<bool>> a)
      : dataset(std::move(d)), sampler(std::move(s)), options(o), alive(std::move(a)) {
    alive->store(true);  // cleared by ~Pass
  }

  // Constant after construction.
  std::shared_ptr<const Dataset> dataset;
  DistributedSampler sampler;  // shares the loader's cursor
  LoaderOptions options;
  std::shared_ptr<std::atomic<bool>> alive;
  int64_t epoch = 0;
  std::vector<int64_t> indices;  // this pass: the samples still to draw this epoch, in order
  int64_t num_batches = 0;
  bool to_device = false;  // CUDA target: pin in the workers, copy non_blocking here
  int window = 0;          // batches that may be ready or in progress ahead of the consumer

  // Consumer thread only.
  int64_t next = 0;  // number of the next batch to hand out
  int64_t handed_out_samples = 0;
  Batch current;
  bool done = false;

  Mutex mu;
  CondVar produced_cv{&mu};  // a batch was filed
  CondVar consumed_cv{&mu};  // the consumer took one, or stop
  std::map<int64_t, Item> produced GUARDED_BY(mu);
  int64_t consumed GUARDED_BY(mu) = 0;  // batches taken so far
  bool stop GUARDED_BY(mu) = false;
  std::vector<std::thread> workers;

  ~Pass() {
    {
      MutexLock lock(&mu);
      stop = true;
    }
    consumed_cv.signal_all();
    for (auto& t : workers) t.join();
    alive->store(false);
  }

  std::pair<int64_t, int64_t> range(int64_t k) const {  // [begin, end) into `indices`
    const int64_t b = k * options.batch_size;
    return {b, std::min<int64_t>(b + options.batch_size, static_cast<int64_t>(indices.size()))};
  }

  Batch build(int64_t k) const {
    const auto [b, e] = range(k);
    Batch batch =
        dataset->get_batch(std::vector<int64_t>(indices.begin() + b, indices.begin() + e));
    if (to_device) {
      batch.data = batch.data.pin_memory();
      batch.target = batch.target.pin_memory();
    }
    return batch;
  }

  void work(int w) EXCLUDES(mu) {
    const int W = options.num_workers;
    for (int64_t k = w; k < num_batches; k += W) {
      {
        MutexLock lock(&mu);
        while (!stop && k >= consumed + window) consumed_cv.wait();
        if (stop) return;
      }
      Item item;
      try {
        item.batch = build(k);
      } catch (...) {
        item.error = std::current_exception();
      }
      const bool failed = item.error != nullptr;
      {
        MutexLock lock(&mu);
        produced.emplace(k, std::move(item));
      }
      produced_cv.signal_all();
      if (failed) return;  // the consumer rethrows it; nothing after it will be taken
    }
  }

  void start() {
    for (int w = 0; w < options.num_workers; ++w) workers.emplace_back([this, w] { work(w); });
  }

  [[noreturn]] void fail(int64_t k, const std::exception_ptr& error) {
    const auto [b, e] = range(k);
    const std::string who = options.num_workers == 0
                                ? std::string("the calling thread")
                                : fmt::format("worker {}", k % options.num_workers);
    std::string first;  // the batch's first few dataset indices, to reproduce the failure
    for (int64_t i = b; i < std::min(e, b + 4); ++i) first += fmt::format("{}, ", indices[i]);
    const std::string msg = fmt::format(
        "DataLoader: {} failed building batch {} of {} (epoch {}, rank {}; {} samples, dataset "
        "indices {}{}): {}",
        who, k, num_batches, epoch, sampler.rank(), e - b, first.substr(0, first.size() - 2),
        e - b > 4 ? ", ..." : "", message_of(error));
    try {
      std::rethrow_exception(error);
    } catch (...) {
      std::throw_with_nested(DataError(msg));
    }
  }

  Item take(int64_t k) EXCLUDES(mu) {
    if (options.num_workers == 0) {
      Item item;
      try {
        item.batch = build(k);
      } catch (...) {
        item.error = std::current_exception();
      }
      return item;
    }
    std::map<int64_t, Item>::node_type node;
    {
      MutexLock lock(&mu);
      while (produced.count(k) == 0) produced_cv.wait();
      node = produced.extract(k);
      consumed = k + 1;
    }
    consumed_cv.signal_all();
    return std::move(node.mapped());
  }

  // Hands out the next batch into `current`, or ends the pass.
  void fetch_next() EXCLUDES(mu) {
    if (next == num_batches) {
      finish();
      return;
    }
    Item item = take(next);
    if (item.error) {
      done = true;
      current = {};
      fail(next, item.error);
    }
    if (to_device) {
      item.batch.data = item.batch.data.to(item.batch.data.options().device(*options.device),
                                           /*non_blocking=*/true);
      item.batch.target = item.batch.target.to(item.batch.target.options().device(*options.device),
                                               /*non_blocking=*/true);
    }
    current = std::move(item.batch);
    const auto [b, e] = range(next);
    advance_sampler(e - b);
    ++next;
  }

  void finish() {
    done = true;
    current = {};
    // A dropped last batch is skipped, not pending: the epoch is finished.
    advance_sampler(static_cast<int64_t>(indices.size()) - handed_out_samples);
  }

  void advance_sampler(int64_t count) {
    handed_out_samples += count;
    // set_epoch() in the middle of a pass restarted the cursor: leave the new epoch alone.
    if (count > 0 && sampler.epoch() == epoch) sampler.advance(count);
  }
};

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, DistributedSampler sampler,
                       LoaderOptions options)
    : dataset_(std::move(dataset)), sampler_(std::move(sampler)), options_(std::move(options)),
      pass_alive_(std::make_shared<std::atomic<bool>>(false)) {
  DDP_CHECK(dataset_ != nullptr, ConfigError, "DataLoader: the dataset is null");
  check_options(options_);
  DDP_CHECK(sampler_.dataset_size() == dataset_->size(), ConfigError,
            "DataLoader: the sampler was built for {} samples but the dataset has {}; build "
            "the sampler with dataset.size()",
            sampler_.dataset_size(), dataset_->size());
}

DataLoader::DataLoader(std::shared_ptr<const Dataset> dataset, LoaderOptions options)
    : DataLoader(dataset,
                 DistributedSampler(dataset ? dataset->size() : 1, {.num_replicas = 1,
                                                                    .rank = 0,
                                                                    .shuffle = options.shuffle,
                                                                    .seed = options.seed}),
                 options) {
  owns_sampler_ = true;
}

DataLoader::~DataLoader() = default;

int64_t DataLoader::num_batches() const {
  return batches_in(sampler_.num_samples(), options_.batch_size, options_.drop_last);
}

DataLoader::Iterator DataLoader::begin() {
  DDP_CHECK(!pass_alive_->load(), ConfigError,
            "DataLoader::begin(): the previous pass of this loader is still running (its "
            "iterator is alive); finish that loop or destroy its iterator first");
  // Without a user sampler, each new full pass is a new epoch (a new shuffle).
  if (owns_sampler_ && sampler_.position() == sampler_.num_samples()) {
    sampler_.set_epoch(sampler_.epoch() + 1);
  }
  auto pass = std::make_unique<Pass>(dataset_, sampler_, options_, pass_alive_);
  pass->epoch = sampler_.epoch();
  pass->indices = sampler_.begin_pass();
  pass->num_batches = batches_in(static_cast<int64_t>(pass->indices.size()), options_.batch_size,
                                 options_.drop_last);
  pass->to_device = options_.device && options_.device->is_cuda();
  pass->window = options_.num_workers * options_.prefetch_factor;
  pass->start();
  pass->fetch_next();
  return Iterator(std::move(pass));
}

DataLoader::Iterator::Iterator(std::unique_ptr<Pass> pass) : pass_(std::move(pass)) {}
DataLoader::Iterator::Iterator(Iterator&&) noexcept = default;
DataLoader::Iterator& DataLoader::Iterator::operator=(Iterator&&) noexcept = default;
DataLoader::Iterator::~Iterator() = default;

Batch& DataLoader::Iterator::operator*() {
  DDP_ASSERT(pass_ && !pass_->done, "dereferencing a DataLoader iterator at its end");
  return pass_->current;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  DDP_ASSERT(pass_ && !pass_->done, "incrementing a DataLoader iterator at its end");
  pass_->fetch_next();
  return *this;
}

bool DataLoader::Iterator::done() const { return !pass_ || pass_->done; }

}  // namespace ddp
