// Damaged checkpoint files: empty, truncated (in the header, the metadata, the payload),
// flipped bytes (header, metadata, payload), wrong magic, trailing bytes, a newer format
// version. Each is a CorruptCheckpointError naming the file and the problem, detected before
// the payload reaches LibTorch (the checksum messages prove the order), and the caller's model
// and optimizer are left untouched.
#include <cstring>
#include <functional>

#include <fmt/format.h>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "checkpoint/format.h"  // kHeaderBytes, Sha256: to forge a header with a valid checksum
#include "ddp/checkpoint.h"
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
    save_checkpoint(dir / "good.ckpt", {.model = net.get(), .optimizer = &opt},
                    {.step = 3, .epoch = 1});
    good = testing::read_bytes(dir / "good.ckpt");
    uint32_t m = 0;
    std::memcpy(&m, good.data() + 12, 4);  // little-endian on the machines we run on
    meta_size = m;
    ASSERT_GT(good.size(), ckpt::kHeaderBytes + meta_size);

    torch::manual_seed(1);
    target = Net();
    target_opt = std::make_unique<torch::optim::SGD>(target->parameters(),
                                                     torch::optim::SGDOptions(0.5).momentum(0.9));
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
    check([&] { load_checkpoint(file, {.model = target.get(), .optimizer = target_opt.get()}); },
          "load_checkpoint");
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
};

TEST_F(DamagedCheckpoint, TheIntactFileLoads) {
  verify_checkpoint(dir / "good.ckpt");
  const auto got =
      load_checkpoint(dir / "good.ckpt", {.model = target.get(), .optimizer = target_opt.get()});
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
  forged[8] = 2;
  ckpt::Sha256 h;
  h.update(forged.data(), ckpt::kHeaderHashedBytes);
  h.update(forged.data() + ckpt::kHeaderBytes, meta_size);
  const ckpt::Digest d = h.finish();
  std::memcpy(forged.data() + ckpt::kHeaderHashedBytes, d.data(), d.size());
  expect_corrupt("v2.ckpt", forged, "format version 2; this build of ddp-cpp reads version 1");
}

// Every byte of the header and metadata, and a stride through the payload: no single flipped
// byte is ever accepted or reaches LibTorch (a LibTorch failure would read "LibTorch cannot
// read it"; a silently accepted flip would fail the test).
TEST_F(DamagedCheckpoint, NoSingleByteFlipIsAccepted) {
  const auto file = dir / "sweep.ckpt";
  int checked = 0;
  for (size_t at = 0; at < good.size(); at += (at < payload_offset() ? 1 : 37)) {
    testing::write_bytes(file, flip(good, at));
    try {
      load_checkpoint(file, {.model = target.get(), .optimizer = target_opt.get()});
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
    load_checkpoint(dir / "absent.ckpt", {.model = target.get()});
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

}  // namespace
}  // namespace ddp
