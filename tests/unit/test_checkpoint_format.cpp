// Damaged checkpoint files: empty, truncated (in the header, the metadata, the payload),
// flipped bytes (header, metadata, payload), wrong magic, trailing bytes, a newer format
// version. Each is a CorruptCheckpointError naming the file and the problem, detected before
// the payload is used (the checksum messages prove the order), and the caller's model and
// optimizer are left untouched. And a file of format 1 (ddp-cpp 0.1.0) still loads, every value
// as written.
#include <cstdlib>  // getenv
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "c10d/compat.h"        // optimizer_state_key
#include "checkpoint/format.h"  // kHeaderBytes, Sha256: to forge a header with a valid checksum
#include "ddp/checkpoint.h"
#include "ddp/sampler.h"
#include "test_checkpoint_support.h"

namespace ddp {
namespace {

using testing::Net;
using testing::TempDir;

class DamagedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    torch::manual_seed(0);
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto loss = net->forward(torch::randn({8, 20})).sum();
    loss.backward();
    opt.step();
    TrainingState saved;
    saved.add("model", net);
    saved.add("optimizer", opt);
    save_checkpoint(dir / "good.ckpt", saved, {.step = 3, .epoch = 1});
    good = testing::read_bytes(dir / "good.ckpt");
    uint32_t m = 0;
    std::memcpy(&m, good.data() + 12, 4);  // little-endian on the machines we run on
    meta_size = m;
    ASSERT_GT(good.size(), ckpt::kHeaderBytes + meta_size);

    torch::manual_seed(1);
    target = Net();
    target_opt = std::make_unique<torch::optim::SGD>(target->parameters(),
                                                     torch::optim::SGDOptions(0.5).momentum(0.9));
    target_state.add("model", target);
    target_state.add("optimizer", *target_opt);
  }

  size_t payload_offset() const { return ckpt::kHeaderBytes + meta_size; }

  static std::string flip(std::string bytes, size_t at) {
    bytes[at] = static_cast<char>(bytes[at] ^ 0x5a);
    return bytes;
  }

  // Writes `content` as `name`, then: load, verify and (unless the payload is the problem)
  // read_checkpoint_meta each throw CorruptCheckpointError naming the file and `what`; the
  // target model and optimizer are unchanged.
  void expect_corrupt(const std::string& name, const std::string& content, const std::string& what,
                      bool header_level = true) {
    SCOPED_TRACE(name);
    const auto file = dir / name;
    testing::write_bytes(file, content);
    const auto before = testing::snapshot(*target);
    auto check = [&](const std::function<void()>& fn, const char* op) {
      try {
        fn();
        ADD_FAILURE() << op << " accepted a damaged file";
      } catch (const CorruptCheckpointError& e) {
        const std::string msg = e.what();
        EXPECT_NE(msg.find(file.string()), std::string::npos) << op << ": " << msg;
        EXPECT_NE(msg.find(what), std::string::npos) << op << ": " << msg;
      } catch (const std::exception& e) {
        ADD_FAILURE() << op << " threw something else: " << e.what();
      }
    };
    check([&] { load_checkpoint(file, target_state); }, "load_checkpoint");
    check([&] { verify_checkpoint(file); }, "verify_checkpoint");
    if (header_level) check([&] { read_checkpoint_meta(file); }, "read_checkpoint_meta");
    EXPECT_TRUE(testing::same_as_snapshot(*target, before));
    EXPECT_TRUE(target_opt->state().empty());
  }

  TempDir dir;
  Net net;
  std::string good;
  size_t meta_size = 0;
  Net target{nullptr};
  std::unique_ptr<torch::optim::SGD> target_opt;
  TrainingState target_state;
};

TEST_F(DamagedCheckpoint, TheIntactFileLoads) {
  verify_checkpoint(dir / "good.ckpt");
  const auto got = load_checkpoint(dir / "good.ckpt", target_state);
  EXPECT_EQ(got.meta.step, 3);
  EXPECT_TRUE(testing::bitwise_equal(*net, *target));
}

TEST_F(DamagedCheckpoint, EmptyFile) {
  expect_corrupt("empty.ckpt", "", "the file is empty (0 bytes)");
}

TEST_F(DamagedCheckpoint, TruncatedPayload) {
  const std::string cut = good.substr(0, good.size() - 100);
  expect_corrupt("cut-payload.ckpt", cut,
                 fmt::format("truncated: the file has {} bytes, its header declares {}", cut.size(),
                             good.size()));
  expect_corrupt("cut-after-metadata.ckpt", good.substr(0, payload_offset()), "truncated");
}

TEST_F(DamagedCheckpoint, TruncatedHeaderOrMetadata) {
  expect_corrupt("cut-header.ckpt", good.substr(0, 40),
                 "truncated: the file has 40 bytes, less than the 88-byte header");
  expect_corrupt("cut-metadata.ckpt", good.substr(0, ckpt::kHeaderBytes + meta_size / 2),
                 "truncated (or a damaged header)");
}

TEST_F(DamagedCheckpoint, FlippedPayloadByte) {
  const size_t mid = payload_offset() + (good.size() - payload_offset()) / 2;
  expect_corrupt("flip-payload.ckpt", flip(good, mid), "payload checksum mismatch", false);
  expect_corrupt("flip-last.ckpt", flip(good, good.size() - 1), "payload checksum mismatch", false);
}

TEST_F(DamagedCheckpoint, FlippedHeaderOrMetadataByte) {
  expect_corrupt("flip-version.ckpt", flip(good, 8), "header checksum mismatch");
  expect_corrupt("flip-payload-length.ckpt", flip(good, 17), "header checksum mismatch");
  expect_corrupt("flip-payload-digest.ckpt", flip(good, 30), "header checksum mismatch");
  expect_corrupt("flip-header-digest.ckpt", flip(good, 60), "header checksum mismatch");
  expect_corrupt("flip-metadata.ckpt", flip(good, ckpt::kHeaderBytes + meta_size / 2),
                 "header checksum mismatch");
  expect_corrupt("flip-metadata-length.ckpt", flip(good, 15), "damaged header");
}

TEST_F(DamagedCheckpoint, WrongMagic) {
  expect_corrupt("magic.ckpt", flip(good, 0), "not a ddp-cpp checkpoint");
  // A LibTorch archive (what torch::save writes) is not a checkpoint either.
  std::ostringstream os;
  torch::save(net, os);
  expect_corrupt("torch-save.ckpt", os.str(),
                 R"(not a ddp-cpp checkpoint: it starts with "PK\x03\x04)");
  expect_corrupt("tiny.ckpt", "DDP", R"(it starts with "DDP", expected "DDP-CKPT")");
}

TEST_F(DamagedCheckpoint, TrailingBytes) {
  expect_corrupt("trailing.ckpt", good + "xyz", "3 unexpected bytes after the");
}

TEST_F(DamagedCheckpoint, NewerFormatVersion) {
  // A well-formed header (valid checksum) of a version this build does not know.
  std::string forged = good;
  forged[8] = 3;
  ckpt::Sha256 h;
  h.update(forged.data(), ckpt::kHeaderHashedBytes);
  h.update(forged.data() + ckpt::kHeaderBytes, meta_size);
  const ckpt::Digest d = h.finish();
  std::memcpy(forged.data() + ckpt::kHeaderHashedBytes, d.data(), d.size());
  expect_corrupt("v3.ckpt", forged,
                 "format version 3; this build of ddp-cpp reads versions 1 to 2");
}

// Every byte of the header and metadata, and a stride through the payload: no single flipped
// byte is ever accepted or reaches LibTorch (a LibTorch failure would name LibTorch; a silently
// accepted flip would fail the test).
TEST_F(DamagedCheckpoint, NoSingleByteFlipIsAccepted) {
  const auto file = dir / "sweep.ckpt";
  int checked = 0;
  for (size_t at = 0; at < good.size(); at += (at < payload_offset() ? 1 : 37)) {
    testing::write_bytes(file, flip(good, at));
    try {
      load_checkpoint(file, target_state);
      ADD_FAILURE() << "a flip at byte " << at << " was accepted";
    } catch (const CorruptCheckpointError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.find("LibTorch"), std::string::npos) << "byte " << at << ": " << msg;
    }
    ++checked;
  }
  EXPECT_GT(checked, 200);
}

TEST_F(DamagedCheckpoint, MissingFileOrDirectory) {
  try {
    load_checkpoint(dir / "absent.ckpt", target_state);
    ADD_FAILURE() << "no error for a missing file";
  } catch (const CorruptCheckpointError&) {
    ADD_FAILURE() << "a missing file is an I/O error, not a damaged file";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open the checkpoint: No such file"),
              std::string::npos)
        << e.what();
  }
  std::filesystem::create_directory(dir / "dir.ckpt");
  EXPECT_THROW(verify_checkpoint(dir / "dir.ckpt"), CorruptCheckpointError);
}

// --- format 1 -------------------------------------------------------------------------------

// tests/data/format1/format1.ckpt, written by ddp-cpp 0.1.0 (63541dc) with the program beside
// it, whose comment gives every value as a formula.
TEST(LegacyFormat1, AFileOfFormat1LoadsEveryValueAsWritten) {
  const char* file = std::getenv("DDP_FORMAT1_CHECKPOINT");
  ASSERT_NE(file, nullptr) << "DDP_FORMAT1_CHECKPOINT (set by ctest) names the fixture";
  const CheckpointMeta m = read_checkpoint_meta(file);
  EXPECT_EQ(m.format_version, 1u);
  EXPECT_EQ(m.keys, (std::vector<std::string>{"model", "optimizer", "sampler", "rng"}));
  EXPECT_EQ(m.ddp_version, "0.1.0");
  verify_checkpoint(file);

  torch::manual_seed(5);
  Net net(32);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
  DistributedSampler sampler(50, {.num_replicas = 1, .rank = 0, .seed = 9});
  TrainingState state;
  state.add("model", net);
  state.add("optimizer", opt);
  state.add("sampler", sampler);
  state.add("rng", default_generators());
  torch::manual_seed(1234);
  const LoadedCheckpoint got = load_checkpoint(file, state);

  EXPECT_EQ(got.meta.step, 9);
  EXPECT_EQ(got.meta.epoch, 3);
  EXPECT_EQ(got.meta.hparams_json, R"({"lr":0.05})");
  EXPECT_EQ(got.meta.model_label, "--model fixture");
  EXPECT_EQ(got.meta.blob,
            R"({"bucket_order":[3,2,1,0],"test":{"correct":81,"count":100,"loss_sum":42.5}})");
  EXPECT_TRUE(got.per_rank_exact);
  // The model: each tensor its formula; the parameters after SGD's one step (lr 0.05, the
  // momentum buffer 0.01), done here as SGD does it.
  int64_t index = 0;
  auto expect = [&](const std::string& name, const at::Tensor& t, bool stepped) {
    at::Tensor want;
    if (t.scalar_type() == at::kLong) {
      want = torch::full_like(t, 7);
    } else {
      want = (torch::arange(t.numel()) % 97)
                 .to(t.dtype())
                 .mul(0.001)
                 .sub(0.05)
                 .add(0.1 * static_cast<double>(index))
                 .view(t.sizes());
      if (stepped) want.add_(torch::full_like(want, 0.01), -0.05);
    }
    EXPECT_TRUE(torch::equal(t, want)) << name;
    ++index;
  };
  for (const auto& p : net->named_parameters()) expect(p.key(), p.value(), true);
  for (const auto& b : net->named_buffers()) expect(b.key(), b.value(), false);
  // The optimizer: momentum buffers of 0.01 and the learning rate a scheduler had set.
  EXPECT_DOUBLE_EQ(opt.param_groups()[0].options().get_lr(), 0.0123);
  for (const auto& p : net->parameters()) {
    const auto key = c10d_compat::optimizer_state_key(p);
    ASSERT_TRUE(opt.state().count(key));
    const auto& s = static_cast<torch::optim::SGDParamState&>(*opt.state().at(key));
    EXPECT_TRUE(torch::equal(s.momentum_buffer(), torch::full_like(p, 0.01)));
  }
  // The sampler, and the generator: the stream continues after manual_seed(42), rand({3}).
  EXPECT_EQ(sampler.epoch(), 3);
  EXPECT_EQ(sampler.position(), 17);
  const at::Tensor next = torch::rand({5});
  torch::manual_seed(42);
  torch::rand({3});
  EXPECT_TRUE(torch::equal(next, torch::rand({5})));

  // Its states through the in-memory door too: decoded, they hold the same model.
  const DecodedCheckpoint d = decode_checkpoint(testing::read_bytes(file), "format1");
  ASSERT_NE(d.snapshot.find("model"), nullptr);
  EXPECT_TRUE(torch::equal(*d.snapshot.find("model")->ranks[0].find("fc2.bias"),
                           net->named_parameters()["fc2.bias"]));
}

}  // namespace
}  // namespace ddp
