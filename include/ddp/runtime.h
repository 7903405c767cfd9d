// The process around the distributed API: what a training program sets up besides its groups.
// init_process_group() already applies sensible defaults (ddp/process_group.h:
// InitOptions::process_defaults); these headers are for choosing otherwise.
#pragma once

#include "ddp/allocator.h"  // retain_freed_memory: malloc keeps what each step frees
#include "ddp/blas.h"       // ensure_fast_blas (may re-execute the program once), inspect_blas
#include "ddp/env.h"        // the launch environment contract: parse_dist_env, kEnvKnobs
#include "ddp/threads.h"    // set_num_threads: LibTorch's and the BLAS's, threads_per_rank
