// DataLoader: the same batches whatever the worker count, drop_last, early exit without hang or
// leaked threads, worker failures surfacing with context, the shared sampler (set_epoch after
// the loader is built) and resume from a sampler state.
#include <dirent.h>

#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/data_loader.h"
#include "ddp/error.h"

namespace ddp {
namespace {

using namespace std::chrono_literals;

constexpr int64_t kN = 103;  // not a multiple of any batch size or world size used here

// Sample i: data row [i, i+0.5, i+0.25], target i; so a batch's targets name its indices.
std::shared_ptr<TensorDataset> numbered(int64_t n = kN) {
  auto t = torch::arange(n, torch::kFloat).unsqueeze(1);
  return std::make_shared<TensorDataset>(torch::cat({t, t + 0.5, t + 0.25}, 1),
                                         torch::arange(n, torch::kLong));
}

// A dataset that sleeps per batch and fails on one index: for timing and error paths.
class Tricky : public TensorDataset {
 public:
  Tricky(std::chrono::milliseconds delay, int64_t poison)
      : TensorDataset(*numbered()), delay_(delay), poison_(poison) {}
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    std::this_thread::sleep_for(delay_);
    for (int64_t i : indices) {
      if (i == poison_) throw std::invalid_argument("sample " + std::to_string(i) + " is bad");
    }
    return TensorDataset::get_batch(indices);
  }

 private:
  std::chrono::milliseconds delay_;
  int64_t poison_;
};

// The targets of a pass, stopping (break) after `max_batches` batches when it is >= 0.
std::vector<int64_t> targets_of(DataLoader& loader, int64_t max_batches = -1) {
  std::vector<int64_t> out;
  int64_t k = 0;
  for (auto& b : loader) {
    auto t = b.target.contiguous();
    out.insert(out.end(), t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
    if (++k == max_batches) break;
  }
  return out;
}

int thread_count() {
  int n = 0;
  if (DIR* d = opendir("/proc/self/task")) {
    while (dirent* e = readdir(d)) n += e->d_name[0] != '.';
    closedir(d);
  }
  return n;
}

TEST(DataLoader, SameBatchesInTheSameOrderForAnyWorkerCount) {
  auto data = numbered();
  std::vector<std::vector<Batch>> runs;
  for (int workers : {0, 1, 4}) {
    for (int prefetch : {1, 3}) {
      DistributedSampler sampler(kN, {.num_replicas = 2, .rank = 1, .seed = 5});
      sampler.set_epoch(2);
      DataLoader loader(data, sampler,
                        {.batch_size = 8, .num_workers = workers, .prefetch_factor = prefetch});
      std::vector<Batch> batches;
      for (auto& b : loader) batches.push_back(b);
      EXPECT_EQ(static_cast<int64_t>(batches.size()), loader.num_batches());
      runs.push_back(std::move(batches));
      // The order is the sampler's, cut into batches.
      std::vector<int64_t> flat;
      for (auto& b : runs.back()) {
        for (int64_t i = 0; i < b.target.size(0); ++i) flat.push_back(b.target[i].item<int64_t>());
      }
      EXPECT_EQ(flat, sampler.indices()) << workers << " workers";
    }
  }
  for (size_t r = 1; r < runs.size(); ++r) {
    ASSERT_EQ(runs[r].size(), runs[0].size());
    for (size_t k = 0; k < runs[0].size(); ++k) {
      EXPECT_TRUE(torch::equal(runs[r][k].data, runs[0][k].data)) << "run " << r << " batch " << k;
      EXPECT_TRUE(torch::equal(runs[r][k].target, runs[0][k].target));
    }
  }
  // Row values follow their index: the gather picked the right rows.
  const Batch& b = runs[0][0];
  EXPECT_TRUE(torch::equal(b.data.select(1, 1), b.target.to(torch::kFloat) + 0.5));
}

// Workers finish out of order (per-batch delays differ); the consumer still gets batch order.
class Jittery : public TensorDataset {
 public:
  Jittery() : TensorDataset(*numbered()) {}
  Batch get_batch(const std::vector<int64_t>& indices) const override {
    std::this_thread::sleep_for(std::chrono::microseconds(500 * ((indices[0] * 7) % 5)));
    return TensorDataset::get_batch(indices);
  }
};

TEST(DataLoader, OutOfOrderWorkersStillDeliverInOrder) {
  auto data = std::make_shared<Jittery>();
  DataLoader reference(data, {.batch_size = 4});
  const auto expected = targets_of(reference);
  for (int workers : {2, 4, 7}) {
    DataLoader loader(data, {.batch_size = 4, .num_workers = workers, .prefetch_factor = 1});
    EXPECT_EQ(targets_of(loader), expected) << workers << " workers";
  }
  // Many early exits at different points: no hang, no crash, the cursor counts what was used.
  DistributedSampler sampler(kN, {.num_replicas = 1, .rank = 0});
  DataLoader loader(data, sampler, {.batch_size = 4, .num_workers = 3});
  for (int stop = 1; stop < 26; stop += 4) {  // 26 batches in all
    sampler.set_epoch(stop);
    EXPECT_EQ(targets_of(loader, stop).size(), static_cast<size_t>(4 * stop));
    EXPECT_EQ(sampler.position(), 4 * stop);
  }
}

TEST(DataLoader, DropLastDropsOnlyTheFinalPartialBatch) {
  auto data = numbered();  // 103 samples
  DataLoader keep(data, {.batch_size = 10});
  DataLoader drop(data, {.batch_size = 10, .drop_last = true});
  EXPECT_EQ(keep.num_batches(), 11);
  EXPECT_EQ(drop.num_batches(), 10);
  std::vector<int64_t> sizes;
  for (auto& b : keep) sizes.push_back(b.data.size(0));
  EXPECT_EQ(sizes.size(), 11u);
  EXPECT_EQ(sizes.back(), 3);
  EXPECT_EQ(targets_of(drop).size(), 100u);
  // The dropped tail counts as done: the epoch is finished and a new pass starts over.
  EXPECT_EQ(drop.sampler().position(), drop.sampler().num_samples());
  EXPECT_EQ(targets_of(drop).size(), 100u);
}

TEST(DataLoader, NoSamplerIsSequentialOrShuffledPerPass) {
  auto data = numbered();
  DataLoader seq(data, {.batch_size = 16, .num_workers = 2});
  auto all = targets_of(seq);
  ASSERT_EQ(all.size(), static_cast<size_t>(kN));
  for (int64_t i = 0; i < kN; ++i) EXPECT_EQ(all[i], i);

  DataLoader shuffled(data, {.batch_size = 16, .shuffle = true, .seed = 1});
  auto p0 = targets_of(shuffled);
  auto p1 = targets_of(shuffled);
  EXPECT_NE(p0, p1) << "each full pass reshuffles";
  std::sort(p0.begin(), p0.end());
  EXPECT_EQ(p0, all);
}

TEST(DataLoader, AbandoningAPassStopsAndJoinsTheWorkers) {
  auto slow = std::make_shared<Tricky>(20ms, /*poison=*/-1);
  {
    DataLoader warm_up(slow, {.batch_size = 64});  // LibTorch's own threads start first
    targets_of(warm_up);
  }
  const int before = thread_count();
  {
    DataLoader loader(slow, {.batch_size = 4, .num_workers = 4, .prefetch_factor = 2});
    int k = 0;
    for (auto& b : loader) {
      (void)b;
      if (++k == 2) break;  // ~26 batches left, 8 in flight
    }
    const auto t0 = std::chrono::steady_clock::now();
    for (auto& b : loader) {  // a new pass right away: the previous one is gone
      (void)b;
      break;
    }
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_LT(took, 2s) << "ending a pass waits only for batches already in workers' hands";
    EXPECT_EQ(loader.sampler().position(), 12);  // 2 + 1 batches of 4 handed out
  }
  EXPECT_EQ(thread_count(), before) << "worker threads leaked";
}

TEST(DataLoader, OnePassAtATime) {
  DataLoader loader(numbered(), {.batch_size = 4, .num_workers = 1});
  auto it = loader.begin();
  try {
    auto it2 = loader.begin();
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("still running"), std::string::npos) << e.what();
  }
}

TEST(DataLoader, WorkerFailureSurfacesWithContext) {
  for (int workers : {0, 1, 3}) {
    auto bad = std::make_shared<Tricky>(0ms, /*poison=*/50);  // sequential: batch 50/8 = 6
    DataLoader loader(bad, {.batch_size = 8, .num_workers = workers});
    int64_t seen = 0;
    try {
      for (auto& b : loader) seen += b.data.size(0);
      FAIL() << "expected DataError";
    } catch (const DataError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("batch 6 of 13"), std::string::npos) << msg;
      EXPECT_NE(msg.find("sample 50 is bad"), std::string::npos) << msg;
      EXPECT_NE(msg.find(workers ? "worker " + std::to_string(6 % workers) : "calling thread"),
                std::string::npos)
          << msg;
      // The original exception is nested inside.
      try {
        std::rethrow_if_nested(e);
        ADD_FAILURE() << "no nested exception";
      } catch (const std::invalid_argument& inner) {
        EXPECT_STREQ(inner.what(), "sample 50 is bad");
      }
    }
    EXPECT_EQ(seen, 48) << workers << " workers: the six good batches came first";
    EXPECT_EQ(loader.sampler().position(), 48);
  }
}

// pytorch#73141: LibTorch's loader copies its sampler, so set_epoch() afterwards does nothing.
TEST(DataLoader, SetEpochAfterBuildingTheLoaderTakesEffect) {
  DistributedSampler sampler(kN, {.num_replicas = 3, .rank = 2});
  DataLoader loader(numbered(), sampler, {.batch_size = 5, .num_workers = 2});
  std::vector<std::vector<int64_t>> epochs;
  for (int64_t e = 0; e < 3; ++e) {
    sampler.set_epoch(e);
    epochs.push_back(targets_of(loader));
    EXPECT_EQ(epochs.back(), sampler.indices()) << "epoch " << e;
  }
  EXPECT_NE(epochs[0], epochs[1]);
  EXPECT_NE(epochs[1], epochs[2]);
}

TEST(DataLoader, ResumesFromASamplerStateWithoutRepeatOrSkip) {
  auto data = numbered();
  const SamplerOptions opts{.num_replicas = 2, .rank = 0, .seed = 11};
  // The uninterrupted epoch.
  DistributedSampler full(kN, opts);
  full.set_epoch(4);
  DataLoader ref(data, full, {.batch_size = 6, .num_workers = 2});
  const auto expected = targets_of(ref);

  // Interrupted after 3 batches; the checkpoint holds the sampler state.
  DistributedSampler first(kN, opts);
  first.set_epoch(4);
  DataLoader loader(data, first, {.batch_size = 6, .num_workers = 2});
  auto head = targets_of(loader, 3);
  const SamplerState st = first.state();
  EXPECT_EQ(st.position, 18);

  // A new process: build everything again, restore, run the same loop.
  DistributedSampler resumed(kN, opts);
  DataLoader again(data, resumed, {.batch_size = 6, .num_workers = 4});
  resumed.load_state(st);
  resumed.set_epoch(4);
  auto tail = targets_of(again);
  head.insert(head.end(), tail.begin(), tail.end());
  EXPECT_EQ(head, expected);
  resumed.set_epoch(5);  // and the next epoch is whole
  EXPECT_EQ(targets_of(again).size(), expected.size());
}

TEST(DataLoader, BadOptionsAreConfigErrors) {
  auto data = numbered();
  EXPECT_THROW(DataLoader(data, {.batch_size = 0}), ConfigError);
  EXPECT_THROW(DataLoader(data, {.num_workers = -1}), ConfigError);
  EXPECT_THROW(DataLoader(data, {.prefetch_factor = 0}), ConfigError);
  EXPECT_THROW(DataLoader(data, DistributedSampler(kN + 1)), ConfigError);
  if (!torch::cuda::is_available()) {
    try {
      DataLoader(data, {.device = torch::Device("cuda:0")});
      FAIL() << "expected ConfigError";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("CUDA is not available"), std::string::npos);
    }
  }
  // A TensorDataset taken by value works too (its tensors are shared, not copied).
  DataLoader by_value(*data, DistributedSampler(kN), {.batch_size = 50});
  EXPECT_EQ(by_value.num_batches(), 3);
}

}  // namespace
}  // namespace ddp
