// record_error: the torchrun error-file protocol (see include/ddp/error.h), and the mark of a
// relayed error (include/ddp/relayed_error.h).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "ddp/env.h"
#include "ddp/error.h"
#include "ddp/relayed_error.h"

namespace ddp {

void record_error(std::string_view message) { record_error(message, std::nullopt); }

void record_error(std::string_view message, std::optional<int> relayed_from_rank) {
  const std::optional<std::string> file = env_knob("TORCHELASTIC_ERROR_FILE");
  if (!file) return;
  const char* path = file->c_str();
  try {
    using namespace std::chrono;
    const auto now = system_clock::now().time_since_epoch();
    nlohmann::json extra = {{"py_callstack", ""},
                            {"timestamp", std::to_string(duration_cast<seconds>(now).count())},
                            {"timestamp_us",
                             std::to_string(duration_cast<microseconds>(now).count())}};
    if (relayed_from_rank) extra["relayed_from"] = *relayed_from_rank;
    nlohmann::json doc = {{"message", {{"message", std::string(message)}, {"extraInfo", extra}}}};
    // Write-then-rename, so the launcher never reads half a file.
    const std::string tmp = std::string(path) + ".tmp";
    if (FILE* f = std::fopen(tmp.c_str(), "w")) {
      const std::string text = doc.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
      std::fwrite(text.data(), 1, text.size(), f);
      std::fclose(f);
      std::rename(tmp.c_str(), path);
    }
  } catch (...) {
    // Reporting must never turn one error into another.
  }
}

std::optional<int> relayed_from(const std::exception& e) {
  if (const auto* mark = dynamic_cast<const RelayedFrom*>(&e)) return mark->origin_rank();
  return std::nullopt;
}

void record_error(const std::exception& e) { record_error(e.what(), relayed_from(e)); }

}  // namespace ddp
