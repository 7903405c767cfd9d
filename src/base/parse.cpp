// Reading numbers and switches from text (see parse.h).
#include "base/parse.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <string>

namespace ddp::parse {

std::optional<long long> integer(std::string_view text) {
  long long out = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  auto [ptr, ec] = std::from_chars(first, last, out);
  if (text.empty() || ec != std::errc() || ptr != last) return std::nullopt;
  return out;
}

std::optional<double> seconds(std::string_view text, bool allow_zero) {
  const std::string s(text);  // strtod needs a terminator
  char* end = nullptr;
  const double v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
  const bool ok = !s.empty() && end == s.c_str() + s.size() && std::isfinite(v) &&
                  (allow_zero ? v >= 0 : v > 0) && v <= kMaxSeconds;
  if (!ok) return std::nullopt;
  return v;
}

std::optional<bool> boolean(std::string_view text) {
  if (text == "1" || text == "true" || text == "True") return true;
  if (text == "0" || text == "false" || text == "False" || text.empty()) return false;
  return std::nullopt;
}

std::optional<uint64_t> byte_size(std::string_view text) {
  uint64_t bytes = 0;
  auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), bytes);
  if (ec != std::errc()) return std::nullopt;
  const std::string_view suffix(ptr, text.data() + text.size() - ptr);
  uint64_t scale = 1;
  if (suffix == "K" || suffix == "KiB") {
    scale = uint64_t{1} << 10;
  } else if (suffix == "M" || suffix == "MiB") {
    scale = uint64_t{1} << 20;
  } else if (suffix == "G" || suffix == "GiB") {
    scale = uint64_t{1} << 30;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  if (bytes == 0 || bytes > (uint64_t{1} << 40) / scale) return std::nullopt;
  return bytes * scale;
}

}  // namespace ddp::parse
