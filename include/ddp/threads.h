// Threads per rank, for LibTorch's intra-op pool and the BLAS alike.
//
// LibTorch's set_num_threads sizes its own pool (OpenMP in Debian's build) but not the BLAS it
// calls: Debian's OpenBLAS (through the generic libblas.so.3) sizes a pool of its own when it is
// loaded, from OPENBLAS_NUM_THREADS or OMP_NUM_THREADS, else one thread per CPU. Under a launcher
// that exports no OMP_NUM_THREADS (srun, mpirun) two ranks on two cores then ran four BLAS
// threads, and the results depended on the launcher: OpenBLAS's kernels split the work by their
// thread count, so the same seed ended with other weights than under ddprun.
//
// init_process_group() sets each rank's count with set_num_threads(threads_per_rank(local))
// (one of its process defaults: InitOptions::process_defaults); programs that want another
// count call ddp::set_num_threads afterwards rather than torch::set_num_threads.
#pragma once

namespace ddp {

// OMP_NUM_THREADS when set (at least 1), else the CPUs this process may run on (its affinity
// mask) shared among the `local_world_size` ranks of its host, at least 1.
int threads_per_rank(int local_world_size);

// Sets LibTorch's intra-op threads and the BLAS's (OpenBLAS, BLIS; a BLAS with no such call, as
// the reference BLAS, is single-threaded anyway) to `n` (at least 1).
void set_num_threads(int n);

// The BLAS's thread count, or -1 when the loaded BLAS cannot say.
int blas_num_threads();

}  // namespace ddp
