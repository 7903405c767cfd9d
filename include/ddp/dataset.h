// Dataset: the interface a DataLoader batches (ddp/data_loader.h), and TensorDataset, tensors
// already in memory. The datasets ddp-cpp ships (Fashion-MNIST, IDX files): ddp/datasets.h.
//
//   ddp::TensorDataset toy(torch::randn({100, 4}), torch::arange(100));
//   ddp::Batch b = toy.get_batch({0, 1, 2});                // b.data [3, 4], b.target [3]
//
// A Dataset is read-only after construction and get_batch() is called from the loader's worker
// threads concurrently, so implementations must be thread-safe for reads (TensorDataset is: it
// holds tensors and only index_select from them).
#pragma once

#include <cstdint>
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

}  // namespace ddp
