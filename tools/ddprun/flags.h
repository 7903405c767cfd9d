// ddprun's flags: one table (torchrun's flags under both spellings, and ours) from which the
// help text is generated, and RawFlags: the values as given on the command line or through the
// PET_* fallback, before conversion (args.cpp converts and validates them). Internal to ddprun.
#pragma once

#include <map>
#include <string>

#include <CLI/CLI.hpp>

#include "ddp/env.h"  // ddp::EnvMap

namespace ddp::launcher {

// The flags' raw values, after the command line and the PET_* fallback.
class RawFlags {
 public:
  struct Value {
    std::string text;
    std::string source;  // "--nproc-per-node" or "PET_NPROC_PER_NODE"
  };

  // Registers every flag of the table with `app`.
  explicit RawFlags(CLI::App& app);
  // Applies the PET_* fallback to every flag the command line did not give.
  void resolve(const EnvMap& env);

  const Value* get(const std::string& dest) const {
    auto it = values_.find(dest);
    return it == values_.end() ? nullptr : &it->second;
  }
  bool given(const std::string& dest) const { return get(dest) != nullptr; }
  bool flag(const std::string& dest) const;

 private:
  std::map<std::string, CLI::Option*> options_;
  std::map<std::string, std::string> cli_values_;  // what CLI11 stored
  std::map<std::string, Value> values_;            // given flags only
};

// Names, description, footer, help layout and parsing policy of ddprun's command line.
void configure_app(CLI::App& app);

}  // namespace ddp::launcher
