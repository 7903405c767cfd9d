// DistributedSampler: Python's exact sequence (cross-checked against torch.utils.data), the
// properties of a sharding, the shared cursor, resume (same and different world size), errors.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <iterator>
#include <ranges>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include "ddp/error.h"
#include "ddp/sampler.h"

namespace ddp {
namespace {

// Debian's python3-torch: a cross-check tool for tests only, never used by the library.
constexpr const char* kPython = "/usr/bin/python3";

struct Combo {
  int64_t n;
  int replicas;
  int rank;
  uint64_t seed;
  int64_t epoch;
  bool shuffle;
  bool drop_last;
};

std::string describe(const Combo& c) {
  return fmt::format("n={} replicas={} rank={} seed={} epoch={} shuffle={} drop_last={}", c.n,
                     c.replicas, c.rank, c.seed, c.epoch, c.shuffle, c.drop_last);
}

std::vector<Combo> combos() {
  std::vector<Combo> out;
  // Sizes divisible and not by the replicas, and far smaller than them (padding > n).
  const int64_t sizes[] = {1, 2, 3, 4, 5, 7, 10, 11, 16, 17, 100, 101, 1000};
  const int replicas[] = {1, 2, 3, 4, 5, 7, 8};
  const std::pair<uint64_t, int64_t> seed_epoch[] = {{0, 0}, {42, 1}, {(1ull << 40) + 3, 7}};
  for (int64_t n : sizes)
    for (int R : replicas)
      for (int r = 0; r < R; ++r)
        for (auto [seed, epoch] : seed_epoch)
          for (bool shuffle : {true, false})
            for (bool drop_last : {false, true})
              out.push_back({n, R, r, seed, epoch, shuffle, drop_last});
  // Fashion-MNIST-sized permutations (a long randperm).
  for (int r = 0; r < 3; ++r) out.push_back({60000, 3, r, 0, 2, true, false});
  for (int r = 0; r < 8; r += 7) out.push_back({60001, 8, r, 5, 3, true, true});
  for (int r = 0; r < 8; r += 3) out.push_back({60001, 8, r, 5, 3, true, false});
  return out;
}

// Runs Python's DistributedSampler once for all combos; line i: len(sampler) then the indices.
// Returns nullopt (and the reason) when the cross-check tool is missing.
std::optional<std::vector<std::vector<int64_t>>> python_indices(const std::vector<Combo>& cs,
                                                                std::string* why) {
  if (!std::filesystem::exists(kPython)) {
    *why = fmt::format("{} not found (apt-get install python3-torch)", kPython);
    return std::nullopt;
  }
  const auto dir =
      std::filesystem::temp_directory_path() / fmt::format("ddp_test_sampler_{}", ::getpid());
  std::filesystem::create_directories(dir);
  const auto script = dir / "sampler.py";
  {
    std::ofstream py(script);
    py << "import sys\n"
          "try:\n"
          "    from torch.utils.data.distributed import DistributedSampler\n"
          "except ImportError as e:\n"
          "    print('NO_TORCH', e); sys.exit(0)\n"
          "for line in sys.stdin:\n"
          "    n, R, r, seed, epoch, shuffle, drop = (int(x) for x in line.split())\n"
          "    s = DistributedSampler(range(n), num_replicas=R, rank=r, shuffle=bool(shuffle),\n"
          "                           seed=seed, drop_last=bool(drop))\n"
          "    s.set_epoch(epoch)\n"
          "    print(len(s), *list(s))\n";
  }
  const auto input = dir / "combos.txt";
  {
    std::ofstream in(input);
    for (const auto& c : cs) {
      in << c.n << ' ' << c.replicas << ' ' << c.rank << ' ' << c.seed << ' ' << c.epoch << ' '
         << c.shuffle << ' ' << c.drop_last << '\n';
    }
  }
  const std::string cmd = fmt::format("{} -E {} < {}", kPython, script.string(), input.string());
  FILE* pipe = popen(cmd.c_str(), "r");
  EXPECT_NE(pipe, nullptr) << cmd;
  std::string out;
  char buf[1 << 16];
  size_t got;
  while ((got = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, got);
  const int status = pclose(pipe);
  std::filesystem::remove_all(dir);
  if (out.rfind("NO_TORCH", 0) == 0) {
    *why = "python3 cannot import torch (apt-get install python3-torch): " + out;
    return std::nullopt;
  }
  EXPECT_EQ(status, 0) << cmd;

  std::vector<std::vector<int64_t>> result;
  std::istringstream lines(out);
  std::string line;
  while (std::getline(lines, line)) {
    std::istringstream fields(line);
    int64_t len = -1, v;
    fields >> len;
    std::vector<int64_t> idx;
    while (fields >> v) idx.push_back(v);
    EXPECT_EQ(static_cast<int64_t>(idx.size()), len) << "line " << result.size();
    result.push_back(std::move(idx));
  }
  return result;
}

TEST(SamplerVsPython, ExactSequenceForEveryCombination) {
  const auto cs = combos();
  std::string why;
  const auto py = python_indices(cs, &why);
  if (!py) GTEST_SKIP() << "SKIPPED the cross-check against Python: " << why;
  ASSERT_EQ(py->size(), cs.size()) << "python printed fewer lines than combinations";
  int mismatches = 0;
  for (size_t i = 0; i < cs.size() && mismatches < 5; ++i) {
    const Combo& c = cs[i];
    DistributedSampler s(c.n, {.num_replicas = c.replicas,
                               .rank = c.rank,
                               .shuffle = c.shuffle,
                               .seed = c.seed,
                               .drop_last = c.drop_last});
    s.set_epoch(c.epoch);
    const auto ours = s.indices();
    EXPECT_EQ(s.num_samples(), static_cast<int64_t>((*py)[i].size())) << describe(c);
    if (ours != (*py)[i]) {
      ++mismatches;
      ADD_FAILURE() << describe(c) << "\n  ours:   " << fmt::format("{}", ours).substr(0, 200)
                    << "\n  python: " << fmt::format("{}", (*py)[i]).substr(0, 200);
    }
  }
}

// Hand-checked values, so the rule is pinned even where Python is not installed.
TEST(Sampler, KnownSequences) {
  // n=10, R=3, no shuffle: padded list 0..9,0,1 -> rank 0: 0 3 6 9, rank 1: 1 4 7 0.
  auto shard = [](int64_t n, int R, int r, bool drop_last, bool pad = true) {
    return DistributedSampler(n, {.num_replicas = R,
                                  .rank = r,
                                  .shuffle = false,
                                  .drop_last = drop_last,
                                  .pad = pad})
        .indices();
  };
  EXPECT_EQ(shard(10, 3, 0, false), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(shard(10, 3, 1, false), (std::vector<int64_t>{1, 4, 7, 0}));
  EXPECT_EQ(shard(10, 3, 2, false), (std::vector<int64_t>{2, 5, 8, 1}));
  EXPECT_EQ(shard(10, 3, 2, true), (std::vector<int64_t>{2, 5, 8}));
  // Padding longer than the dataset repeats it cyclically: n=3 over 5 ranks is 0 1 2 0 1.
  EXPECT_EQ(shard(3, 5, 3, false), (std::vector<int64_t>{0}));
  EXPECT_EQ(shard(3, 5, 4, false), (std::vector<int64_t>{1}));
  EXPECT_TRUE(shard(3, 5, 0, true).empty());  // drop_last with n < R: nothing (as Python)
  EXPECT_EQ(shard(10, 3, 0, false, false), (std::vector<int64_t>{0, 3, 6, 9}));
  EXPECT_EQ(shard(10, 3, 1, false, false), (std::vector<int64_t>{1, 4, 7}));
  // torch.randperm(10, generator=torch.Generator().manual_seed(0)) in PyTorch 1.13.
  EXPECT_EQ(epoch_order(10, true, 0, 0), (std::vector<int64_t>{4, 1, 7, 5, 3, 9, 0, 8, 6, 2}));
}

TEST(Sampler, UnionOverRanksCoversTheDatasetAndShardsAreDisjointWithoutPadding) {
  for (int64_t n : {1, 3, 10, 11, 97, 100}) {
    for (int R : {1, 2, 3, 4, 5}) {
      for (bool drop_last : {false, true}) {
        std::map<int64_t, int> seen;
        int64_t total = 0;
        for (int r = 0; r < R; ++r) {
          DistributedSampler s(n,
                               {.num_replicas = R, .rank = r, .seed = 9, .drop_last = drop_last});
          s.set_epoch(3);
          for (int64_t i : s.indices()) {
            ASSERT_TRUE(i >= 0 && i < n);
            ++seen[i];
          }
          total += s.num_samples();
        }
        const std::string at = fmt::format("n={} R={} drop_last={}", n, R, drop_last);
        if (drop_last) {
          EXPECT_EQ(total, n / R * R) << at;
          EXPECT_EQ(static_cast<int64_t>(seen.size()), total) << at << ": duplicates";
        } else {
          EXPECT_EQ(static_cast<int64_t>(seen.size()), n) << at << ": not covered";
          EXPECT_EQ(total, (n + R - 1) / R * R) << at;
          if (n % R == 0) {
            EXPECT_EQ(total, n) << at;  // no padding: the shards are disjoint
          }
        }
      }
      // Evaluation mode: every sample exactly once, shards differ by at most one.
      int64_t total = 0;
      std::set<int64_t> seen;
      for (int r = 0; r < R; ++r) {
        DistributedSampler s(n, {.num_replicas = R, .rank = r, .pad = false});
        for (int64_t i : s.indices()) EXPECT_TRUE(seen.insert(i).second) << "dup " << i;
        EXPECT_LE(s.num_samples(), (n + R - 1) / R);
        EXPECT_GE(s.num_samples(), n / R);
        total += s.num_samples();
      }
      EXPECT_EQ(total, n) << "n=" << n << " R=" << R;
    }
  }
}

TEST(Sampler, EpochsAndSeedsChangeTheOrder) {
  DistributedSampler s(100, {.num_replicas = 2, .rank = 1});
  const auto e0 = s.indices();
  s.set_epoch(1);
  const auto e1 = s.indices();
  EXPECT_NE(e0, e1);
  EXPECT_EQ(std::multiset<int64_t>(e0.begin(), e0.end()).size(), e0.size());
  s.set_epoch(0);
  EXPECT_EQ(s.indices(), e0);  // deterministic
  DistributedSampler other_seed(100, {.num_replicas = 2, .rank = 1, .seed = 1});
  EXPECT_NE(other_seed.indices(), e0);
  DistributedSampler ordered(100, {.num_replicas = 2, .rank = 1, .shuffle = false});
  ordered.set_epoch(5);
  EXPECT_EQ(ordered.indices()[0], 1);
}

TEST(Sampler, DefaultsComeFromTheDefaultGroup) {
  DistributedSampler s(10);  // no group: world size 1, rank 0
  EXPECT_EQ(s.num_replicas(), 1);
  EXPECT_EQ(s.rank(), 0);
  EXPECT_EQ(s.num_samples(), 10);
  EXPECT_TRUE(s.options().shuffle);
}

void expect_config_error(const std::function<void()>& fn,
                         std::initializer_list<std::string> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected ConfigError";
  } catch (const ConfigError& e) {
    for (const auto& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message lacks '" << n << "': " << e.what();
    }
  }
}

TEST(Sampler, BadArgumentsAreConfigErrors) {
  expect_config_error([] { DistributedSampler(10, {.num_replicas = 4, .rank = 4}); },
                      {"rank 4", "[0, 3]"});
  expect_config_error([] { DistributedSampler(10, {.num_replicas = 4, .rank = -1}); }, {"rank -1"});
  expect_config_error([] { DistributedSampler(10, {.num_replicas = 0, .rank = 0}); },
                      {"num_replicas is 0"});
  expect_config_error([] { DistributedSampler(0, {.num_replicas = 1, .rank = 0}); },
                      {"dataset_size is 0"});
  expect_config_error([] { DistributedSampler(10, {.drop_last = true, .pad = false}); },
                      {"pad=false", "drop_last=true"});
  expect_config_error([] { DistributedSampler(10).set_epoch(-1); }, {"set_epoch(-1)"});
  DistributedSampler s(10, {.num_replicas = 2, .rank = 0});
  expect_config_error([&] { s.advance(6); }, {"exceeds the 5 samples"});
}

TEST(Sampler, CopiesShareTheCursorAndCloneDoesNot) {
  DistributedSampler a(50, {.num_replicas = 2, .rank = 0});
  DistributedSampler b = a;  // what a loader keeps
  DistributedSampler c = a.clone();
  a.set_epoch(4);
  a.advance(3);
  EXPECT_EQ(b.epoch(), 4);
  EXPECT_EQ(b.position(), 3);
  EXPECT_EQ(c.epoch(), 0);
  EXPECT_EQ(c.position(), 0);
}

// remaining(k): the next k indices of the pass, what a loop that reads the sampler by hand
// takes as its batch (ft::Manager's); fewer at the epoch's end, none past it.
TEST(Sampler, RemainingAtMostGivesTheNextIndices) {
  DistributedSampler s(23, {.num_replicas = 3, .rank = 2, .seed = 9});
  const auto all = s.indices();
  ASSERT_EQ(all.size(), 8u);
  EXPECT_EQ(s.remaining(3), std::vector<int64_t>(all.begin(), all.begin() + 3));
  s.advance(3);
  EXPECT_EQ(s.remaining(3), std::vector<int64_t>(all.begin() + 3, all.begin() + 6));
  EXPECT_EQ(s.remaining(100), s.remaining());
  EXPECT_TRUE(s.remaining(0).empty());
  s.advance(5);
  EXPECT_TRUE(s.remaining(3).empty());
  EXPECT_THROW(s.remaining(-1), ConfigError);
}

TEST(Sampler, SetEpochKeepsTheSameEpochsPositionAndResetsOnANewOne) {
  DistributedSampler s(20, {.num_replicas = 2, .rank = 1});
  s.set_epoch(2);
  s.advance(4);
  s.set_epoch(2);
  EXPECT_EQ(s.position(), 4);
  const auto all = s.indices();
  EXPECT_EQ(s.remaining(), std::vector<int64_t>(all.begin() + 4, all.end()));
  s.set_epoch(3);
  EXPECT_EQ(s.position(), 0);
  EXPECT_EQ(s.remaining(), shard_indices(epoch_order(20, true, 0, 3), 0, 2, 1, false, true))
      << "the new epoch's order, not the last";
  // A finished epoch restarts at the next pass (PyTorch repeats the order without set_epoch).
  s.advance(s.num_samples());
  EXPECT_EQ(s.begin_pass(), s.indices());
  EXPECT_EQ(s.position(), 0);
}

// Note [Sampler iteration]: `for (int64_t i : sampler)` is a loader pass with batch_size 1.
static_assert(std::ranges::input_range<DistributedSampler>);

TEST(SamplerIteration, RangeForYieldsIndicesAndAdvancesPerIndex) {
  DistributedSampler s(23, {.num_replicas = 3, .rank = 1, .seed = 5});
  s.set_epoch(2);
  const auto expected = s.indices();
  std::vector<int64_t> got;
  for (int64_t i : s) {
    got.push_back(i);
    // The index in hand counts as consumed, as a loader's batch does.
    EXPECT_EQ(s.position(), static_cast<int64_t>(got.size()));
  }
  EXPECT_EQ(got, expected);
  EXPECT_EQ(s.position(), s.num_samples());
  EXPECT_EQ(s.indices(), expected);  // indices() neither moves nor depends on the cursor

  // A finished epoch starts over at the next pass (as begin_pass, and PyTorch, repeat it).
  std::vector<int64_t> again;
  std::ranges::copy(s, std::back_inserter(again));
  EXPECT_EQ(again, expected);

  // A copy shares the cursor: iterating it is iterating the sampler.
  s.set_epoch(3);
  DistributedSampler copy = s;
  int64_t seen = 0;
  for ([[maybe_unused]] int64_t i : copy) ++seen;
  EXPECT_EQ(seen, s.num_samples());
  EXPECT_EQ(s.position(), s.num_samples());
}

TEST(SamplerIteration, BreakKeepsThePositionAndTheNextLoopContinues) {
  DistributedSampler s(40, {.num_replicas = 2, .rank = 0, .seed = 11});
  s.set_epoch(1);
  const auto all = s.indices();
  std::vector<int64_t> first;
  for (int64_t i : s) {
    first.push_back(i);
    if (first.size() == 7) break;
  }
  EXPECT_EQ(first, std::vector<int64_t>(all.begin(), all.begin() + 7));
  EXPECT_EQ(s.position(), 7);
  EXPECT_EQ(s.remaining(), std::vector<int64_t>(all.begin() + 7, all.end()));
  std::vector<int64_t> rest;
  for (int64_t i : s) rest.push_back(i);
  EXPECT_EQ(rest, std::vector<int64_t>(all.begin() + 7, all.end()));
  EXPECT_EQ(s.position(), s.num_samples());
}

TEST(SamplerIteration, StateAfterPartialIterationResumesExactly) {
  // Every rank of a world of 3 stops after 5 indices; a new run resumes from rank 0's state.
  const int R = 3;
  std::vector<std::vector<int64_t>> uninterrupted;
  SamplerState st;
  for (int r = 0; r < R; ++r) {
    DistributedSampler s(50, {.num_replicas = R, .rank = r, .seed = 4});
    s.set_epoch(6);
    uninterrupted.push_back(s.indices());
    int taken = 0;
    for ([[maybe_unused]] int64_t i : s) {
      if (++taken == 5) {
        if (r == 0) st = s.state();  // a checkpoint taken after the step that used index 5
        break;
      }
    }
  }
  EXPECT_EQ(st.epoch, 6);
  EXPECT_EQ(st.position, 5);
  EXPECT_EQ(st.consumed(), 15);
  for (int r = 0; r < R; ++r) {
    DistributedSampler fresh(50, {.num_replicas = R, .rank = r, .seed = 4});
    fresh.load_state(st);
    fresh.set_epoch(6);  // same epoch: keeps the restored position
    std::vector<int64_t> resumed;
    for (int64_t i : fresh) resumed.push_back(i);
    EXPECT_EQ(resumed, std::vector<int64_t>(uninterrupted[r].begin() + 5, uninterrupted[r].end()))
        << "rank " << r;
    EXPECT_EQ(fresh.position(), fresh.num_samples());
  }

  // A finished epoch restored from a checkpoint stays finished: the first loop is empty.
  DistributedSampler done(50, {.num_replicas = R, .rank = 0, .seed = 4});
  for ([[maybe_unused]] int64_t i : done) {
  }
  DistributedSampler restored(50, {.num_replicas = R, .rank = 0, .seed = 4});
  restored.load_state(done.state());
  EXPECT_TRUE(restored.begin() == restored.end());
  EXPECT_EQ(restored.position(), restored.num_samples());
}

TEST(SamplerIteration, EmptyPassesInterleavedPassesAndSetEpochMidLoop) {
  // drop_last with fewer samples than ranks: nothing to hand out, nothing consumed.
  DistributedSampler empty(3, {.num_replicas = 5, .rank = 0, .drop_last = true});
  EXPECT_TRUE(empty.begin() == empty.end());
  EXPECT_EQ(empty.position(), 0);
  EXPECT_TRUE(DistributedSampler::Iterator() == DistributedSampler::Sentinel());

  // Two passes at once over one cursor: the one that runs out of samples says so.
  DistributedSampler s(10, {.num_replicas = 2, .rank = 0});
  auto a = s.begin();  // hands out 1 of 5
  auto b = s.begin();  // continues at position 1: hands out the 2nd
  expect_config_error(
      [&] {
        while (!(b == s.end())) ++b;  // b consumes the rest of the epoch
        ++a;                          // a still has 4 to hand out
      },
      {"one pass at a time", "all 5 samples of epoch 0"});

  // set_epoch() to another epoch mid-loop: the loop finishes the old snapshot and leaves the
  // new epoch's cursor at 0.
  DistributedSampler t(20, {.num_replicas = 2, .rank = 1});
  const auto epoch0 = t.indices();
  std::vector<int64_t> got;
  for (int64_t i : t) {
    got.push_back(i);
    if (got.size() == 3) t.set_epoch(1);
  }
  EXPECT_EQ(got, epoch0);
  EXPECT_EQ(t.epoch(), 1);
  EXPECT_EQ(t.position(), 0);
}

// Consumes `steps` samples on every rank of a world of `R`; returns each rank's sampler.
std::vector<DistributedSampler> run_ranks_for(int64_t n, int R, int64_t steps,
                                              const SamplerOptions& base, int64_t epoch,
                                              std::map<int64_t, int>* seen) {
  std::vector<DistributedSampler> out;
  for (int r = 0; r < R; ++r) {
    SamplerOptions o = base;
    o.num_replicas = R;
    o.rank = r;
    DistributedSampler s(n, o);
    s.set_epoch(epoch);
    const auto idx = s.begin_pass();
    for (int64_t j = 0; j < steps && j < static_cast<int64_t>(idx.size()); ++j) ++(*seen)[idx[j]];
    s.advance(std::min<int64_t>(steps, static_cast<int64_t>(idx.size())));
    out.push_back(s);
  }
  return out;
}

TEST(SamplerResume, SameWorldSizeContinuesExactly) {
  const SamplerOptions base{.seed = 7};
  std::map<int64_t, int> seen;
  auto before = run_ranks_for(103, 4, 10, base, 5, &seen);
  const SamplerState st = before[0].state();  // a checkpoint saves rank 0's
  EXPECT_EQ(st.epoch, 5);
  EXPECT_EQ(st.position, 10);
  EXPECT_EQ(st.num_replicas, 4);
  EXPECT_EQ(st.consumed(), 40);
  for (int r = 0; r < 4; ++r) {
    DistributedSampler fresh(103, {.num_replicas = 4, .rank = r, .seed = 7});
    fresh.load_state(st);
    fresh.set_epoch(5);  // the trainer's loop does this; same epoch keeps the position
    const auto uninterrupted = before[r].indices();
    EXPECT_EQ(fresh.begin_pass(),
              std::vector<int64_t>(uninterrupted.begin() + 10, uninterrupted.end()));
    EXPECT_EQ(fresh.position(), 10);
  }
}

TEST(SamplerResume, FinishedEpochStaysFinishedAfterRestore) {
  DistributedSampler s(10, {.num_replicas = 2, .rank = 0});
  s.advance(5);
  DistributedSampler r(10, {.num_replicas = 2, .rank = 0});
  r.load_state(s.state());
  EXPECT_TRUE(r.begin_pass().empty());     // the interrupted run had finished this epoch
  EXPECT_EQ(r.begin_pass(), r.indices());  // a further pass repeats it, as without set_epoch
}

// World size change: the new ranks draw the rest of the permutation, so each sample of the
// epoch is drawn exactly once overall, plus the padding of the new plan.
TEST(SamplerResume, DifferentWorldSizeSeesEverySampleOnce) {
  for (bool drop_last : {false, true}) {
    for (auto [n, R1, steps1, R2, steps2, R3] :
         std::vector<std::tuple<int64_t, int, int64_t, int, int64_t, int>>{{103, 4, 7, 3, 5, 5},
                                                                           {100, 2, 10, 5, 3, 1},
                                                                           {10, 3, 3, 2, 0, 4},
                                                                           {17, 1, 4, 8, 1, 3},
                                                                           {50, 4, 13, 3, 0, 2}}) {
      const std::string at = fmt::format("n={} {}x{} -> {}x{} -> {} drop_last={}", n, R1, steps1,
                                         R2, steps2, R3, drop_last);
      const SamplerOptions base{.seed = 3, .drop_last = drop_last};
      std::map<int64_t, int> seen;
      auto first = run_ranks_for(n, R1, steps1, base, 2, &seen);
      SamplerState st = first[0].state();
      EXPECT_EQ(st.consumed(), std::min<int64_t>(n, st.position * R1)) << at;
      EXPECT_EQ(st.position, std::min<int64_t>(steps1, first[0].num_samples())) << at;

      // Second run at R2: consume steps2 each, then a third run at R3 drains the epoch.
      std::vector<DistributedSampler> second;
      for (int r = 0; r < R2; ++r) {
        DistributedSampler s(n, {.num_replicas = R2, .rank = r, .seed = 3, .drop_last = drop_last});
        s.load_state(st);
        s.set_epoch(2);
        const auto idx = s.begin_pass();
        const int64_t k = std::min<int64_t>(steps2, static_cast<int64_t>(idx.size()));
        for (int64_t j = 0; j < k; ++j) ++seen[idx[j]];
        s.advance(k);
        second.push_back(s);
      }
      st = second[0].state();
      int64_t third_total = 0;
      for (int r = 0; r < R3; ++r) {
        DistributedSampler s(n, {.num_replicas = R3, .rank = r, .seed = 3, .drop_last = drop_last});
        s.load_state(st);
        const auto idx = s.begin_pass();
        for (int64_t i : idx) ++seen[i];
        third_total += static_cast<int64_t>(idx.size());
      }
      EXPECT_EQ(third_total % R3, 0) << at << ": the new ranks must draw equally (DDP)";
      // Every sample once; only padding repeats (and drop_last only drops).
      int64_t dups = 0;
      for (auto& [i, c] : seen) {
        EXPECT_TRUE(i >= 0 && i < n) << at;
        dups += c - 1;
      }
      const int64_t rest = n - st.consumed();
      if (drop_last) {
        EXPECT_EQ(dups, 0) << at;
        EXPECT_GE(static_cast<int64_t>(seen.size()), n - (R1 + R2 + R3)) << at;
      } else {
        EXPECT_EQ(static_cast<int64_t>(seen.size()), n) << at << ": a sample was skipped";
        // Padding only in the last plan (earlier ones stopped mid-epoch): at most R3 - 1.
        EXPECT_LE(dups, rest > 0 ? R3 - 1 : R1 + R2) << at;
      }
    }
  }
}

// reshard() (a group re-formed in process, ddp::ft::Manager): the sampler in hand splits the
// rest of the epoch as a new sampler at the new size would after load_state(), from any size to
// any other (the same size too: ranks may move), and keeps doing so across several reshards.
TEST(SamplerResume, ReshardInPlaceSplitsTheRestAsANewSamplerWould) {
  for (auto [n, R1, steps1, R2, r2, R3, r3] :
       std::vector<std::tuple<int64_t, int, int64_t, int, int, int, int>>{{103, 4, 7, 3, 1, 5, 4},
                                                                          {96, 3, 5, 2, 0, 3, 2},
                                                                          {10, 3, 3, 3, 2, 1, 0}}) {
    const std::string at =
        fmt::format("n={} {}x{} -> rank {} of {} -> rank {} of {}", n, R1, steps1, r2, R2, r3, R3);
    DistributedSampler s(n, {.num_replicas = R1, .rank = 0, .seed = 3});
    s.set_epoch(1);
    s.advance(steps1);
    ASSERT_FALSE(s.remaining().empty());  // drawn at the old split: not to be reused after it
    const SamplerState before = s.state();
    s.reshard(R2, r2);
    DistributedSampler fresh(n, {.num_replicas = R2, .rank = r2, .seed = 3});
    fresh.load_state(before);
    EXPECT_EQ(s.remaining(), fresh.remaining()) << at;
    EXPECT_EQ(s.num_replicas(), R2) << at;
    EXPECT_EQ(s.rank(), r2) << at;
    EXPECT_EQ(s.state().consumed(), before.consumed()) << at << ": nothing consumed or lost";
    const int64_t k = std::min<int64_t>(2, static_cast<int64_t>(s.remaining().size()));
    s.advance(k);
    fresh.advance(k);
    const SamplerState middle = s.state();
    s.reshard(R3, r3);
    DistributedSampler third(n, {.num_replicas = R3, .rank = r3, .seed = 3});
    third.load_state(middle);
    EXPECT_EQ(s.remaining(), third.remaining()) << at;
    EXPECT_EQ(s.epoch(), 1) << at;
  }
  DistributedSampler s(10, {.num_replicas = 2, .rank = 0});
  EXPECT_THROW(s.reshard(0, 0), ConfigError);
  EXPECT_THROW(s.reshard(2, 2), ConfigError);
}

TEST(SamplerResume, MismatchedOrCorruptStatesAreConfigErrors) {
  DistributedSampler saved(100, {.num_replicas = 2, .rank = 0, .seed = 1});
  saved.advance(20);
  const SamplerState st = saved.state();
  expect_config_error([&] { DistributedSampler(101, {.seed = 1}).load_state(st); },
                      {"dataset_size = 100", "101"});
  expect_config_error([&] { DistributedSampler(100, {.seed = 2}).load_state(st); }, {"seed = 1"});
  expect_config_error(
      [&] { DistributedSampler(100, {.seed = 1, .drop_last = true}).load_state(st); },
      {"drop_last"});
  SamplerState bad = st;
  bad.position = 51;
  expect_config_error([&] { DistributedSampler(100, {.seed = 1}).load_state(bad); },
                      {"position 51", "[0, 50]"});
}

}  // namespace
}  // namespace ddp
