// Drawing PNGs with gnuplot (Debian's gnuplot-nox), shared by the tools.
//
//   std::string note = ddp::tools::run_gnuplot(dir / "plots.gp", script, {dir / "loss.png"});
//   progress.line(note);   // "plots: .../loss.png", or why there are none
//
// A missing gnuplot is not an error: plots are a convenience, the CSV next to them holds the
// numbers. The script is kept next to the plots so a user can edit and re-run it.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace ddp::tools {

// True when `gnuplot` is on PATH.
bool have_gnuplot();

// Writes `script` to `script_path` and runs gnuplot on it. Returns a one-line note for the log:
// the outputs drawn, or why none were (gnuplot missing, or it failed). Never throws for a
// plotting problem; throws ddp::Error when the script cannot be written.
std::string run_gnuplot(const std::filesystem::path& script_path, const std::string& script,
                        const std::vector<std::filesystem::path>& outputs);

// `text` as a single-quoted gnuplot string (quotes doubled, as gnuplot reads them).
std::string gnuplot_quote(const std::string& text);

}  // namespace ddp::tools
