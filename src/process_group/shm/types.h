// Element types, reductions and collective descriptions as the shared-memory transport names
// them: the process group's own (process_group/collective.h). Torch-free.
#pragma once

#include "process_group/collective.h"

namespace ddp::shm {

using ddp::DType;
using Reduce = ddp::ReduceOp;
using OpKind = ddp::Collective;

}  // namespace ddp::shm
