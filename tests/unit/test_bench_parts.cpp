// ddp-bench's pure parts (tools/ddp_bench): sizes and sweeps, nccl-tests' bus factors, the
// verification pattern, the command line. No process group, no processes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cli.h"
#include "ddp/error.h"
#include "pattern.h"
#include "sweep.h"

namespace ddp::bench {
namespace {

TEST(BenchSweep, ParseAndFormatBytes) {
  EXPECT_EQ(parse_bytes("--x", "8"), 8);
  EXPECT_EQ(parse_bytes("--x", "64K"), 65536);
  EXPECT_EQ(parse_bytes("--x", "4m"), 4 << 20);
  EXPECT_EQ(parse_bytes("--x", "256MiB"), int64_t{256} << 20);
  EXPECT_EQ(parse_bytes("--x", "1G"), int64_t{1} << 30);
  EXPECT_EQ(parse_bytes("--x", "12B"), 12);
  for (const char* bad : {"", "0", "-8", "8X", "K", "1.5M", "99999999999G"}) {
    SCOPED_TRACE(bad);
    try {
      parse_bytes("--max-bytes", bad);
      ADD_FAILURE() << "accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("--max-bytes"), std::string::npos) << e.what();
    }
  }
  EXPECT_EQ(format_bytes(8), "8 B");
  EXPECT_EQ(format_bytes(65536), "64 KiB");
  EXPECT_EQ(format_bytes(int64_t{256} << 20), "256 MiB");
  EXPECT_EQ(format_bytes(1000), "1000 B");
  EXPECT_EQ(format_bytes(3 << 10), "3 KiB");
}

TEST(BenchSweep, DoublingSizes) {
  EXPECT_EQ(doubling_sizes(8, 64), (std::vector<int64_t>{8, 16, 32, 64}));
  EXPECT_EQ(doubling_sizes(8, 100), (std::vector<int64_t>{8, 16, 32, 64}));
  EXPECT_EQ(doubling_sizes(4096, 4096), (std::vector<int64_t>{4096}));
  EXPECT_EQ(doubling_sizes(8, int64_t{256} << 20).size(), 26u);  // 2^3 .. 2^28
  EXPECT_THROW(doubling_sizes(0, 8), ConfigError);
  EXPECT_THROW(doubling_sizes(16, 8), ConfigError);
}

TEST(BenchSweep, SplitList) {
  EXPECT_EQ(split_list("gloo,shm"), (std::vector<std::string>{"gloo", "shm"}));
  EXPECT_EQ(split_list(" gloo , ,shm,"), (std::vector<std::string>{"gloo", "shm"}));
  EXPECT_TRUE(split_list("").empty());
}

// nccl-tests' doc/PERFORMANCE.md.
TEST(BenchSweep, BusFactorsAndElementCounts) {
  EXPECT_DOUBLE_EQ(bus_factor("all_reduce", 2), 1.0);
  EXPECT_DOUBLE_EQ(bus_factor("all_reduce", 4), 1.5);
  EXPECT_DOUBLE_EQ(bus_factor("all_reduce", 1), 0.0);
  EXPECT_DOUBLE_EQ(bus_factor("all_gather", 4), 0.75);
  EXPECT_DOUBLE_EQ(bus_factor("reduce_scatter", 2), 0.5);
  EXPECT_DOUBLE_EQ(bus_factor("broadcast", 8), 1.0);
  EXPECT_THROW(bus_factor("alltoall", 2), ConfigError);
  EXPECT_EQ(elements_for("all_reduce", 8, 4, 3), 2);
  EXPECT_EQ(elements_for("all_gather", 64, 4, 3), 15);    // 16 elements, whole shares of 5
  EXPECT_EQ(elements_for("reduce_scatter", 8, 4, 4), 0);  // less than one element per rank
  EXPECT_EQ(elements_for("broadcast", 7, 4, 2), 1);
}

TEST(BenchSweep, MedianAndRing) {
  EXPECT_DOUBLE_EQ(median({}), 0);
  EXPECT_DOUBLE_EQ(median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 3);
  EXPECT_EQ(ring_slots(64, 64 << 20), 1 << 20);
  EXPECT_EQ(ring_slots(int64_t{256} << 20, 64 << 20), 1);
  EXPECT_EQ(ring_slots(48 << 20, 64 << 20), 2);
}

// Every dtype: a periodic fill reads back, a shifted tile does not match, and sums of shifted
// tiles over ranks are exact (what all_reduce and reduce_scatter must produce).
TEST(BenchPattern, FillMatchAndExactSums) {
  for (const char* name : {"float32", "float64", "bfloat16", "float16", "int32", "int64"}) {
    SCOPED_TRACE(name);
    const at::ScalarType type = parse_dtype(name);
    EXPECT_EQ(dtype_name(type), name);
    for (int64_t n : {1, 3, 4, 10}) {
      at::Tensor buf = at::zeros({n}, type);
      fill_periodic(buf, tile(5, type));
      EXPECT_TRUE(matches_periodic(buf, tile(5, type)));
      EXPECT_TRUE(matches_periodic(buf, tile(1, type)));  // offsets are taken mod 4
      EXPECT_FALSE(matches_periodic(buf, tile(6, type)));
      EXPECT_EQ(buf[0].item<double>(), 2);  // ((5 + 0) mod 4) + 1
    }
    // 64 ranks: sums up to 4 * 64 = 256, exact even in bfloat16.
    at::Tensor sum = at::zeros({7}, type);
    for (int r = 0; r < 64; ++r) {
      at::Tensor part = at::empty({7}, type);
      fill_periodic(part, tile(3 + r, type));
      sum += part;
    }
    EXPECT_TRUE(matches_periodic(sum, summed_tile(3, 64, type)));
  }
  EXPECT_THROW(parse_dtype("float8"), ConfigError);
}

CommandLine parse(std::vector<std::string> args) { return parse_command_line(args); }

TEST(BenchCli, CollectivesDefaultsAndValues) {
  CommandLine d = parse({"collectives"});
  ASSERT_EQ(d.mode, CommandLine::Mode::kCollectives);
  EXPECT_EQ(d.collectives.backends, (std::vector<std::string>{"gloo", "shm", "shm-inplace"}));
  EXPECT_EQ(d.collectives.ops.size(), 4u);
  EXPECT_EQ(d.collectives.dtypes, std::vector<std::string>{"float32"});
  EXPECT_EQ(d.collectives.min_bytes, 8);
  EXPECT_EQ(d.collectives.max_bytes, int64_t{256} << 20);
  EXPECT_EQ(d.collectives.ring_bytes, int64_t{64} << 20);
  EXPECT_EQ(d.collectives.iters, 20);
  EXPECT_EQ(d.collectives.warmup, 5);

  CommandLine c = parse({"collectives", "--backend", "shm", "--ops", "all_reduce,broadcast",
                         "--dtype", "bfloat16,int64", "--min-bytes", "1K", "--max-bytes", "4M",
                         "--iters", "3", "--warmup", "0", "--csv", "a.csv", "--png", "a.png"});
  EXPECT_EQ(c.collectives.backends, std::vector<std::string>{"shm"});
  EXPECT_EQ(c.collectives.ops, (std::vector<std::string>{"all_reduce", "broadcast"}));
  EXPECT_EQ(c.collectives.dtypes, (std::vector<std::string>{"bfloat16", "int64"}));
  EXPECT_EQ(c.collectives.min_bytes, 1024);
  EXPECT_EQ(c.collectives.max_bytes, 4 << 20);
  EXPECT_EQ(c.collectives.iters, 3);
  EXPECT_EQ(c.collectives.warmup, 0);
  EXPECT_EQ(c.collectives.csv, "a.csv");
  EXPECT_EQ(c.collectives.png, "a.png");
}

TEST(BenchCli, TrainDefaultsAndValues) {
  CommandLine d = parse({"train"});
  ASSERT_EQ(d.mode, CommandLine::Mode::kTrain);
  EXPECT_EQ(d.train.model, "classic-cnn");
  EXPECT_EQ(d.train.global_batch, 128);
  EXPECT_DOUBLE_EQ(d.train.momentum, 0.9);
  EXPECT_TRUE(d.train.backend.empty());
  EXPECT_EQ(d.train.device, "auto");
  EXPECT_FALSE(d.train.compare);

  CommandLine t = parse({"train", "--model", "mlp-1024", "--batch-size", "64", "--steps", "5",
                         "--warmup", "1", "--backend", "gloo", "--threads", "2", "--compare",
                         "--repeats", "3", "--csv", "t.csv"});
  EXPECT_EQ(t.train.model, "mlp-1024");
  EXPECT_EQ(t.train.global_batch, 64);
  EXPECT_EQ(t.train.steps, 5);
  EXPECT_EQ(t.train.warmup, 1);
  EXPECT_EQ(t.train.backend, "gloo");
  EXPECT_EQ(t.train.threads, 2);
  EXPECT_TRUE(t.train.compare);
  EXPECT_EQ(t.train.repeats, 3);
  EXPECT_EQ(t.train.csv, "t.csv");
  EXPECT_EQ(parse({"train", "--device", "cpu"}).train.device, "cpu");
}

TEST(BenchCli, HelpAndErrors) {
  EXPECT_EQ(parse({}).mode, CommandLine::Mode::kHelp);
  const CommandLine help = parse({"--help"});
  EXPECT_EQ(help.mode, CommandLine::Mode::kHelp);
  for (const char* s : {"collectives", "train", "--max-bytes", "--compare", "classic-cnn"}) {
    EXPECT_NE(help.help_text.find(s), std::string::npos) << s;
  }
  EXPECT_THROW(parse({"collectives", "--ops", "alltoall"}), ConfigError);
  EXPECT_THROW(parse({"collectives", "--max-bytes", "lots"}), ConfigError);
  EXPECT_THROW(parse({"collectives", "--min-bytes", "1M", "--max-bytes", "1K"}), ConfigError);
  EXPECT_THROW(parse({"collectives", "--backend", ","}), ConfigError);
  EXPECT_THROW(parse({"train", "--model", "vgg"}), ConfigError);
  EXPECT_THROW(parse({"train", "--steps", "0"}), ConfigError);
  EXPECT_THROW(parse({"train", "--device", "tpu"}), ConfigError);
  EXPECT_THROW(parse({"bogus"}), ConfigError);
}

}  // namespace
}  // namespace ddp::bench
