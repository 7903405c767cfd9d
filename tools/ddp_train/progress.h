// Rank 0's progress display: a bar redrawn in place on a terminal, plain periodic lines
// otherwise (CI logs, ddprun's pipes).
//   epoch 2/3 [=========>          ] 251/469  loss 0.3412  1880 samples/s  ETA 0:41
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

namespace ddp::train {

class Progress {
 public:
  // `enabled` false: prints nothing (ranks other than 0).
  Progress(bool enabled, int64_t log_every);

  void start_epoch(int64_t epoch, int64_t epochs, int64_t steps_in_epoch, int64_t done);
  // After each optimizer step: `step_in_epoch` (1-based), the step's loss, samples it covered
  // on all ranks.
  void step(int64_t step_in_epoch, double loss, int64_t samples);
  void end_epoch();
  // A line of its own (clears the bar first). Rank 0 only, like everything here.
  void line(const std::string& text);
  double samples_per_s() const;

 private:
  std::string render() const;

  bool enabled_;
  bool tty_;
  int64_t log_every_;
  int64_t epoch_ = 0, epochs_ = 0, total_ = 0, done_ = 0, first_done_ = 0;
  double loss_ = 0;
  int64_t samples_ = 0;
  std::chrono::steady_clock::time_point start_, last_draw_;
  bool bar_shown_ = false;
};

}  // namespace ddp::train
