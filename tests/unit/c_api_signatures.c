/* The C ABI's surface, pinned: every exported function assigned to a pointer of the exact type
 * it had in the version that added it, and every constant's value. A changed
 * signature or value stops this file from compiling (-Werror=incompatible-pointer-types), and
 * the build with it. check_c_abi.sh then checks that libddp exports exactly these functions.
 * Running it checks the library's ABI version against the header's. */
#include <stdio.h>
#include <string.h>

#include "ddp/c_api.h"

_Static_assert(DDP_C_API_VERSION == 4, "a new ABI version: pin its additions here");
_Static_assert(DDP_OK == 0 && DDP_E_ERROR == 1 && DDP_E_CONFIG == 2 && DDP_E_RENDEZVOUS == 3 &&
                   DDP_E_COLLECTIVE == 4 && DDP_E_TIMEOUT == 5 && DDP_E_INVALID == 6 &&
                   DDP_E_ABI == 7 && DDP_E_INTERNAL == 8 && DDP_E_CHECKPOINT == 9,
               "status codes are ABI");
_Static_assert(DDP_FLOAT32 == 0 && DDP_FLOAT64 == 1 && DDP_FLOAT16 == 2 && DDP_BFLOAT16 == 3 &&
                   DDP_INT32 == 4 && DDP_INT64 == 5 && DDP_INT8 == 6 && DDP_UINT8 == 7,
               "dtypes are ABI");
_Static_assert(DDP_SUM == 0 && DDP_AVG == 1 && DDP_MAX == 2 && DDP_MIN == 3, "reduce ops are ABI");
_Static_assert(sizeof(ddp_dtype) == sizeof(int) && sizeof(ddp_reduce_op) == sizeof(int),
               "enums are passed as int");

/* Version 1. */
const char* (*const p_version)(void) = ddp_version;
int (*const p_abi_version)(void) = ddp_abi_version;
const char* (*const p_last_error)(void) = ddp_last_error;
int (*const p_group_create)(int, const char*, int, int, const char*, int,
                            ddp_group**) = ddp_group_create;
void (*const p_group_destroy)(ddp_group*) = ddp_group_destroy;
int (*const p_group_rank)(const ddp_group*) = ddp_group_rank;
int (*const p_group_size)(const ddp_group*) = ddp_group_size;
int (*const p_group_local_rank)(const ddp_group*) = ddp_group_local_rank;
const char* (*const p_group_backend)(const ddp_group*) = ddp_group_backend;
int (*const p_all_reduce)(ddp_group*, void*, size_t, ddp_dtype, ddp_reduce_op) = ddp_all_reduce;
int (*const p_broadcast)(ddp_group*, void*, size_t, ddp_dtype, int) = ddp_broadcast;
int (*const p_all_gather)(ddp_group*, void*, const void*, size_t, ddp_dtype) = ddp_all_gather;
int (*const p_reduce_scatter)(ddp_group*, void*, const void*, size_t, ddp_dtype,
                              ddp_reduce_op) = ddp_reduce_scatter;
int (*const p_reduce)(ddp_group*, void*, size_t, ddp_dtype, ddp_reduce_op, int) = ddp_reduce;
int (*const p_barrier)(ddp_group*) = ddp_barrier;
int (*const p_tensor_all_reduce)(ddp_group*, ddp_tensor, ddp_reduce_op) = ddp_tensor_all_reduce;
int (*const p_tensor_broadcast)(ddp_group*, ddp_tensor, int) = ddp_tensor_broadcast;
int (*const p_sampler_create)(const ddp_group*, int64_t, int, uint64_t, int,
                              ddp_sampler**) = ddp_sampler_create;
void (*const p_sampler_destroy)(ddp_sampler*) = ddp_sampler_destroy;
int (*const p_sampler_set_epoch)(ddp_sampler*, int64_t) = ddp_sampler_set_epoch;
int64_t (*const p_sampler_length)(const ddp_sampler*) = ddp_sampler_length;
int (*const p_sampler_indices)(const ddp_sampler*, int64_t*, size_t, size_t*) = ddp_sampler_indices;
int (*const p_model_create)(ddp_group*, const ddp_tensor*, size_t, double, int, const char*,
                            ddp_model**) = ddp_model_create;
void (*const p_model_destroy)(ddp_model*) = ddp_model_destroy;
int (*const p_model_prepare_forward)(ddp_model*) = ddp_model_prepare_forward;
int (*const p_model_set_no_sync)(ddp_model*, int) = ddp_model_set_no_sync;
/* Version 2. */
int (*const p_send)(ddp_group*, const void*, size_t, ddp_dtype, int, int) = ddp_send;
int (*const p_recv)(ddp_group*, void*, size_t, ddp_dtype, int, int) = ddp_recv;
int (*const p_tensor_send)(ddp_group*, ddp_tensor, int, int) = ddp_tensor_send;
int (*const p_tensor_recv)(ddp_group*, ddp_tensor, int, int) = ddp_tensor_recv;
/* Version 3. */
int (*const p_group_new)(ddp_group*, const int*, size_t, ddp_group**) = ddp_group_new;
int (*const p_gather)(ddp_group*, void*, const void*, size_t, ddp_dtype, int) = ddp_gather;
int (*const p_scatter)(ddp_group*, void*, const void*, size_t, ddp_dtype, int) = ddp_scatter;
int (*const p_all_to_all)(ddp_group*, void*, const void*, size_t, ddp_dtype) = ddp_all_to_all;
int (*const p_checkpoint_save)(ddp_group*, const char*, const char* const*, const ddp_tensor*,
                               size_t, int64_t, int64_t) = ddp_checkpoint_save;
int (*const p_checkpoint_load)(ddp_group*, const char*, const char* const*, const ddp_tensor*,
                               size_t, int64_t*, int64_t*) = ddp_checkpoint_load;
/* Version 4. */
int (*const p_tensor_all_gather)(ddp_group*, ddp_tensor, ddp_tensor) = ddp_tensor_all_gather;
int (*const p_tensor_gather)(ddp_group*, ddp_tensor, ddp_tensor, int) = ddp_tensor_gather;
int (*const p_tensor_reduce_scatter)(ddp_group*, ddp_tensor, ddp_tensor,
                                     ddp_reduce_op) = ddp_tensor_reduce_scatter;
int (*const p_tensor_scatter)(ddp_group*, ddp_tensor, ddp_tensor, int) = ddp_tensor_scatter;
int (*const p_tensor_reduce)(ddp_group*, ddp_tensor, ddp_reduce_op, int) = ddp_tensor_reduce;
int (*const p_tensor_all_to_all)(ddp_group*, ddp_tensor, ddp_tensor) = ddp_tensor_all_to_all;

int main(void) {
  if (ddp_abi_version() != DDP_C_API_VERSION) {
    fprintf(stderr, "library ABI %d, header %d\n", ddp_abi_version(), DDP_C_API_VERSION);
    return 1;
  }
  if (strcmp(ddp_last_error(), "") != 0) return 1;
  printf("ddp-cpp %s, C ABI %d: 42 functions pinned\n", ddp_version(), ddp_abi_version());
  return 0;
}
