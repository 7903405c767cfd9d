// What init_process_group() sets up for the whole process (Note [Process defaults]).
#pragma once

#include <string>

namespace ddp {

class ProcessGroup;

// Applies the process defaults for the rank `pg` is: its threads (LibTorch and the BLAS),
// malloc keeping freed memory, uncaught errors recorded. Each yields to the user's own choice
// (OMP_NUM_THREADS, MALLOC_* / GLIBC_TUNABLES, a terminate handler of their own). Returns one
// line saying what was done, for the debug log.
std::string apply_process_defaults(const ProcessGroup& pg);

}  // namespace ddp
