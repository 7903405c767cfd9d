// TensorDataset and FashionMnist (see include/ddp/datasets.h).
#include <filesystem>

#include <ATen/ops/from_blob.h>  // at::from_blob: the index list as a tensor, no copy

#include "base/check.h"
#include "ddp/datasets.h"

namespace ddp {
namespace {

// `dir/name.gz`, else `dir/name` (an uncompressed copy), else a DataError with the remedy.
std::string find_file(const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  const fs::path gz = fs::path(dir) / (name + ".gz");
  const fs::path raw = fs::path(dir) / name;
  std::error_code ec;
  if (fs::is_regular_file(gz, ec)) return gz.string();
  if (fs::is_regular_file(raw, ec)) return raw.string();
  throw DataError(
      fmt::format("Fashion-MNIST not found: {} does not exist (nor {}). Install Debian's copy with "
                  "`apt-get install dataset-fashion-mnist` (files in {}), or point "
                  "FashionMnistOptions::dir at a folder holding "
                  "{{train,t10k}}-{{images-idx3,labels-idx1}}-ubyte.gz",
                  gz.string(), raw.string(), kFashionMnistDefaultDir));
}

}  // namespace

TensorDataset::TensorDataset(at::Tensor data, at::Tensor targets)
    : data_(std::move(data)), targets_(std::move(targets)) {
  DDP_CHECK(data_.defined() && targets_.defined(), ConfigError,
            "TensorDataset: data and targets must both be defined tensors");
  DDP_CHECK(data_.dim() >= 1 && targets_.dim() >= 1, ConfigError,
            "TensorDataset: data ({}-D) and targets ({}-D) need a first dimension that "
            "indexes the samples",
            data_.dim(), targets_.dim());
  DDP_CHECK(data_.size(0) == targets_.size(0), ConfigError,
            "TensorDataset: data has {} samples (first dimension) but targets has {}",
            data_.size(0), targets_.size(0));
  DDP_CHECK(data_.device() == targets_.device(), ConfigError,
            "TensorDataset: data is on {} and targets on {}; put both on one device",
            data_.device().str(), targets_.device().str());
}

int64_t TensorDataset::size() const { return data_.size(0); }

Batch TensorDataset::get_batch(const std::vector<int64_t>& indices) const {
  const int64_t n = size();
  for (size_t i = 0; i < indices.size(); ++i) {
    DDP_CHECK(indices[i] >= 0 && indices[i] < n, DataError,
              "TensorDataset::get_batch: index {} (entry {} of the batch) is outside [0, {})",
              indices[i], i, n);
  }
  // from_blob borrows the vector; index_select has copied the rows before we return.
  at::Tensor idx =
      at::from_blob(const_cast<int64_t*>(indices.data()), {static_cast<int64_t>(indices.size())},
                    at::TensorOptions().dtype(at::kLong));
  if (!data_.device().is_cpu()) idx = idx.to(data_.device());
  return {data_.index_select(0, idx), targets_.index_select(0, idx)};
}

namespace {

TensorDataset load_fashion_mnist(Split split, const FashionMnistOptions& options) {
  const std::string dir = options.dir.empty() ? kFashionMnistDefaultDir : options.dir;
  const std::string prefix = split == Split::kTrain ? "train" : "t10k";
  const std::string images_path = find_file(dir, prefix + "-images-idx3-ubyte");
  const std::string labels_path = find_file(dir, prefix + "-labels-idx1-ubyte");

  // uint8 [N, 28, 28] and [N]
  at::Tensor images = read_idx_images(images_path, options.limit, options.check_whole_files);
  at::Tensor labels = read_idx_labels(labels_path, options.limit, options.check_whole_files);
  DDP_CHECK(images.size(1) == 28 && images.size(2) == 28, DataError,
            "{}: images are {}x{}, Fashion-MNIST's are 28x28", images_path, images.size(1),
            images.size(2));
  // The headers' counts (a limited read holds fewer than a file declares).
  const int64_t n_images = options.limit > 0 ? read_idx_count(images_path) : images.size(0);
  const int64_t n_labels = options.limit > 0 ? read_idx_count(labels_path) : labels.size(0);
  DDP_CHECK(n_images == n_labels, DataError,
            "Fashion-MNIST: {} holds {} images but {} holds {} labels; the files do not belong "
            "together",
            images_path, n_images, labels_path, n_labels);
  const int64_t max_label = labels.numel() ? labels.max().item<int64_t>() : 0;
  DDP_CHECK(max_label < FashionMnist::kNumClasses, DataError,
            "{}: label {} is outside [0, {}): the file is corrupt", labels_path, max_label,
            FashionMnist::kNumClasses);

  // float [N, 1, 28, 28] in [0, 1]; optionally standardised with the training statistics.
  at::Tensor data = images.to(at::kFloat).div_(255.0).unsqueeze(1);
  if (options.normalize) data.sub_(kFashionMnistMean).div_(kFashionMnistStd);
  return TensorDataset(data.contiguous(), labels.to(at::kLong));
}

}  // namespace

FashionMnist::FashionMnist(Split split, const FashionMnistOptions& options)
    : TensorDataset(load_fashion_mnist(split, options)) {}

}  // namespace ddp
