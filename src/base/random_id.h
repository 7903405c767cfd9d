// Random ids: node ids, lineages, lease nonces. Torch-free.
#pragma once

#include <string>

namespace ddp {

// `bytes` random bytes from getrandom(2), as lowercase hex (2 * bytes characters); where
// getrandom fails, bytes of the clock and the pid (unique enough for ids, not for secrets).
std::string random_hex(int bytes);

}  // namespace ddp
