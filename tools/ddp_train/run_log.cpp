#include "run_log.h"

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

#include "ddp/error.h"
#include "gnuplot.h"

namespace ddp::train {

namespace fs = std::filesystem;

RunLog::RunLog(std::filesystem::path dir, std::shared_ptr<const RunLease> lease)
    : dir_(std::move(dir)), lease_(std::move(lease)) {
  check("metrics.csv");
  std::filesystem::create_directories(dir_);
  const auto path = dir_ / "metrics.csv";
  const bool fresh = !std::filesystem::exists(path) || std::filesystem::file_size(path) == 0;
  csv_.open(path, std::ios::app);
  if (!csv_) throw Error(fmt::format("cannot write {}", path.string()));
  if (fresh) csv_ << "step,epoch,split,loss,accuracy,lr,samples_per_s,wall_s\n" << std::flush;
}

void RunLog::write_hparams(const nlohmann::json& hparams) const {
  check("hparams.json");
  std::ofstream out(dir_ / "hparams.json");
  out << hparams.dump(2) << "\n";
  if (!out) throw Error(fmt::format("cannot write {}", (dir_ / "hparams.json").string()));
}

void RunLog::append(const MetricsRow& r) {
  check("a metrics.csv row");
  csv_ << fmt::format("{},{},{},{:.6f},{},{:.6g},{:.1f},{:.3f}\n", r.step, r.epoch, r.split, r.loss,
                      r.accuracy < 0 ? "" : fmt::format("{:.6f}", r.accuracy), r.lr,
                      r.samples_per_s, r.wall_s)
       << std::flush;
}

int64_t RunLog::drop_after(int64_t step) {
  check("rewriting metrics.csv");
  const fs::path path = dir_ / "metrics.csv", tmp = dir_ / "metrics.csv.tmp";
  csv_.close();
  int64_t dropped = 0;
  {
    std::ifstream in(path);
    std::ofstream out(tmp, std::ios::trunc);
    std::string line;
    if (std::getline(in, line)) out << line << "\n";  // the header
    const auto cells = std::count(line.begin(), line.end(), ',');
    while (std::getline(in, line)) {
      // The first cell is the step; a row cut short by a kill goes too.
      char* end = nullptr;
      const long long row_step = std::strtoll(line.c_str(), &end, 10);
      if (end != line.c_str() && *end == ',' && row_step <= step &&
          std::count(line.begin(), line.end(), ',') == cells) {
        out << line << "\n";
      } else {
        ++dropped;
      }
    }
    out.flush();
    if (!out) throw Error(fmt::format("cannot write {}", tmp.string()));
  }
  fs::rename(tmp, path);
  csv_.open(path, std::ios::app);
  if (!csv_) throw Error(fmt::format("cannot write {}", path.string()));
  return dropped;
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
