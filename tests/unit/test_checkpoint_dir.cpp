// Checkpointer over a directory: names and last.ckpt, keep-K pruning, latest_valid() ("--resume
// auto") skipping damaged files with reasons, failed writes (injected at every stage, and a real
// rename failure) leaving the previous checkpoints intact and loadable, and temporary files
// from a crash ignored and cleaned up.
#include <sys/stat.h>

#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/checkpoint.h"
#include "test_checkpoint_support.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;
using testing::Net;
using testing::TempDir;

std::set<std::string> names_in(const fs::path& dir) {
  std::set<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.insert(e.path().filename().string());
  return out;
}

ino_t inode(const fs::path& p) {
  struct stat st {};
  EXPECT_EQ(::stat(p.c_str(), &st), 0) << p;
  return st.st_ino;
}

// Saves steps 10, 20, ... (epoch = step / 25), changing the model between saves so that each
// checkpoint holds different values; returns the model's values at each save.
struct Saver {
  Net net;
  std::map<int64_t, std::vector<at::Tensor>> at_step;

  SavedCheckpoint save(const Checkpointer& c, int64_t step) {
    {
      torch::NoGradGuard g;
      for (auto& p : net->parameters()) p.add_(static_cast<double>(step));
    }
    at_step[step] = testing::snapshot(*net);
    TrainingState state;
    state.add("model", net);
    return c.save(state, {.step = step, .epoch = step / 25});
  }
  // `file` loads and holds the values of `step`.
  void expect_holds(const fs::path& file, int64_t step) {
    Net other;
    TrainingState state;
    state.add("model", other);
    const auto got = load_checkpoint(file, state);
    EXPECT_EQ(got.meta.step, step) << file;
    EXPECT_TRUE(testing::same_as_snapshot(*other, at_step.at(step))) << file;
  }
};

TEST(Checkpointer, NamesAndLastAsHardLink) {
  TempDir dir;
  Checkpointer c(dir / "ckpts", {.keep = 0});
  Saver s;
  const auto saved = s.save(c, 10);
  EXPECT_EQ(saved.path, dir / "ckpts" / "epoch=0-step=10.ckpt");
  EXPECT_TRUE(saved.warnings.empty());
  s.save(c, 30);
  EXPECT_EQ(names_in(c.dir()),
            (std::set<std::string>{"epoch=0-step=10.ckpt", "epoch=1-step=30.ckpt", "last.ckpt"}));
  EXPECT_EQ(inode(c.last_path()), inode(c.dir() / "epoch=1-step=30.ckpt"));
  s.expect_holds(c.last_path(), 30);
  s.expect_holds(c.dir() / "epoch=0-step=10.ckpt", 10);
  EXPECT_EQ(c.list(), (std::vector<fs::path>{c.dir() / "epoch=1-step=30.ckpt",
                                             c.dir() / "epoch=0-step=10.ckpt"}));
}

TEST(Checkpointer, KeepsExactlyKPlusLast) {
  TempDir dir;
  Checkpointer c(dir.path(), {.keep = 2});
  Saver s;
  for (int64_t step = 10; step <= 50; step += 10) s.save(c, step);
  EXPECT_EQ(names_in(c.dir()),
            (std::set<std::string>{"epoch=1-step=40.ckpt", "epoch=2-step=50.ckpt", "last.ckpt"}));
  s.expect_holds(c.last_path(), 50);
  s.expect_holds(c.dir() / "epoch=1-step=40.ckpt", 40);

  Checkpointer one(dir / "one", {.keep = 1});
  s.save(one, 60);
  const auto saved = s.save(one, 70);
  EXPECT_EQ(saved.removed, (std::vector<fs::path>{one.dir() / "epoch=2-step=60.ckpt"}));
  EXPECT_EQ(names_in(one.dir()), (std::set<std::string>{"epoch=2-step=70.ckpt", "last.ckpt"}));

  Checkpointer all(dir / "all", {.keep = 0});
  for (int64_t step = 10; step <= 50; step += 10) s.save(all, step);
  EXPECT_EQ(all.list().size(), 5u);

  EXPECT_THROW(Checkpointer(dir / "bad", {.keep = -1}), ConfigError);
}

TEST(Checkpointer, KeepNeverRemovesTheCheckpointJustWritten) {
  // Resumed from step 20 (say 30 was damaged), the run saves step 25: it is kept even though
  // two files have higher steps.
  TempDir dir;
  Checkpointer c(dir.path(), {.keep = 2});
  Saver s;
  s.save(c, 20);
  s.save(c, 30);
  s.save(c, 25);
  EXPECT_EQ(names_in(c.dir()),
            (std::set<std::string>{"epoch=1-step=30.ckpt", "epoch=1-step=25.ckpt", "last.ckpt"}));
  s.expect_holds(c.last_path(), 25);
}

TEST(Checkpointer, LatestValidWithNothingIsAFreshStart) {
  TempDir dir;
  Checkpointer c(dir / "new");
  const auto r = c.latest_valid();
  EXPECT_FALSE(r.path.has_value());
  EXPECT_TRUE(r.skipped.empty());
}

TEST(Checkpointer, LatestValidSkipsADamagedNewestWithTheReason) {
  TempDir dir;
  Checkpointer c(dir.path(), {.keep = 0});
  Saver s;
  for (int64_t step : {10, 20, 30}) s.save(c, step);
  EXPECT_EQ(c.latest_valid().path, c.dir() / "epoch=1-step=30.ckpt");

  // Flip a payload byte of the newest (in place: last.ckpt, its hard link, is damaged too).
  const fs::path newest = c.dir() / "epoch=1-step=30.ckpt";
  std::string bytes = testing::read_bytes(newest);
  bytes[bytes.size() - 10] ^= 0x01;
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(bytes.size() - 10));
    f.put(bytes[bytes.size() - 10]);
  }
  auto r = c.latest_valid();
  ASSERT_TRUE(r.path.has_value());
  EXPECT_EQ(*r.path, c.dir() / "epoch=0-step=20.ckpt");
  ASSERT_EQ(r.skipped.size(), 1u);  // last.ckpt is the same file: not reported twice
  EXPECT_EQ(r.skipped[0].path, newest);
  EXPECT_NE(r.skipped[0].reason.find("payload checksum mismatch"), std::string::npos)
      << r.skipped[0].reason;
  s.expect_holds(*r.path, 20);

  // Truncate the next one too: the oldest is used, both skips are reported, newest first.
  fs::resize_file(c.dir() / "epoch=0-step=20.ckpt", 500);
  r = c.latest_valid();
  EXPECT_EQ(r.path, c.dir() / "epoch=0-step=10.ckpt");
  ASSERT_EQ(r.skipped.size(), 2u);
  EXPECT_EQ(r.skipped[1].path, c.dir() / "epoch=0-step=20.ckpt");
  EXPECT_NE(r.skipped[1].reason.find("truncated"), std::string::npos) << r.skipped[1].reason;

  // All damaged: no resume point, every file reported.
  testing::write_bytes(c.dir() / "epoch=0-step=10.ckpt", "");
  r = c.latest_valid();
  EXPECT_FALSE(r.path.has_value());
  EXPECT_EQ(r.skipped.size(), 3u);
}

TEST(Checkpointer, LastCkptAloneIsACandidate) {
  TempDir dir;
  Checkpointer c(dir.path(), {.keep = 0});
  Saver s;
  s.save(c, 10);
  s.save(c, 20);
  fs::remove(c.dir() / "epoch=0-step=20.ckpt");  // e.g. removed by hand
  const auto r = c.latest_valid();
  EXPECT_EQ(r.path, c.last_path());
  s.expect_holds(*r.path, 20);
}

// --- failed writes ---------------------------------------------------------------------------

TEST(Checkpointer, AFailedWriteAtAnyStageLeavesThePreviousCheckpointsIntact) {
  for (const std::string stage : {"open", "write", "fsync", "rename", "sync_dir", "last"}) {
    SCOPED_TRACE("failure at " + stage);
    TempDir dir;
    Saver s;
    bool armed = false;
    Checkpointer c(dir.path(),
                   {.keep = 2, .fault_hook = [&](std::string_view at, const fs::path& file) {
                      if (armed && at == stage) {
                        throw CheckpointError(file.string() + ": simulated ENOSPC at " + stage);
                      }
                    }});
    s.save(c, 10);
    s.save(c, 20);
    armed = true;
    EXPECT_THROW(s.save(c, 30), CheckpointError);
    armed = false;

    // The previous checkpoints are intact and loadable; no temporary is left behind.
    s.expect_holds(c.dir() / "epoch=0-step=10.ckpt", 10);
    s.expect_holds(c.dir() / "epoch=0-step=20.ckpt", 20);
    for (const auto& name : names_in(c.dir())) {
      EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
    }
    // The new file exists only if the failure came after its rename (then it is complete);
    // last.ckpt is the previous one until it is relinked.
    const bool renamed = stage == "sync_dir" || stage == "last";
    EXPECT_EQ(fs::exists(c.dir() / "epoch=1-step=30.ckpt"), renamed);
    s.expect_holds(c.last_path(), 20);
    const auto r = c.latest_valid();
    EXPECT_TRUE(r.skipped.empty());
    EXPECT_EQ(r.path, c.dir() / (renamed ? "epoch=1-step=30.ckpt" : "epoch=0-step=20.ckpt"));
    // Nothing was pruned by the failed save.
    EXPECT_TRUE(fs::exists(c.dir() / "epoch=0-step=10.ckpt"));
  }
}

TEST(Checkpointer, ARealRenameFailureIsReportedAndHarmless) {
  TempDir dir;
  Saver s;
  Checkpointer c(dir.path(), {.keep = 0});
  s.save(c, 10);
  // A non-empty directory squats the name the next save renames onto: rename(2) fails.
  fs::create_directories(c.dir() / "epoch=0-step=20.ckpt" / "squatter");
  try {
    s.save(c, 20);
    ADD_FAILURE() << "the save succeeded";
  } catch (const CheckpointError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("epoch=0-step=20.ckpt: cannot rename"), std::string::npos) << msg;
  }
  s.expect_holds(c.dir() / "epoch=0-step=10.ckpt", 10);
  s.expect_holds(c.last_path(), 10);
  const auto r = c.latest_valid();
  EXPECT_EQ(r.path, c.dir() / "epoch=0-step=10.ckpt");
  ASSERT_EQ(r.skipped.size(), 1u);
  // A directory of a checkpoint's name is read as a sharded checkpoint, which this one is not.
  EXPECT_NE(r.skipped[0].reason.find("a sharded checkpoint without its metadata.ckpt"),
            std::string::npos)
      << r.skipped[0].reason;
  for (const auto& name : names_in(c.dir())) {
    EXPECT_EQ(name.find(".tmp."), std::string::npos) << name;
  }
}

TEST(Checkpointer, TempFilesFromACrashAreIgnoredThenCleanedUp) {
  TempDir dir;
  Saver s;
  Checkpointer c(dir.path(), {.keep = 0});
  s.save(c, 10);
  // What a crash mid-write leaves: a partial temporary of the next checkpoint, and of last.
  const std::string partial = testing::read_bytes(c.dir() / "epoch=0-step=10.ckpt").substr(0, 300);
  testing::write_bytes(c.dir() / ".epoch=0-step=20.ckpt.tmp.99999.0", partial);
  testing::write_bytes(c.dir() / ".last.ckpt.tmp.99999.1", partial);

  const auto r = c.latest_valid();
  EXPECT_EQ(r.path, c.dir() / "epoch=0-step=10.ckpt");
  EXPECT_TRUE(r.skipped.empty());
  EXPECT_EQ(c.list().size(), 1u);

  s.save(c, 20);  // the writer cleans up first
  EXPECT_EQ(names_in(c.dir()),
            (std::set<std::string>{"epoch=0-step=10.ckpt", "epoch=0-step=20.ckpt", "last.ckpt"}));
  testing::write_bytes(c.dir() / ".epoch=0-step=30.ckpt.tmp.1.2", partial);
  EXPECT_EQ(c.remove_stale_temp_files(),
            (std::vector<fs::path>{c.dir() / ".epoch=0-step=30.ckpt.tmp.1.2"}));
}

TEST(Checkpointer, ForeignFilesAreLeftAlone) {
  TempDir dir;
  Saver s;
  Checkpointer c(dir.path(), {.keep = 1});
  testing::write_bytes(c.dir() / "notes.txt", "mine");
  testing::write_bytes(c.dir() / "epoch=x-step=1.ckpt", "not ours by name");
  s.save(c, 10);
  s.save(c, 20);
  EXPECT_EQ(names_in(c.dir()), (std::set<std::string>{"notes.txt", "epoch=x-step=1.ckpt",
                                                      "epoch=0-step=20.ckpt", "last.ckpt"}));
  EXPECT_EQ(c.latest_valid().path, c.dir() / "epoch=0-step=20.ckpt");
}

}  // namespace
}  // namespace ddp
