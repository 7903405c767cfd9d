#include "progress.h"

#include <unistd.h>  // isatty

#include <fmt/format.h>

namespace ddp::train {
namespace {

using Clock = std::chrono::steady_clock;

std::string clock_time(double s) {
  const auto t = static_cast<int64_t>(s + 0.5);
  return t >= 3600 ? fmt::format("{}:{:02}:{:02}", t / 3600, t / 60 % 60, t % 60)
                   : fmt::format("{}:{:02}", t / 60, t % 60);
}

}  // namespace

Progress::Progress(bool enabled, int64_t log_every)
    : enabled_(enabled), tty_(enabled && isatty(fileno(stderr)) != 0), log_every_(log_every) {}

void Progress::start_epoch(int64_t epoch, int64_t epochs, int64_t steps_in_epoch, int64_t done) {
  epoch_ = epoch;
  epochs_ = epochs;
  total_ = steps_in_epoch;
  done_ = first_done_ = done;
  samples_ = 0;
  start_ = last_draw_ = Clock::now();
}

double Progress::samples_per_s() const {
  const double s = std::chrono::duration<double>(Clock::now() - start_).count();
  return s > 0 ? samples_ / s : 0;
}

std::string Progress::render() const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
  const int64_t run = done_ - first_done_;
  const double eta = run > 0 ? elapsed / run * (total_ - done_) : 0;
  constexpr int kWidth = 20;
  const int filled = total_ > 0 ? static_cast<int>(kWidth * done_ / total_) : 0;
  std::string bar(filled, '=');
  if (filled < kWidth) bar += '>' + std::string(kWidth - filled - 1, ' ');
  return fmt::format("epoch {}/{} [{}] {}/{}  loss {:.4f}  {:.0f} samples/s  ETA {}", epoch_ + 1,
                     epochs_, bar, done_, total_, loss_, samples_per_s(), clock_time(eta));
}

void Progress::step(int64_t step_in_epoch, double loss, int64_t samples) {
  if (!enabled_) return;
  done_ = step_in_epoch;
  loss_ = loss;
  samples_ += samples;
  const auto now = Clock::now();
  if (tty_) {
    if (now - last_draw_ < std::chrono::milliseconds(200) && done_ != total_) return;
    last_draw_ = now;
    std::fprintf(stderr, "\r%s\033[K", render().c_str());
    bar_shown_ = true;
  } else if (done_ % log_every_ == 0 || done_ == total_) {
    std::printf("%s\n", render().c_str());
    std::fflush(stdout);
  }
}

void Progress::end_epoch() {
  if (enabled_ && bar_shown_) {
    std::fprintf(stderr, "\n");
    bar_shown_ = false;
  }
}

void Progress::line(const std::string& text) {
  if (!enabled_) return;
  if (bar_shown_) {
    std::fprintf(stderr, "\r\033[K");
    bar_shown_ = false;
  }
  std::printf("%s\n", text.c_str());
  std::fflush(stdout);
}

}  // namespace ddp::train
