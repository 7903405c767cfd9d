// Reading numbers and switches from text (environment variables, command-line flags). Torch-free:
// shared by the library's environment contract (env.cpp) and ddprun's arguments (args.cpp), each
// of which turns "no value" into its own error naming where the text came from.
#pragma once

#include <optional>
#include <string_view>

namespace ddp::parse {

// A whole decimal integer ("42", "-1"); nullopt for anything else ("", "4x", "1e3").
std::optional<long long> integer(std::string_view text);
// A finite decimal number of seconds ("30", "0.5"), > 0, or >= 0 with `allow_zero`.
std::optional<double> seconds(std::string_view text, bool allow_zero = false);
// torchrun's booleans: 1/true/True, 0/false/False, and "" as false.
std::optional<bool> boolean(std::string_view text);

}  // namespace ddp::parse
