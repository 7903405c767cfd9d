// What ddp-bench writes (see report.h).
#include "report.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <fmt/format.h>

#include "ddp/error.h"
#include "gnuplot.h"
#include "sweep.h"

namespace ddp::bench {
namespace {

namespace fs = std::filesystem;
using tools::gnuplot_quote;

std::ofstream open_or_throw(const std::string& path, std::ios::openmode mode) {
  std::ofstream out(path, mode);
  if (!out) throw Error(fmt::format("cannot write {}", path));
  return out;
}

// `text` as one CSV field (RFC 4180): quoted, quotes doubled, when it holds a comma, a quote or a
// line break. A backend per device type ("cpu:shm,cuda:nccl") holds a comma: unquoted, it shifted
// every later column (the first GPU run with auto's pair read 200 samples/s from them).
std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n\r") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  return quoted + '"';
}

// The plot's script lives next to it: results.png -> results.gp.
fs::path script_for(const std::string& png) { return fs::path(png).replace_extension(".gp"); }

}  // namespace

std::string collective_table_header() {
  return fmt::format("# {:>11} {:>11} {:>11} {:>12} {:>12} {:>7}", "size", "count", "time(us)",
                     "algbw(GB/s)", "busbw(GB/s)", "#wrong");
}

std::string collective_table_line(const CollectiveRow& r) {
  return fmt::format("  {:>11} {:>11} {:>11.2f} {:>12.3f} {:>12.3f} {:>7}", format_bytes(r.bytes),
                     r.count, r.time_us, r.algbw_gbps, r.busbw_gbps, r.wrong);
}

void write_collectives_csv(const std::string& path, const std::vector<CollectiveRow>& rows) {
  auto out = open_or_throw(path, std::ios::trunc);
  out << "backend,op,dtype,ranks,bytes,count,iters,time_us,algbw_gbps,busbw_gbps,wrong\n";
  for (const auto& r : rows) {
    out << fmt::format("{},{},{},{},{},{},{},{:.3f},{:.6f},{:.6f},{}\n", csv_field(r.backend), r.op,
                       r.dtype, r.ranks, r.bytes, r.count, r.iters, r.time_us, r.algbw_gbps,
                       r.busbw_gbps, r.wrong);
  }
  if (!out) throw Error(fmt::format("cannot write {}", path));
}

std::string plot_collectives(const std::string& png, const std::vector<CollectiveRow>& rows) {
  int ranks = 1;
  double floor_gbps = 0;
  std::map<std::string, bool> dtypes;
  for (const auto& r : rows) {
    if (r.op == "memcpy") {
      floor_gbps = r.algbw_gbps;
    } else {
      ranks = r.ranks;
      dtypes[r.dtype] = true;
    }
  }
  // At world size 1 every bus factor is 0 or 1: plot what the buffer moved instead.
  const bool bus = ranks > 1;
  // One datablock per series, in the order the series first appear.
  std::vector<std::string> names;
  std::map<std::string, std::string> data;
  for (const auto& r : rows) {
    const double y = bus ? r.busbw_gbps : r.algbw_gbps;
    if (r.op == "memcpy" || y <= 0) continue;  // a log axis has no 0
    std::string name = r.backend + " " + r.op + (dtypes.size() > 1 ? " " + r.dtype : "");
    if (!data.count(name)) names.push_back(name);
    data[name] += fmt::format("{} {:.6g}\n", r.bytes, y);
  }
  // Tick labels as the table prints sizes ("64 KiB"), at most about a dozen of them.
  std::vector<int64_t> sizes;
  for (const auto& r : rows) {
    if (r.op != "memcpy" && std::find(sizes.begin(), sizes.end(), r.bytes) == sizes.end()) {
      sizes.push_back(r.bytes);
    }
  }
  std::sort(sizes.begin(), sizes.end());
  const size_t every = sizes.size() / 12 + 1;
  std::string tics;
  for (size_t i = 0; i < sizes.size(); i += every) {
    tics += fmt::format("{}{} {}", tics.empty() ? "" : ", ", gnuplot_quote(format_bytes(sizes[i])),
                        sizes[i]);
  }
  std::string script = fmt::format(
      "set terminal pngcairo size 1100,600 noenhanced\n"
      "set output {}\n"
      "set title {}\n"
      "set logscale x 2\n"
      "set xtics ({}) rotate by -30\n"
      "set logscale y 10\n"
      "set format y '%g'\n"
      "set xlabel 'size (nccl-tests convention: all_gather output, reduce_scatter input)'\n"
      "set ylabel {}\n"
      "set key below\n"
      "set grid\n",
      gnuplot_quote(png),
      gnuplot_quote(fmt::format("ddp-bench collectives, {} rank{}", ranks, ranks > 1 ? "s" : "")),
      tics, gnuplot_quote(bus ? "busbw (GB/s)" : "algbw (GB/s)"));
  std::string plot;
  for (size_t i = 0; i < names.size(); ++i) {
    script += fmt::format("$s{} << EOD\n{}EOD\n", i, data[names[i]]);
    plot += fmt::format("{}$s{} using 1:2 with linespoints title {}", plot.empty() ? "" : ", ", i,
                        gnuplot_quote(names[i]));
  }
  if (floor_gbps > 0) {
    plot += fmt::format("{}{:.6g} with lines dashtype 2 lc rgb 'black' title {}",
                        plot.empty() ? "" : ", ", floor_gbps,
                        gnuplot_quote(fmt::format("memcpy, 1 core ({:.1f} GB/s)", floor_gbps)));
  }
  if (plot.empty()) return "plot skipped: no result to draw";
  script += "plot " + plot + "\n";
  return tools::run_gnuplot(script_for(png), script, {png});
}

std::string train_table_header() {
  return fmt::format("  {:<28} {:>10} {:>8} {:>7} {:>8} {:>9} {:>7} {:>10}", "configuration",
                     "samples/s", "step ms", "data", "forward", "backward", "comm", "optimizer");
}

std::string train_table_line(const TrainRow& r) {
  return fmt::format("  {:<28} {:>10.1f} {:>8.2f} {:>7.2f} {:>8.2f} {:>9.2f} {:>7.2f} {:>10.2f}",
                     r.label, r.samples_per_s, r.step_ms, r.data_ms, r.forward_ms, r.backward_ms,
                     r.comm_ms, r.optimizer_ms);
}

void append_train_csv(const std::string& path, const std::vector<TrainRow>& rows) {
  const bool fresh = !fs::exists(path) || fs::file_size(path) == 0;
  auto out = open_or_throw(path, std::ios::app);
  if (fresh) {
    out << "label,model,backend,world_size,threads_per_rank,global_batch,steps,samples_per_s,"
           "step_ms,data_ms,forward_ms,backward_ms,comm_ms,optimizer_ms\n";
  }
  for (const auto& r : rows) {
    out << fmt::format("{},{},{},{},{},{},{},{:.2f},{:.4f},{:.4f},{:.4f},{:.4f},{:.4f},{:.4f}\n",
                       csv_field(r.label), csv_field(r.model), csv_field(r.backend), r.world_size,
                       r.threads, r.global_batch, r.steps, r.samples_per_s, r.step_ms, r.data_ms,
                       r.forward_ms, r.backward_ms, r.comm_ms, r.optimizer_ms);
  }
  if (!out) throw Error(fmt::format("cannot write {}", path));
}

std::string plot_train(const std::string& png, const std::vector<TrainRow>& rows) {
  if (rows.empty()) return "plot skipped: no result to draw";
  std::string block;
  for (const auto& r : rows) {
    block += fmt::format("\"{}: {:.0f}/s\" {:.4f} {:.4f} {:.4f} {:.4f} {:.4f}\n", r.label,
                         r.samples_per_s, r.data_ms, r.forward_ms, r.backward_ms, r.comm_ms,
                         r.optimizer_ms);
  }
  const std::string script = fmt::format(
      "set terminal pngcairo size 1000,600 noenhanced\n"
      "set output {}\n"
      "set title {}\n"
      "set style data histograms\n"
      "set style histogram rowstacked\n"
      "set style fill solid 0.8 border -1\n"
      "set boxwidth 0.6\n"
      "set ylabel 'ms per step'\n"
      "set yrange [0:*]\n"
      "set key outside right\n"
      "set grid ytics\n"
      "set xtics rotate by -15\n"
      "$d << EOD\n{}EOD\n"
      "plot $d using 2:xtic(1) title 'data', '' using 3 title 'forward', "
      "'' using 4 title 'backward compute', '' using 5 title 'exposed comm', "
      "'' using 6 title 'optimizer'\n",
      gnuplot_quote(png),
      gnuplot_quote(fmt::format("ddp-bench train: {}, global batch {}", rows.front().model,
                                rows.front().global_batch)),
      block);
  return tools::run_gnuplot(script_for(png), script, {png});
}

}  // namespace ddp::bench
