// Defaults of the transport interface (transport.h).
#include "process_group/transport/transport.h"

#include "base/check.h"

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

namespace {
[[noreturn]] void not_native(const Transport& t, const CollectiveDesc& call) {
  throw InternalError(
      fmt::format("{}: the {} transport has no native {} (ProcessGroup makes them otherwise)",
                  call.describe(), t.capabilities().name,
                  call.op == Collective::kSend || call.op == Collective::kRecv
                      ? "send and recv"
                      : "rooted collectives"));
}
}  // namespace

Started Transport::reduce(const CollectiveDesc& call, at::Tensor&) { not_native(*this, call); }
Started Transport::gather(const CollectiveDesc& call, std::vector<at::Tensor>&, const at::Tensor&) {
  not_native(*this, call);
}
Started Transport::scatter(const CollectiveDesc& call, at::Tensor&,
                           const std::vector<at::Tensor>&) {
  not_native(*this, call);
}
Started Transport::all_to_all(const CollectiveDesc& call, at::Tensor&, const at::Tensor&,
                              const std::vector<int64_t>&, const std::vector<int64_t>&) {
  not_native(*this, call);
}
Started Transport::send(const CollectiveDesc& call, const at::Tensor&) { not_native(*this, call); }
Started Transport::recv(const CollectiveDesc& call, at::Tensor&) { not_native(*this, call); }

}  // namespace ddp
