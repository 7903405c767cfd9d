#include "base/random_id.h"

#include <sys/random.h>  // getrandom
#include <unistd.h>      // getpid

#include <chrono>
#include <cstdint>

#include <fmt/format.h>

namespace ddp {

std::string random_hex(int bytes) {
  std::string out;
  const uint64_t fallback =
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()) ^
      (static_cast<uint64_t>(::getpid()) << 32);
  for (int i = 0; i < bytes; ++i) {
    unsigned char b = 0;
    if (::getrandom(&b, 1, 0) != 1) b = static_cast<unsigned char>(fallback >> (8 * (i % 8)));
    out += fmt::format("{:02x}", b);
  }
  return out;
}

}  // namespace ddp
