// ddp-bench's pure arithmetic (see sweep.h).
#include "sweep.h"

#include <algorithm>
#include <cctype>
#include <charconv>

#include <fmt/format.h>

#include "ddp/error.h"

namespace ddp::bench {

int64_t parse_bytes(const std::string& flag, const std::string& text) {
  int64_t value = 0;
  const char* first = text.data();
  const char* last = first + text.size();
  auto [ptr, ec] = std::from_chars(first, last, value);
  std::string suffix(ptr, last);
  for (char& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = -1;
  if (suffix.empty() || suffix == "B") shift = 0;
  if (suffix == "K" || suffix == "KB" || suffix == "KIB") shift = 10;
  if (suffix == "M" || suffix == "MB" || suffix == "MIB") shift = 20;
  if (suffix == "G" || suffix == "GB" || suffix == "GIB") shift = 30;
  if (ec != std::errc() || ptr == first || value <= 0 || shift < 0 ||
      value > (int64_t{1} << (62 - shift))) {
    throw ConfigError(
        fmt::format("{} '{}': expected a positive size in bytes, optionally with "
                    "K, M or G (binary multiples), e.g. 8, 64K, 256M",
                    flag, text));
  }
  return value << shift;
}

std::string format_bytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB"};
  int unit = 0;
  while (unit < 3 && bytes >= 1024 && bytes % 1024 == 0) {
    bytes /= 1024;
    ++unit;
  }
  return fmt::format("{} {}", bytes, kUnits[unit]);
}

std::vector<int64_t> doubling_sizes(int64_t min_bytes, int64_t max_bytes) {
  if (min_bytes <= 0 || max_bytes < min_bytes) {
    throw ConfigError(fmt::format("--min-bytes {} and --max-bytes {}: need 0 < min <= max",
                                  min_bytes, max_bytes));
  }
  std::vector<int64_t> sizes;
  for (int64_t s = min_bytes; s <= max_bytes; s *= 2) {
    sizes.push_back(s);
    if (s > max_bytes / 2) break;  // the next doubling would pass max (or overflow)
  }
  return sizes;
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> items;
  std::string::size_type start = 0;
  while (start <= text.size()) {
    auto end = text.find(',', start);
    if (end == std::string::npos) end = text.size();
    std::string item = text.substr(start, end - start);
    const auto b = item.find_first_not_of(" \t");
    const auto e = item.find_last_not_of(" \t");
    if (b != std::string::npos) items.push_back(item.substr(b, e - b + 1));
    start = end + 1;
  }
  return items;
}

double bus_factor(const std::string& op, int world_size) {
  const double n = world_size;
  if (op == "all_reduce") return 2 * (n - 1) / n;
  if (op == "all_gather" || op == "reduce_scatter") return (n - 1) / n;
  if (op == "broadcast" || op == "sendrecv") return 1;
  throw ConfigError(
      fmt::format("unknown collective '{}': choose all_reduce, broadcast, "
                  "all_gather, reduce_scatter or sendrecv",
                  op));
}

int64_t elements_for(const std::string& op, int64_t bytes, int64_t elem_bytes, int world_size) {
  const int64_t count = bytes / elem_bytes;
  if (op == "all_gather" || op == "reduce_scatter") return count / world_size * world_size;
  if (op == "sendrecv" && world_size < 2) return 0;  // a rank has no peer to send to
  return count;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

int64_t ring_slots(int64_t slot_bytes, int64_t ring_bytes) {
  if (slot_bytes <= 0) return 1;
  return std::max<int64_t>(1, (ring_bytes + slot_bytes - 1) / slot_bytes);
}

}  // namespace ddp::bench
