#include "run_log.h"

#include <cstdlib>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::train {

RunLog::RunLog(std::filesystem::path dir) : dir_(std::move(dir)) {
  std::filesystem::create_directories(dir_);
  const auto path = dir_ / "metrics.csv";
  const bool fresh = !std::filesystem::exists(path) || std::filesystem::file_size(path) == 0;
  csv_.open(path, std::ios::app);
  if (!csv_) throw Error(fmt::format("cannot write {}", path.string()));
  if (fresh) csv_ << "step,epoch,split,loss,accuracy,lr,samples_per_s,wall_s\n" << std::flush;
}

void RunLog::write_hparams(const nlohmann::json& hparams) const {
  std::ofstream out(dir_ / "hparams.json");
  out << hparams.dump(2) << "\n";
  if (!out) throw Error(fmt::format("cannot write {}", (dir_ / "hparams.json").string()));
}

void RunLog::append(const MetricsRow& r) {
  csv_ << fmt::format("{},{},{},{:.6f},{},{:.6g},{:.1f},{:.3f}\n", r.step, r.epoch, r.split,
                      r.loss, r.accuracy < 0 ? "" : fmt::format("{:.6f}", r.accuracy), r.lr,
                      r.samples_per_s, r.wall_s)
       << std::flush;
}

std::string RunLog::plot() const {
  if (std::system("command -v gnuplot >/dev/null 2>&1") != 0) {
    return "plots skipped: gnuplot is not installed (apt-get install gnuplot-nox)";
  }
  const auto csv = (dir_ / "metrics.csv").string();
  const auto script = (dir_ / "plots.gp").string();
  {
    // Rows of one split, fed through grep so the train curve is not broken by test rows.
    auto rows = [&](const char* split) { return fmt::format("'< grep ,{}, {}'", split, csv); };
    std::ofstream gp(script);
    gp << "set datafile separator ','\n"
          "set terminal pngcairo size 900,500\n"
          "set grid\n"
          "set xlabel 'optimizer step'\n"
          "set output '" << (dir_ / "loss.png").string() << "'\n"
          "set ylabel 'loss'\n"
          "set title 'loss'\n"
          "plot " << rows("train") << " using 1:4 with lines title 'train (mean over ranks)', "
       << rows("test") << " using 1:4 with linespoints title 'test'\n"
          "set output '" << (dir_ / "accuracy.png").string() << "'\n"
          "set ylabel 'test accuracy'\n"
          "set title 'test accuracy'\n"
          "plot " << rows("test") << " using 1:5 with linespoints title 'test'\n";
  }
  const std::string cmd = fmt::format("gnuplot '{}' >/dev/null 2>&1", script);
  if (std::system(cmd.c_str()) != 0) return "plots failed: gnuplot returned an error";
  return fmt::format("plots: {} and {}", (dir_ / "loss.png").string(),
                     (dir_ / "accuracy.png").string());
}

}  // namespace ddp::train
