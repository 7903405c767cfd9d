// A run's files, written by rank 0 in the run folder:
//   metrics.csv    one row per progress interval (split=train) and per evaluation (split=test):
//                  step,epoch,split,loss,accuracy,lr,samples_per_s,wall_s; a resumed run
//                  first drops the rows after its checkpoint's step (drop_after), then appends
//   hparams.json   the configuration, world size and versions
//   loss.png, accuracy.png   curves drawn by gnuplot at the end (skipped, with a note, if
//                  gnuplot is missing)
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

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
  explicit RunLog(std::filesystem::path dir);
  void write_hparams(const nlohmann::json& hparams) const;
  void append(const MetricsRow& row);
  // Removes the rows whose step is after `step` (written by an attempt that did not reach a
  // later checkpoint), so steps never repeat; rewrites the file atomically. Returns how many.
  int64_t drop_after(int64_t step);
  // Draws loss.png and accuracy.png from metrics.csv. Returns a note for the log.
  std::string plot() const;
  const std::filesystem::path& dir() const { return dir_; }

 private:
  std::filesystem::path dir_;
  std::ofstream csv_;
};

}  // namespace ddp::train
