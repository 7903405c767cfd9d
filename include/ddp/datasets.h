// The datasets ddp-cpp ships: Fashion-MNIST (Debian's dataset-fashion-mnist) and the IDX files it
// is stored in. The Dataset interface itself: ddp/dataset.h.
//
//   ddp::FashionMnist train(ddp::Split::kTrain);            // Debian's dataset-fashion-mnist
//   ddp::Batch b = train.get_batch({0, 1, 2});              // b.data [3,1,28,28], b.target [3]
#pragma once

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "ddp/dataset.h"

namespace ddp {

// --- IDX files (the MNIST format): big-endian header, then raw uint8 payload.
//   images: magic 2051, count, rows, cols, then count*rows*cols pixels (row-major)
//   labels: magic 2049, count, then count labels
// Files are read through zlib, so both `.gz` and uncompressed files work. Every problem is a
// ddp::DataError naming the file and what was wrong: a missing file, a bad magic number, a
// header or payload shorter than declared ("the file is truncated"), bytes after the payload,
// or a damaged gzip stream.

// uint8 [count, rows, cols]; `limit` > 0: the first min(limit, count) images only. The rest is
// still read through, unkept, so that a truncated or damaged file fails as it would otherwise;
// with `check_rest` false it is not (faster: the train images are 0.4 CPU-s to decompress), and
// only the part kept is checked (a damaged byte there may go unnoticed: the gzip CRC covers the
// whole file).
at::Tensor read_idx_images(const std::string& path, int64_t limit = 0, bool check_rest = true);
// uint8 [count]; `limit` and `check_rest` as above.
at::Tensor read_idx_labels(const std::string& path, int64_t limit = 0, bool check_rest = true);
// The item count in the header of an IDX images or labels file.
int64_t read_idx_count(const std::string& path);

// --- Fashion-MNIST (Zalando): 28x28 grey images of 10 kinds of clothing; 60000 train and
// 10000 test samples, 6000 / 1000 per class.

// Where Debian's package `dataset-fashion-mnist` installs the four .gz files.
inline constexpr const char* kFashionMnistDefaultDir = "/usr/share/datasets/fashion-mnist";
// Mean and standard deviation of the training pixels after scaling to [0, 1].
inline constexpr double kFashionMnistMean = 0.2860;
inline constexpr double kFashionMnistStd = 0.3530;

enum class Split { kTrain, kTest };

struct FashionMnistOptions {
  // Folder with {train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz] (torchvision's raw/ folder
  // works too). Empty: kFashionMnistDefaultDir.
  std::string dir;
  // false: pixels / 255 in [0, 1]. true: then (x - kFashionMnistMean) / kFashionMnistStd.
  bool normalize = false;
  // > 0: the first `limit` samples only (all when the split has fewer): a run on a subset
  // converts and keeps only those (the files are still read through and checked).
  int64_t limit = 0;
  // With a `limit`: false reads the files only as far as the samples kept, unchecked past them
  // (read_idx_images). For the processes of a job that share the files on one host, where one
  // of them (ddp-train: each host's local rank 0) reads them whole and so checks them for all.
  bool check_whole_files = true;
};

// data: float [N, 1, 28, 28]; targets: int64 [N] in [0, 9]. Loads the split eagerly (about 0.3 s
// and 188 MB for the training set). Throws ddp::DataError when the files are missing (the
// message says `apt-get install dataset-fashion-mnist` or how to point `dir` elsewhere) or
// malformed, or when image and label counts differ.
class FashionMnist : public TensorDataset {
 public:
  explicit FashionMnist(Split split, const FashionMnistOptions& options = {});
  static constexpr int64_t kNumClasses = 10;
};

}  // namespace ddp
