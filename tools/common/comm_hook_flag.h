// The --comm-hook flag of ddp-train and ddp-bench: "powersgd:RANK" is read as "powersgd" with
// RANK stored aside, so that the choice itself stays a closed list CLI11 can check and print.
#pragma once

#include <charconv>
#include <string>
#include <string_view>
#include <system_error>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

namespace ddp::tools {

inline constexpr int kMaxPowerSGDRank = 1024;  // PyTorch's papers use 1-4, up to 32 for NLP

// A CLI11 transform: "powersgd:R" (1 <= R <= kMaxPowerSGDRank) becomes "powersgd" and sets
// *rank; any other text passes unchanged (for the IsMember check after it).
inline CLI::Validator powersgd_rank_transform(int* rank) {
  return CLI::Validator(
      [rank](std::string& text) -> std::string {
        constexpr std::string_view kPrefix = "powersgd:";
        if (text.rfind(kPrefix, 0) != 0) return "";
        const std::string digits = text.substr(kPrefix.size());
        int parsed = 0;
        const auto [end, ec] =
            std::from_chars(digits.data(), digits.data() + digits.size(), parsed);
        if (ec != std::errc() || end != digits.data() + digits.size() || parsed < 1 ||
            parsed > kMaxPowerSGDRank) {
          return fmt::format("powersgd:RANK needs a whole number from 1 to {}, not '{}'",
                             kMaxPowerSGDRank, digits);
        }
        *rank = parsed;
        text = "powersgd";
        return "";
      },
      "", "powersgd:RANK");
}

}  // namespace ddp::tools
