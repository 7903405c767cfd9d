#include "messages.h"

#include <fmt/format.h>

namespace ddp::train {

std::string error_text(std::string_view what, int rank) {
  const std::string own = fmt::format("[rank {}] ", rank);
  if (what.substr(0, own.size()) == own) what.remove_prefix(own.size());
  return std::string(what);
}

}  // namespace ddp::train
