// Defaults of the transport interface (transport.h).
#include "process_group/transport/transport.h"

namespace ddp {

uint32_t Capabilities::all_dtypes_but(std::initializer_list<DType> excluded) {
  uint32_t bits = (1u << (static_cast<unsigned>(DType::kOther) + 1)) - 1;
  for (DType t : excluded) bits &= ~(1u << static_cast<unsigned>(t));
  return bits;
}

std::optional<std::vector<CollectiveDesc>> Transport::gather_calls(const CollectiveDesc&,
                                                                   std::chrono::milliseconds) {
  return std::nullopt;
}

}  // namespace ddp
