// Reading numbers and switches from text (environment variables, command-line flags). Torch-free:
// shared by the library's environment contract (env.cpp) and ddprun's arguments (args.cpp), each
// of which turns "no value" into its own error naming where the text came from.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace ddp::parse {

// A whole decimal integer ("42", "-1"); nullopt for anything else ("", "4x", "1e3").
std::optional<long long> integer(std::string_view text);
// A finite decimal number of seconds ("30", "0.5"), > 0, or >= 0 with `allow_zero`, and at most
// kMaxSeconds (about 31 years: any more is a typo, and would overflow a count of milliseconds).
inline constexpr double kMaxSeconds = 1e9;
std::optional<double> seconds(std::string_view text, bool allow_zero = false);
// torchrun's booleans: 1/true/True, 0/false/False, and "" as false.
std::optional<bool> boolean(std::string_view text);
// A size in bytes, > 0 and at most 1 TiB: "268435456", "256K"/"256KiB", "256M"/"256MiB",
// "1G"/"1GiB" (DDP_STORE_MAX_BYTES).
std::optional<uint64_t> byte_size(std::string_view text);

}  // namespace ddp::parse
