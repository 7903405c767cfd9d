// Drawing PNGs with gnuplot (see gnuplot.h).
#include "gnuplot.h"

#include <cstdlib>  // std::system
#include <fstream>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::tools {

bool have_gnuplot() { return std::system("command -v gnuplot >/dev/null 2>&1") == 0; }

std::string gnuplot_quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') out += '\'';  // '' is a quote inside a single-quoted gnuplot string
    out += c;
  }
  return out + "'";
}

std::string run_gnuplot(const std::filesystem::path& script_path, const std::string& script,
                        const std::vector<std::filesystem::path>& outputs) {
  if (!have_gnuplot()) {
    return "plots skipped: gnuplot is not installed (apt-get install gnuplot-nox)";
  }
  {
    std::ofstream gp(script_path);
    gp << script;
    if (!gp) throw Error(fmt::format("cannot write {}", script_path.string()));
  }
  // The path goes through the shell: single-quoted, with embedded quotes escaped.
  std::string quoted = "'";
  for (char c : script_path.string())
    quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  quoted += "'";
  const std::string cmd = fmt::format("gnuplot {} >/dev/null 2>&1", quoted);
  if (std::system(cmd.c_str()) != 0) {
    return fmt::format("plots failed: gnuplot returned an error on {}", script_path.string());
  }
  std::string names;
  for (const auto& out : outputs) names += (names.empty() ? "" : " and ") + out.string();
  return "plots: " + names;
}

}  // namespace ddp::tools
