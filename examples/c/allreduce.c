/* ddp-cpp from C: a process group, an all-reduce and the distributed sampler through the C ABI
 * (include/ddp/c_api.h), with nothing of C++ in this program.
 *
 *   ddprun --nproc-per-node 3 build/examples/c_allreduce
 *
 * Each rank all-reduces its rank number and checks the sum, then prints its shard of 10 samples
 * for epoch 1 and checks that the shards of all ranks cover every sample. Exits 0 when every
 * check holds, 1 otherwise (with ddp_last_error()'s message on a failed call). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "ddp/c_api.h"

#define CHECK(call)                                                             \
  do {                                                                          \
    if ((call) != DDP_OK) {                                                     \
      fprintf(stderr, "c_allreduce: %s failed: %s\n", #call, ddp_last_error()); \
      return 1;                                                                 \
    }                                                                           \
  } while (0)

int main(void) {
  ddp_group* group = NULL;
  /* rank -1: everything from the launcher's environment. */
  CHECK(ddp_group_create(DDP_C_API_VERSION, NULL, -1, -1, NULL, 0, &group));
  const int rank = ddp_group_rank(group), size = ddp_group_size(group);

  double value = rank;
  CHECK(ddp_all_reduce(group, &value, 1, DDP_FLOAT64, DDP_SUM));
  const double expected = size * (size - 1) / 2.0;

  enum { kSamples = 10 };
  ddp_sampler* sampler = NULL;
  CHECK(ddp_sampler_create(group, kSamples, /*shuffle=*/1, /*seed=*/0, /*drop_last=*/0, &sampler));
  CHECK(ddp_sampler_set_epoch(sampler, 1));
  int64_t indices[kSamples];
  size_t n = 0;
  CHECK(ddp_sampler_indices(sampler, indices, kSamples, &n));

  /* Every sample is in some rank's shard: count them over the ranks. */
  int32_t seen[kSamples] = {0};
  for (size_t i = 0; i < n; ++i) seen[indices[i]] = 1;
  CHECK(ddp_all_reduce(group, seen, kSamples, DDP_INT32, DDP_MAX));
  int covered = 0;
  for (int i = 0; i < kSamples; ++i) covered += seen[i];

  printf("rank %d of %d (%s): sum of ranks %.0f, shard", rank, size, ddp_group_backend(group),
         value);
  for (size_t i = 0; i < n; ++i) printf(" %lld", (long long)indices[i]);
  printf(", %d of %d samples covered\n", covered, kSamples);
  fflush(stdout);

  ddp_sampler_destroy(sampler);
  CHECK(ddp_barrier(group));
  ddp_group_destroy(group);
  return value == expected && covered == kSamples ? 0 : 1;
}
