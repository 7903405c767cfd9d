// The BLAS's own thread calls (the torch-free half of include/ddp/threads.h).
#pragma once

namespace ddp {

// Sets the loaded BLAS's threads (OpenBLAS, BLIS); does nothing for a BLAS without the call.
void set_blas_threads(int n);

}  // namespace ddp
