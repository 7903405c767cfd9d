// A run's files, written by rank 0 in the run folder:
//   metrics.csv    one row per progress interval (split=train) and per evaluation (split=test):
//                  step,epoch,split,loss,accuracy,lr,samples_per_s,wall_s; a resumed run
//                  first drops the rows after its checkpoint's step (drop_after), then appends
//   hparams.json   the configuration, world size and versions
//   loss.png, accuracy.png   curves drawn by gnuplot at the end (skipped, with a note, if
//                  gnuplot is missing)
// With a lease (Note [Run folder lease] in ddp/run_lease.h), every write first checks that this
// group still holds the folder, and throws FencedError when it does not.
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "ddp/run_lease.h"

namespace ddp::train {

struct MetricsRow {
  int64_t step = 0;
  int64_t epoch = 0;
  std::string split;  // "train" or "test"
  double loss = 0;
  double accuracy = -1;  // -1: not measured (train rows)
  double lr = 0;
  double samples_per_s = 0;
  double wall_s = 0;
};

class RunLog {
 public:
  RunLog(std::filesystem::path dir, std::shared_ptr<const RunLease> lease);
  void write_hparams(const nlohmann::json& hparams) const;
  void append(const MetricsRow& row);
  // Removes the rows whose step is after `step` (written by an attempt that did not reach a
  // later checkpoint), so steps never repeat; rewrites the file atomically. Returns how many.
  int64_t drop_after(int64_t step);
  // Draws loss.png and accuracy.png from metrics.csv. Returns a note for the log.
  std::string plot() const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  void check(const char* what) const {
    if (lease_) lease_->check(what);
  }

  std::filesystem::path dir_;
  std::shared_ptr<const RunLease> lease_;
  std::ofstream csv_;
};

}  // namespace ddp::train
