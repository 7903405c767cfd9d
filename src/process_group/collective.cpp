// Names and descriptions of collectives (collective.h).
#include "process_group/collective.h"

#include <fmt/format.h>

namespace ddp {
namespace {

constexpr DType kDTypes[] = {DType::kU8,  DType::kI8,   DType::kI16,  DType::kI32,
                             DType::kI64, DType::kF16,  DType::kBF16, DType::kF32,
                             DType::kF64, DType::kBool, DType::kOther};
constexpr Collective kCollectives[] = {Collective::kAllReduce, Collective::kBroadcast,
                                       Collective::kAllGather, Collective::kReduceScatter,
                                       Collective::kBarrier,   Collective::kReduce,
                                       Collective::kGather,    Collective::kScatter,
                                       Collective::kAllToAll,  Collective::kSend,
                                       Collective::kRecv};
constexpr ReduceOp kReduceOps[] = {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax, ReduceOp::kMin};

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAvg: return "avg";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

size_t element_size(DType t) {
  switch (t) {
    case DType::kU8:
    case DType::kI8:
    case DType::kBool:
    case DType::kOther: return 1;
    case DType::kI16:
    case DType::kF16:
    case DType::kBF16: return 2;
    case DType::kI32:
    case DType::kF32: return 4;
    case DType::kI64:
    case DType::kF64: return 8;
  }
  return 1;
}

const char* name(DType t) {
  switch (t) {
    case DType::kU8: return "Byte";
    case DType::kI8: return "Char";
    case DType::kI16: return "Short";
    case DType::kI32: return "Int";
    case DType::kI64: return "Long";
    case DType::kF16: return "Half";
    case DType::kBF16: return "BFloat16";
    case DType::kF32: return "Float";
    case DType::kF64: return "Double";
    case DType::kBool: return "Bool";
    case DType::kOther: return "bytes";
  }
  return "?";
}

const char* name(Collective c) {
  switch (c) {
    case Collective::kAllReduce: return "all_reduce";
    case Collective::kBroadcast: return "broadcast";
    case Collective::kAllGather: return "all_gather";
    case Collective::kReduceScatter: return "reduce_scatter";
    case Collective::kBarrier: return "barrier";
    case Collective::kReduce: return "reduce";
    case Collective::kGather: return "gather";
    case Collective::kScatter: return "scatter";
    case Collective::kAllToAll: return "all_to_all";
    case Collective::kSend: return "send";
    case Collective::kRecv: return "recv";
  }
  return "?";
}

namespace {

const char* name_of(DType t) { return name(t); }
const char* name_of(Collective c) { return name(c); }
const char* name_of(ReduceOp r) { return to_string(r); }

template <typename T, size_t N>
std::optional<T> named(const T (&all)[N], std::string_view wanted) {
  for (T v : all) {
    if (wanted == name_of(v)) return v;
  }
  return std::nullopt;
}

}  // namespace

std::optional<DType> dtype_named(std::string_view n) { return named(kDTypes, n); }
std::optional<Collective> collective_named(std::string_view n) { return named(kCollectives, n); }
std::optional<ReduceOp> reduce_op_named(std::string_view n) { return named(kReduceOps, n); }

bool CollectiveDesc::same_call(const CollectiveDesc& o) const {
  CollectiveDesc a = *this;
  a.seq = o.seq;
  return a == o;
}

std::string CollectiveDesc::detail() const {
  switch (op) {
    case Collective::kAllReduce:
    case Collective::kReduceScatter:
      return fmt::format("{}, {} x {}", to_string(reduce), count, name(dtype));
    case Collective::kBroadcast:
      return fmt::format("from rank {}, {} x {}", root, count, name(dtype));
    case Collective::kAllGather: return fmt::format("{} x {}", count, name(dtype));
    case Collective::kReduce:
      return fmt::format("{} to rank {}, {} x {}", to_string(reduce), root, count, name(dtype));
    case Collective::kGather: return fmt::format("to rank {}, {} x {}", root, count, name(dtype));
    case Collective::kScatter:
      return fmt::format("from rank {}, {} x {}", root, count, name(dtype));
    case Collective::kAllToAll:
      return count == 0 ? fmt::format("uneven splits, {}", name(dtype))
                        : fmt::format("{} x {} per peer", count, name(dtype));
    case Collective::kSend:
      return fmt::format("to rank {}, tag {}, {} x {}", root, tag, count, name(dtype));
    case Collective::kRecv:
      return fmt::format("from rank {}, tag {}, {} x {}", root, tag, count, name(dtype));
    case Collective::kBarrier: break;
  }
  return "";
}

std::string CollectiveDesc::describe() const {
  const std::string d = detail();
  return d.empty() ? fmt::format("{} #{}", name(op), seq)
                   : fmt::format("{} #{} ({})", name(op), seq, d);
}

std::array<int64_t, CollectiveDesc::kWords> CollectiveDesc::to_words() const {
  return {static_cast<int64_t>(seq),
          static_cast<int64_t>(op) | static_cast<int64_t>(dtype) << 8 |
              static_cast<int64_t>(reduce) << 16,
          static_cast<int64_t>(root), static_cast<int64_t>(count)};
}

CollectiveDesc CollectiveDesc::from_words(const int64_t* w) {
  CollectiveDesc d;
  d.seq = static_cast<uint64_t>(w[0]);
  d.op = static_cast<Collective>(w[1] & 0xff);
  d.dtype = static_cast<DType>((w[1] >> 8) & 0xff);
  d.reduce = static_cast<ReduceOp>((w[1] >> 16) & 0xff);
  d.root = static_cast<int32_t>(w[2]);
  d.count = static_cast<uint64_t>(w[3]);
  return d;
}

}  // namespace ddp
