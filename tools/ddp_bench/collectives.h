// ddp-bench collectives: an nccl-tests-style sweep over sizes, collectives and backends.
//
//   ddprun --standalone --nproc-per-node 2 ddp-bench collectives --backend gloo,shm \
//       --max-bytes 64M --csv coll.csv --png coll.png
//
// For each backend that forms a group (one that cannot is reported unavailable, with its
// error, and skipped), each collective, dtype and size from --min-bytes to --max-bytes
// (doubling): warm-up iterations, then timed ones, each preceded by a barrier on the measured
// group; every result of every iteration is verified (Note [Verification pattern]). Rank 0
// prints a table per backend and collective as it goes, the single-core memcpy bandwidth at the
// largest size (the floor a shared-memory collective is measured against), a comparison of the
// backends, and writes the CSV and PNG.
#pragma once

#include "options.h"

namespace ddp::bench {

// Collective: every rank calls it. Returns the exit code: 0 when every result was verified,
// 1 when any was wrong or any collective failed.
int run_collectives(const CollectivesOptions& options);

}  // namespace ddp::bench
