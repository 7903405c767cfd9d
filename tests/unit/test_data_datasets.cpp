// Datasets: the real Fashion-MNIST files, and damaged copies (truncated, bad magic, wrong
// counts, gzip garbage, bad CRC) that must fail naming the file and the problem.
#include <unistd.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/datasets.h"
#include "ddp/error.h"

namespace ddp {
namespace {

namespace fs = std::filesystem;

bool have_fashion_mnist() {
  return fs::exists(fs::path(kFashionMnistDefaultDir) / "train-images-idx3-ubyte.gz");
}

#define REQUIRE_FASHION_MNIST()                                                            \
  if (!have_fashion_mnist())                                                               \
  GTEST_SKIP() << "SKIPPED: Fashion-MNIST is not installed in " << kFashionMnistDefaultDir \
               << " (apt-get install dataset-fashion-mnist)"

TEST(FashionMnist, RealFilesHaveTheDocumentedShapeAndBalancedClasses) {
  REQUIRE_FASHION_MNIST();
  for (auto [split, n] : {std::pair{Split::kTrain, 60000}, std::pair{Split::kTest, 10000}}) {
    FashionMnist ds(split);
    ASSERT_EQ(ds.size(), n);
    EXPECT_EQ(ds.data().sizes(), (std::vector<int64_t>{n, 1, 28, 28}));
    EXPECT_EQ(ds.data().scalar_type(), torch::kFloat);
    EXPECT_EQ(ds.targets().scalar_type(), torch::kLong);
    EXPECT_GE(ds.data().min().item<float>(), 0.0f);
    EXPECT_LE(ds.data().max().item<float>(), 1.0f);
    EXPECT_EQ(ds.data().max().item<float>(), 1.0f);  // some pixel is 255
    const auto hist = torch::bincount(ds.targets(), {}, 10);
    EXPECT_TRUE(torch::equal(hist, torch::full({10}, n / 10, torch::kLong))) << hist;
    // get_batch gathers the rows asked for, in that order.
    const Batch b = ds.get_batch({7, 0, 7});
    EXPECT_TRUE(torch::equal(b.data[0], ds.data()[7]));
    EXPECT_TRUE(torch::equal(b.data[1], ds.data()[0]));
    EXPECT_EQ(b.target[2].item<int64_t>(), ds.targets()[7].item<int64_t>());
  }
}

TEST(FashionMnist, NormalizeUsesTheTrainingStatistics) {
  REQUIRE_FASHION_MNIST();
  FashionMnist raw(Split::kTrain);
  EXPECT_NEAR(raw.data().mean().item<double>(), kFashionMnistMean, 5e-4);
  EXPECT_NEAR(raw.data().std().item<double>(), kFashionMnistStd, 5e-4);
  FashionMnist norm(Split::kTrain, {.normalize = true});
  EXPECT_NEAR(norm.data().mean().item<double>(), 0.0, 2e-3);
  EXPECT_NEAR(norm.data().std().item<double>(), 1.0, 2e-3);
}

// A limit reads the first samples only, the same values as the whole split's first ones.
TEST(FashionMnist, ALimitReadsTheFirstSamplesOnly) {
  REQUIRE_FASHION_MNIST();
  FashionMnist all(Split::kTest, {.normalize = true});
  FashionMnist first(Split::kTest, {.normalize = true, .limit = 300});
  ASSERT_EQ(first.size(), 300);
  EXPECT_TRUE(torch::equal(first.data(), all.data().narrow(0, 0, 300)));
  EXPECT_TRUE(torch::equal(first.targets(), all.targets().narrow(0, 0, 300)));
  FashionMnist more(Split::kTest, {.limit = 20000});  // above the split's 10000: all of it
  EXPECT_EQ(more.size(), 10000);
}

TEST(FashionMnist, MissingDirectoryGivesTheInstallHint) {
  try {
    FashionMnist ds(Split::kTest, {.dir = "/nonexistent/fmnist"});
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("apt-get install dataset-fashion-mnist"), std::string::npos) << msg;
    EXPECT_NE(msg.find("/nonexistent/fmnist/t10k-images-idx3-ubyte.gz"), std::string::npos) << msg;
    EXPECT_NE(msg.find("FashionMnistOptions::dir"), std::string::npos) << msg;
  }
}

// A temp folder with IDX files written by the test.
class DamagedFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           fmt::format("ddp_test_idx_{}_{}", ::getpid(),
                       ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::vector<unsigned char> be32(std::initializer_list<uint32_t> fields) {
    std::vector<unsigned char> out;
    for (uint32_t f : fields) {
      for (int s = 24; s >= 0; s -= 8) out.push_back(static_cast<unsigned char>(f >> s));
    }
    return out;
  }
  // Header fields then `payload` bytes (value i % 10), gzip-compressed unless `gzip` is false.
  std::string write(const std::string& name, std::initializer_list<uint32_t> header, size_t payload,
                    bool gzip = true) {
    std::vector<unsigned char> bytes = be32(header);
    for (size_t i = 0; i < payload; ++i) bytes.push_back(static_cast<unsigned char>(i % 10));
    const std::string path = (dir_ / name).string();
    if (gzip) {
      gzFile f = gzopen(path.c_str(), "wb");
      gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size()));
      gzclose(f);
    } else {
      std::ofstream(path, std::ios::binary)
          .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    }
    return path;
  }
  std::string write_raw(const std::string& name, const std::vector<unsigned char>& bytes) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary)
        .write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
    return path;
  }
  static std::vector<unsigned char> slurp(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  }

  // Expects `fn` to throw DataError whose message names `path` and contains every needle.
  static void expect_data_error(const std::function<void()>& fn, const std::string& path,
                                std::initializer_list<std::string> needles) {
    try {
      fn();
      ADD_FAILURE() << "expected DataError for " << path;
    } catch (const DataError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(path), std::string::npos) << "message lacks the file: " << msg;
      for (const auto& n : needles) {
        EXPECT_NE(msg.find(n), std::string::npos) << "message lacks '" << n << "': " << msg;
      }
    }
  }

  fs::path dir_;
};

TEST_F(DamagedFiles, GoodSmallFilesReadGzippedOrNot) {
  auto images = read_idx_images(write("img.gz", {2051, 10, 28, 28}, 10 * 784));
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{10, 28, 28}));
  EXPECT_EQ(images.flatten()[13].item<int>(), 3);
  auto labels = read_idx_labels(write("lab", {2049, 10}, 10, /*gzip=*/false));
  EXPECT_EQ(labels[9].item<int>(), 9);
  // A limited read keeps the first images only, and still reads the rest through: a file cut
  // after them fails as a cut file does.
  auto three = read_idx_images(write("ten.gz", {2051, 10, 28, 28}, 10 * 784), 3);
  EXPECT_EQ(three.sizes(), (std::vector<int64_t>{3, 28, 28}));
  EXPECT_TRUE(torch::equal(three, images.narrow(0, 0, 3)));
  const auto cut = write("cut.gz", {2051, 10, 28, 28}, 4 * 784);
  EXPECT_EQ(read_idx_count(cut), 10);
  expect_data_error([&] { read_idx_images(cut, 3); }, cut,
                    {"expected 7840 bytes of pixels after the header, got 3136", "truncated"});
  // Unchecked past the part kept (check_rest false): the cut after it goes unnoticed, a cut
  // inside it does not.
  EXPECT_TRUE(torch::equal(read_idx_images(cut, 3, /*check_rest=*/false), images.narrow(0, 0, 3)));
  expect_data_error([&] { read_idx_images(cut, 5, /*check_rest=*/false); }, cut,
                    {"expected 7840 bytes of pixels after the header, got 3136", "truncated"});
  auto two = read_idx_labels(write("lab10", {2049, 10}, 10, /*gzip=*/false), 2, false);
  EXPECT_EQ(two.numel(), 2);
}

TEST_F(DamagedFiles, TruncatedPayload) {
  const auto p = write("img.gz", {2051, 10, 28, 28}, 5 * 784);
  expect_data_error([&] { read_idx_images(p); }, p,
                    {"expected 7840 bytes of pixels after the header, got 3920",
                     "the file is truncated"});
  const auto l = write("lab.gz", {2049, 60000}, 1000);
  expect_data_error([&] { read_idx_labels(l); }, l,
                    {"expected 60000 bytes of labels after the header, got 1000", "truncated"});
}

TEST_F(DamagedFiles, TruncatedGzipStream) {
  if (!have_fashion_mnist()) GTEST_SKIP() << "SKIPPED: needs dataset-fashion-mnist";
  auto bytes = slurp(std::string(kFashionMnistDefaultDir) + "/train-labels-idx1-ubyte.gz");
  bytes.resize(bytes.size() / 2);  // a download cut in the middle
  const auto p = write_raw("train-labels-idx1-ubyte.gz", bytes);
  expect_data_error([&] { read_idx_labels(p); }, p, {"expected 60000 bytes", "truncated"});
}

TEST_F(DamagedFiles, EmptyFileAndShortHeader) {
  const auto p = write_raw("empty.gz", {});
  expect_data_error([&] { read_idx_images(p); }, p, {"header is 0 bytes, expected 16"});
  const auto q = write("short.gz", {2051, 10}, 0);
  expect_data_error([&] { read_idx_images(q); }, q, {"header is 8 bytes", "truncated"});
}

TEST_F(DamagedFiles, BadMagic) {
  const auto p = write("img.gz", {2052, 10, 28, 28}, 10 * 784);
  expect_data_error([&] { read_idx_images(p); }, p, {"magic number 2052", "expected 2051"});
  // An image file given as labels.
  const auto q = write("lab.gz", {2051, 10, 28, 28}, 10 * 784);
  expect_data_error([&] { read_idx_labels(q); }, q, {"magic number 2051", "expected 2049"});
}

TEST_F(DamagedFiles, CountSmallerThanThePayload) {
  const auto p = write("img.gz", {2051, 9, 28, 28}, 10 * 784);
  expect_data_error([&] { read_idx_images(p); }, p,
                    {"data continues after the 7056 bytes", "count in the header is wrong"});
}

TEST_F(DamagedFiles, ImageAndLabelCountsDisagree) {
  write("t10k-images-idx3-ubyte.gz", {2051, 10, 28, 28}, 10 * 784);
  const auto l = write("t10k-labels-idx1-ubyte.gz", {2049, 9}, 9);
  expect_data_error([&] { FashionMnist(Split::kTest, {.dir = dir_.string()}); }, l,
                    {"holds 10 images but", "holds 9 labels"});
}

TEST_F(DamagedFiles, LabelOutOfRangeAndWrongImageSize) {
  write("t10k-images-idx3-ubyte.gz", {2051, 10, 28, 28}, 10 * 784);
  auto bytes = be32({2049, 10});
  for (int i = 0; i < 10; ++i) bytes.push_back(i == 4 ? 12 : 1);
  const auto l = write_raw("t10k-labels-idx1-ubyte", bytes);  // uncompressed copies work too
  expect_data_error([&] { FashionMnist(Split::kTest, {.dir = dir_.string()}); }, l,
                    {"label 12 is outside [0, 10)"});
  fs::remove(l);
  write("t10k-labels-idx1-ubyte.gz", {2049, 10}, 10);
  const auto i = write("t10k-images-idx3-ubyte.gz", {2051, 10, 32, 32}, 10 * 1024);
  expect_data_error([&] { FashionMnist(Split::kTest, {.dir = dir_.string()}); }, i,
                    {"images are 32x32"});
}

TEST_F(DamagedFiles, GzipGarbage) {
  // A gzip member header followed by bytes that are not deflate data.
  std::vector<unsigned char> bytes = {0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 3};
  for (int i = 0; i < 200; ++i) bytes.push_back(static_cast<unsigned char>(i * 37 + 11));
  const auto p = write_raw("img.gz", bytes);
  expect_data_error([&] { read_idx_images(p); }, p, {"gzip stream is corrupt"});
}

TEST_F(DamagedFiles, BadCrc) {
  const auto good = write("lab.gz", {2049, 100}, 100);
  auto bytes = slurp(good);
  bytes[bytes.size() - 8] ^= 0xff;  // the CRC-32 in the gzip trailer
  const auto p = write_raw("lab_crc.gz", bytes);
  expect_data_error([&] { read_idx_labels(p); }, p, {"gzip stream is corrupt"});
}

TEST_F(DamagedFiles, MissingFile) {
  const auto p = (dir_ / "absent.gz").string();
  expect_data_error([&] { read_idx_images(p); }, p, {"cannot open"});
}

TEST(TensorDataset, ChecksShapesAndIndices) {
  EXPECT_THROW(TensorDataset(torch::zeros({4, 2}), torch::zeros({5})), ConfigError);
  EXPECT_THROW(TensorDataset(torch::zeros({}), torch::zeros({})), ConfigError);
  TensorDataset ds(torch::arange(8).view({4, 2}), torch::arange(4));
  EXPECT_EQ(ds.size(), 4);
  const Batch b = ds.get_batch({3, 1});
  EXPECT_TRUE(torch::equal(b.data, torch::tensor({{6, 7}, {2, 3}})));
  try {
    ds.get_batch({0, 4});
    FAIL() << "expected DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("index 4 (entry 1 of the batch) is outside [0, 4)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace ddp
