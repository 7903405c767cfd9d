// How a reducing collective combines the ranks' values. Torch-free.
#pragma once

namespace ddp {

enum class ReduceOp { kSum, kAvg, kMax, kMin };
const char* to_string(ReduceOp op);  // "sum", "avg", "max", "min"

}  // namespace ddp
