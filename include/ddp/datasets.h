// Datasets: indexable collections of (data, target) samples that a DataLoader batches.
//
//   ddp::FashionMnist train(ddp::Split::kTrain);            // Debian's dataset-fashion-mnist
//   ddp::Batch b = train.get_batch({0, 1, 2});              // b.data [3,1,28,28], b.target [3]
//   ddp::TensorDataset toy(torch::randn({100, 4}), torch::arange(100));
//
// A Dataset is read-only after construction and get_batch() is called from the loader's worker
// threads concurrently, so implementations must be thread-safe for reads (the ones here are:
// they hold tensors and only index_select from them).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace ddp {

// A batch of samples: data [B, ...] and target [B, ...], row i from the i-th requested index.
struct Batch {
  at::Tensor data;
  at::Tensor target;
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual int64_t size() const = 0;
  // Rows `indices` (each in [0, size()), repeats allowed) in that order. Thread-safe.
  // Throws ddp::DataError for an index out of range.
  virtual Batch get_batch(const std::vector<int64_t>& indices) const = 0;
};

// Samples held in memory: data[i] and targets[i] are sample i. Batches are index_select
// gathers (one copy of the selected rows, no per-sample work).
class TensorDataset : public Dataset {
 public:
  // Throws ddp::ConfigError unless data and targets are defined, at least 1-D, CPU or on one
  // device, and agree on their first dimension.
  TensorDataset(at::Tensor data, at::Tensor targets);

  int64_t size() const override;
  Batch get_batch(const std::vector<int64_t>& indices) const override;

  const at::Tensor& data() const { return data_; }
  const at::Tensor& targets() const { return targets_; }

 private:
  at::Tensor data_;     // [N, ...]
  at::Tensor targets_;  // [N, ...]
};

// --- IDX files (the MNIST format): big-endian header, then raw uint8 payload.
//   images: magic 2051, count, rows, cols, then count*rows*cols pixels (row-major)
//   labels: magic 2049, count, then count labels
// Files are read through zlib, so both `.gz` and uncompressed files work. Every problem is a
// ddp::DataError naming the file and what was wrong: a missing file, a bad magic number, a
// header or payload shorter than declared ("the file is truncated"), bytes after the payload,
// or a damaged gzip stream.

// uint8 [count, rows, cols].
at::Tensor read_idx_images(const std::string& path);
// uint8 [count].
at::Tensor read_idx_labels(const std::string& path);

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
