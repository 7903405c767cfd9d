// Checkpointer as a collective, ranks as threads over Gloo at world sizes 1, 2, 3: rank 0
// writes and no rank returns before the file is complete; every rank resumes from the same
// file and restores the same state; a failure on one rank (rank 0's write, one rank's load) is
// thrown on every rank; a resume at another world size is reported.
//
// The ranks share one process, hence one default CPU generator: per-rank generator states are
// tested in tests/unit/test_checkpoint_resume.cpp (CheckpointRng.EachRankTakesItsOwnState).
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/checkpoint.h"
#include "ddp/process_group.h"
#include "support/models.h"  // copy_state
#include "support/ranks.h"
#include "unit/test_checkpoint_support.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Net;
using testing::run_ranks;
using testing::TempDir;

constexpr int64_t kDatasetSize = 30;

// Per-rank objects built in the main thread (module construction draws from the shared
// generator): the trained replica (identical on all ranks, as under DDP) and a fresh one.
struct RankState {
  Net net;
  Net fresh;
};

std::vector<RankState> make_ranks(int world, int64_t hidden = 32) {
  torch::manual_seed(0);
  Net reference(hidden);
  std::vector<RankState> out;
  for (int r = 0; r < world; ++r) {
    RankState s{Net(hidden), Net(hidden)};
    testing::copy_state(*reference, *s.net);
    out.push_back(s);
  }
  return out;
}

// One deterministic optimizer step, so that momentum buffers exist.
void step(torch::optim::Optimizer& opt, Net& net) {
  opt.zero_grad();
  for (auto& p : net->parameters()) p.mutable_grad() = torch::ones_like(p) * 0.01;
  opt.step();
}

TEST(CheckpointCollective, RankZeroWritesAllRanksResumeFromTheSameFile) {
  for (int world : {1, 2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    TempDir dir;
    auto ranks = make_ranks(world);
    run_ranks(world, [&](ProcessGroup& pg) {
      RankState& me = ranks[pg.rank()];
      Checkpointer c(dir.path(), {.keep = 2, .model_label = "net"});
      torch::optim::SGD opt(me.net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
      step(opt, me.net);
      DistributedSampler sampler(kDatasetSize,
                                 {.num_replicas = pg.size(), .rank = pg.rank(), .seed = 5});
      sampler.set_epoch(1);
      sampler.advance(3);

      for (int64_t s : {5, 7}) {
        const SavedCheckpoint saved =
            c.save({.model = me.net.get(), .optimizer = &opt, .sampler = &sampler},
                   {.step = s, .epoch = 1}, pg);
        // Whichever rank returns first, the file is already complete.
        EXPECT_EQ(saved.path, dir / ("epoch=1-step=" + std::to_string(s) + ".ckpt"));
        EXPECT_NO_THROW(verify_checkpoint(saved.path));
      }
      const CheckpointMeta m = read_checkpoint_meta(dir / "epoch=1-step=7.ckpt");
      EXPECT_EQ(m.world_size, pg.size());
      EXPECT_EQ(m.rng_states, pg.size());  // every rank's generator state

      const ResumePoint rp = c.latest_valid(pg);
      ASSERT_TRUE(rp.path.has_value());
      EXPECT_EQ(*rp.path, dir / "epoch=1-step=7.ckpt");

      torch::optim::SGD fresh_opt(me.fresh->parameters(),
                                  torch::optim::SGDOptions(0.5).momentum(0.9));
      DistributedSampler fresh_sampler(kDatasetSize,
                                       {.num_replicas = pg.size(), .rank = pg.rank(), .seed = 5});
      const LoadedCheckpoint got =
          c.load(*rp.path,
                 {.model = me.fresh.get(), .optimizer = &fresh_opt, .sampler = &fresh_sampler}, pg);
      EXPECT_EQ(got.meta.step, 7);
      EXPECT_FALSE(got.world_size_changed);
      EXPECT_TRUE(got.rng_exact);
      EXPECT_TRUE(testing::bitwise_equal(*me.net, *me.fresh));
      EXPECT_EQ(fresh_sampler.remaining(), sampler.remaining());
      // The next step agrees too (momentum restored).
      step(opt, me.net);
      step(fresh_opt, me.fresh);
      EXPECT_TRUE(testing::bitwise_equal(*me.net, *me.fresh));
    });
  }
}

TEST(CheckpointCollective, RankZeroWriteFailureIsThrownOnEveryRank) {
  for (int world : {2, 3}) {
    TempDir dir;
    auto ranks = make_ranks(world);
    std::vector<std::string> errors(world);
    run_ranks(world, [&](ProcessGroup& pg) {
      Checkpointer c(dir.path(), {.fault_hook = [](std::string_view stage, const fs::path& f) {
                       if (stage == "rename") {
                         throw CheckpointError(f.string() + ": simulated EIO");
                       }
                     }});
      try {
        c.save({.model = ranks[pg.rank()].net.get()}, {.step = 1}, pg);
      } catch (const CheckpointError& e) {
        errors[pg.rank()] = e.what();
      }
    });
    EXPECT_NE(errors[0].find("simulated EIO"), std::string::npos) << errors[0];
    for (int r = 1; r < world; ++r) {
      EXPECT_NE(errors[r].find("rank 0 failed to write"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("[rank " + std::to_string(r) + "]"), std::string::npos);
    }
    EXPECT_FALSE(fs::exists(dir / "epoch=0-step=1.ckpt"));
  }
}

TEST(CheckpointCollective, OneRankFailingToLoadStopsEveryRank) {
  const int world = 3;
  TempDir dir;
  auto ranks = make_ranks(world);
  auto wide = make_ranks(1, /*hidden=*/64);
  std::vector<std::string> errors(world);
  run_ranks(world, [&](ProcessGroup& pg) {
    Checkpointer c(dir.path(), {.model_label = "net"});
    const auto saved = c.save({.model = ranks[pg.rank()].net.get()}, {.step = 2}, pg);
    // Rank 1 was started with another model.
    torch::nn::Module* model = pg.rank() == 1 ? static_cast<torch::nn::Module*>(wide[0].fresh.get())
                                              : ranks[pg.rank()].fresh.get();
    try {
      c.load(saved.path, {.model = model}, pg);
    } catch (const CheckpointError& e) {
      errors[pg.rank()] = e.what();
    }
  });
  EXPECT_NE(errors[1].find("but the model has [64, 20]"), std::string::npos) << errors[1];
  for (int r : {0, 2}) {
    EXPECT_NE(errors[r].find("failed on rank(s) 1"), std::string::npos) << errors[r];
  }
}

TEST(CheckpointCollective, ResumeAtAnotherWorldSizeIsReported) {
  TempDir dir;
  auto two = make_ranks(2);
  run_ranks(2, [&](ProcessGroup& pg) {
    DistributedSampler sampler(kDatasetSize, {.num_replicas = 2, .rank = pg.rank(), .seed = 5});
    sampler.advance(4);  // 8 of 30 consumed
    Checkpointer(dir.path())
        .save({.model = two[pg.rank()].net.get(), .sampler = &sampler}, {.step = 4}, pg);
  });
  auto three = make_ranks(3);
  std::vector<std::vector<int64_t>> rest(3);
  run_ranks(3, [&](ProcessGroup& pg) {
    Checkpointer c(dir.path());
    DistributedSampler sampler(kDatasetSize, {.num_replicas = 3, .rank = pg.rank(), .seed = 5});
    const auto rp = c.latest_valid(pg);
    ASSERT_TRUE(rp.path.has_value());
    const auto got =
        c.load(*rp.path, {.model = three[pg.rank()].fresh.get(), .sampler = &sampler}, pg);
    EXPECT_TRUE(got.world_size_changed);
    EXPECT_EQ(got.meta.world_size, 2);
    EXPECT_FALSE(got.rng_exact);
    EXPECT_EQ(sampler.state().consumed(), 8);
    rest[pg.rank()] = sampler.remaining();
  });
  // The three ranks split the 22 samples not yet consumed (padded to 24).
  EXPECT_EQ(rest[0].size() + rest[1].size() + rest[2].size(), 24u);
}

}  // namespace
}  // namespace ddp
