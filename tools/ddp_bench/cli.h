// ddp-bench's command line: `collectives` or `train`, each with its flags (options.h).
#pragma once

#include <string>
#include <vector>

#include "options.h"

namespace ddp::bench {

struct CommandLine {
  enum class Mode { kHelp, kCollectives, kTrain } mode = Mode::kHelp;
  std::string help_text;  // kHelp: what to print
  CollectivesOptions collectives;
  TrainOptions train;
};

// `args` without argv[0]. Throws ddp::ConfigError naming the flag for bad input. Pure: no
// process group, no files.
CommandLine parse_command_line(const std::vector<std::string>& args);

}  // namespace ddp::bench
