#include "run_log.h"

#include <fmt/format.h>

#include "ddp/error.h"
#include "gnuplot.h"

namespace ddp::train {

namespace fs = std::filesystem;

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
  const auto csv = (dir_ / "metrics.csv").string();
  // Rows of one split, fed through grep so the train curve is not broken by test rows.
  auto rows = [&](const char* split) { return fmt::format("'< grep ,{}, {}'", split, csv); };
  const fs::path loss = dir_ / "loss.png", accuracy = dir_ / "accuracy.png";
  const std::string script = fmt::format(
      "set datafile separator ','\n"
      "set terminal pngcairo size 900,500\n"
      "set grid\n"
      "set xlabel 'optimizer step'\n"
      "set output {}\n"
      "set ylabel 'loss'\n"
      "set title 'loss'\n"
      "plot {} using 1:4 with lines title 'train (mean over ranks)', "
      "{} using 1:4 with linespoints title 'test'\n"
      "set output {}\n"
      "set ylabel 'test accuracy'\n"
      "set title 'test accuracy'\n"
      "plot {} using 1:5 with linespoints title 'test'\n",
      tools::gnuplot_quote(loss.string()), rows("train"), rows("test"),
      tools::gnuplot_quote(accuracy.string()), rows("test"));
  return tools::run_gnuplot(dir_ / "plots.gp", script, {loss, accuracy});
}

}  // namespace ddp::train
