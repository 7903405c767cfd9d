/* ddp-cpp's C ABI: process groups, collectives, the distributed sampler and data-parallel
 * gradient averaging for programs that are not C++ (C, Rust through `extern "C"`, the JVM
 * through JavaCPP or Panama), and for C++ programs that want a stable boundary.
 *
 *   ddp_group* g = NULL;
 *   if (ddp_group_create(DDP_C_API_VERSION, NULL, -1, -1, NULL, 0, &g) != DDP_OK) {
 *     fprintf(stderr, "%s\n", ddp_last_error());   // names the rank, the call and the remedy
 *     return 1;
 *   }
 *   float grad[1024];
 *   ddp_all_reduce(g, grad, 1024, DDP_FLOAT32, DDP_AVG);
 *   ddp_group_destroy(g);
 *
 * Conventions (those of C libraries such as SQLite and libcurl):
 *   - Every function that can fail returns an int status: DDP_OK (0) or a DDP_E_* code. The
 *     message of the most recent failure on the calling thread is ddp_last_error() (rank, call,
 *     cause, remedy, as ddp::Error says them). No C++ exception crosses this boundary.
 *   - Handles are opaque pointers, made by a *_create function and released by its *_destroy
 *     (NULL is accepted there and ignored). Output parameters are written only on success.
 *   - Tensors are LibTorch's: a ddp_tensor is an `at::Tensor*` (what tch-rs and JavaCPP's
 *     presets hold); the caller keeps ownership, and the tensor must stay alive during the call
 *     (and, for DDP's parameters, as long as the ddp_model lives).
 *   - Blocking calls are bounded by the group's collective timeout, like every collective of
 *     ddp-cpp: a dead, stuck or missing peer is an error (DDP_E_TIMEOUT, DDP_E_COLLECTIVE), not
 *     a hang.
 *   - Thread-safety: a ddp_group may be used from several threads, but every rank must issue its
 *     collectives in the same order (as in PyTorch). A ddp_sampler or a ddp_model belongs to one
 *     thread at a time. ddp_last_error() is per thread.
 *   - Versioning: DDP_C_API_VERSION grows when a function is added; a change to an existing
 *     signature or meaning would start a new library soname. ddp_group_create() refuses a caller
 *     built against a newer header than the library (DDP_E_ABI).
 */
#ifndef DDP_C_API_H_
#define DDP_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 1: the first surface; 2: ddp_send, ddp_recv, ddp_tensor_send, ddp_tensor_recv; 3: ddp_gather,
 * ddp_scatter, ddp_all_to_all, ddp_group_new, ddp_checkpoint_save, ddp_checkpoint_load and
 * DDP_E_CHECKPOINT; 4: ddp_tensor_all_gather, ddp_tensor_reduce_scatter, ddp_tensor_reduce,
 * ddp_tensor_gather, ddp_tensor_scatter, ddp_tensor_all_to_all. */
#define DDP_C_API_VERSION 4

/* Status codes. */
#define DDP_OK 0
#define DDP_E_ERROR 1      /* any other ddp::Error */
#define DDP_E_CONFIG 2     /* malformed environment or arguments (ddp::ConfigError) */
#define DDP_E_RENDEZVOUS 3 /* the ranks could not form the group (ddp::RendezvousError) */
#define DDP_E_COLLECTIVE 4 /* a collective failed: a peer died or desynchronised */
#define DDP_E_TIMEOUT 5    /* a collective or rendezvous ran past its timeout */
#define DDP_E_INVALID 6    /* a NULL handle, an unknown dtype or op, a wrong size */
#define DDP_E_ABI 7        /* the caller's header is newer than this library */
#define DDP_E_INTERNAL 8   /* a bug in ddp-cpp, or an exception from below it */
#define DDP_E_CHECKPOINT 9 /* a checkpoint not written, or a file damaged or not fitting (v3) */

typedef enum ddp_dtype {
  DDP_FLOAT32 = 0,
  DDP_FLOAT64 = 1,
  DDP_FLOAT16 = 2,
  DDP_BFLOAT16 = 3,
  DDP_INT32 = 4,
  DDP_INT64 = 5,
  DDP_INT8 = 6,
  DDP_UINT8 = 7
} ddp_dtype;

typedef enum ddp_reduce_op { DDP_SUM = 0, DDP_AVG = 1, DDP_MAX = 2, DDP_MIN = 3 } ddp_reduce_op;

typedef struct ddp_group ddp_group;
typedef struct ddp_sampler ddp_sampler;
typedef struct ddp_model ddp_model;
typedef void* ddp_tensor; /* an at::Tensor*, owned by the caller */

/* --- the library ------------------------------------------------------------------------ */

/* "0.1.0": the library's version (static storage). */
const char* ddp_version(void);
/* The DDP_C_API_VERSION the library was built with. */
int ddp_abi_version(void);
/* The message of the calling thread's most recent failure ("" if none); valid until that
 * thread's next failing call. */
const char* ddp_last_error(void);

/* --- process groups --------------------------------------------------------------------- */

/* Forms a process group (every rank calls it). abi_version: DDP_C_API_VERSION. backend: NULL
 * for DDP_BACKEND or "auto", else "shm", "gloo", "shm+gloo", "nccl", "auto" or "tuned", or one
 * per device type ("cpu:gloo,cuda:nccl").
 * rank < 0: rank, world size, MASTER_ADDR and MASTER_PORT from the launch environment (ddprun,
 * torchrun, mpirun, srun); else the four arguments (master_addr NULL: 127.0.0.1; master_port
 * <= 0: MASTER_PORT; a group of one rank needs neither). Blocks until every rank joined,
 * bounded by the rendezvous timeout (DDP_RDZV_TIMEOUT). */
int ddp_group_create(int abi_version, const char* backend, int rank, int world_size,
                     const char* master_addr, int master_port, ddp_group** out);
/* Releases the group (its collectives must have completed). */
void ddp_group_destroy(ddp_group* group);
/* -1 for a NULL group. */
int ddp_group_rank(const ddp_group* group);
int ddp_group_size(const ddp_group* group);
int ddp_group_local_rank(const ddp_group* group);
/* "shm", "gloo", "shm+gloo", "nccl" or "cpu:X,cuda:Y" (valid while the group lives); "" for
 * NULL. */
const char* ddp_group_backend(const ddp_group* group);
/* A subgroup of `parent` (PyTorch's new_group): the `count` distinct ranks of `ranks` (NULL and
 * 0: every rank), in any order; a member's rank in it is its place among them sorted. Every rank
 * of the parent calls it with the same list, in the same order relative to its other subgroup
 * calls; members get the new group in *out, the other ranks NULL (and DDP_OK). It forms through
 * the parent's store, over the transport its members' locality allows, with its own numbering and
 * the parent's timeouts; it may outlive the parent handle while the store's host (rank 0, or the
 * launcher's agent) lives. (Version 3.) */
int ddp_group_new(ddp_group* parent, const int* ranks, size_t count, ddp_group** out);

/* --- collectives on host memory (blocking) ---------------------------------------------- */

/* `count` elements of `dtype` at `data`, in place: the reduction over ranks (DDP_AVG divides by
 * the group size; floating types only). */
int ddp_all_reduce(ddp_group* group, void* data, size_t count, ddp_dtype dtype, ddp_reduce_op op);
/* root's `count` elements into every rank's `data`. */
int ddp_broadcast(ddp_group* group, void* data, size_t count, ddp_dtype dtype, int root);
/* `output` (size x count elements) receives every rank's `count` elements of `input`. */
int ddp_all_gather(ddp_group* group, void* output, const void* input, size_t count,
                   ddp_dtype dtype);
/* `input` is size chunks of `count` elements; `output` receives the reduction of chunk rank. */
int ddp_reduce_scatter(ddp_group* group, void* output, const void* input, size_t count,
                       ddp_dtype dtype, ddp_reduce_op op);
/* root's `data` receives the reduction; the others' is left unspecified. */
int ddp_reduce(ddp_group* group, void* data, size_t count, ddp_dtype dtype, ddp_reduce_op op,
               int root);
int ddp_barrier(ddp_group* group);
/* root's `output` (size x count elements, rank order) receives every rank's `count` elements of
 * `input`; `output` is not used on the other ranks (NULL is fine there). (Version 3.) */
int ddp_gather(ddp_group* group, void* output, const void* input, size_t count, ddp_dtype dtype,
               int root);
/* root's `input` is size chunks of `count` elements; every rank's `output` receives chunk `rank`.
 * `input` is not used on the other ranks (NULL is fine there). (Version 3.) */
int ddp_scatter(ddp_group* group, void* output, const void* input, size_t count, ddp_dtype dtype,
                int root);
/* `input` is size chunks of `count` elements, chunk j for rank j; `output` (size x count)
 * receives, in rank order, the chunk each rank sent this one. (Version 3.) */
int ddp_all_to_all(ddp_group* group, void* output, const void* input, size_t count,
                   ddp_dtype dtype);
/* Point to point: `count` elements to rank `dst`, or from rank `src`, matched by `tag` (>= 0) and
 * by the order of the calls between the two ranks with that tag. A send may return before its
 * recv is posted, or only once it is. */
int ddp_send(ddp_group* group, const void* data, size_t count, ddp_dtype dtype, int dst, int tag);
int ddp_recv(ddp_group* group, void* data, size_t count, ddp_dtype dtype, int src, int tag);

/* --- collectives on tensors (blocking) --------------------------------------------------- */

/* The collectives above on tensor handles, with torch.distributed's semantics, on any device the
 * group's backend takes (CUDA tensors over nccl, gloo or a backend pair). Results are written in
 * place into the caller's tensors. */
int ddp_tensor_all_reduce(ddp_group* group, ddp_tensor tensor, ddp_reduce_op op);
int ddp_tensor_broadcast(ddp_group* group, ddp_tensor tensor, int root);
int ddp_tensor_send(ddp_group* group, ddp_tensor tensor, int dst, int tag);
int ddp_tensor_recv(ddp_group* group, ddp_tensor tensor, int src, int tag);
/* Version 4. `output` holds size x input's elements, one dtype, contiguous; shaped
 * [size * d0, ...] or [size, ...] for all_gather (PyTorch's all_gather_into_tensor), any shape
 * for gather (root's output; NULL on the other ranks). Rank r's part is the r-th block of
 * input.numel() elements, in rank order. */
int ddp_tensor_all_gather(ddp_group* group, ddp_tensor output, ddp_tensor input);
int ddp_tensor_gather(ddp_group* group, ddp_tensor output, ddp_tensor input, int root);
/* Version 4. `input` holds size x output's elements, contiguous: size blocks, block r for rank r.
 * reduce_scatter: output receives the reduction over ranks of their block `rank`
 * (reduce_scatter_tensor); scatter: output receives root's block `rank` (input NULL on the
 * other ranks). */
int ddp_tensor_reduce_scatter(ddp_group* group, ddp_tensor output, ddp_tensor input,
                              ddp_reduce_op op);
int ddp_tensor_scatter(ddp_group* group, ddp_tensor output, ddp_tensor input, int root);
/* Version 4. root's `tensor` receives the reduction; the others' is left unspecified. */
int ddp_tensor_reduce(ddp_group* group, ddp_tensor tensor, ddp_reduce_op op, int root);
/* Version 4. all_to_all_single with equal splits: `input` and `output` have the same number of
 * rows along dim 0, divisible by size; rows block j of input go to rank j, and output's block i
 * comes from rank i. */
int ddp_tensor_all_to_all(ddp_group* group, ddp_tensor output, ddp_tensor input);

/* --- the distributed sampler (PyTorch's DistributedSampler) ----------------------------- */

/* This rank's shard of `dataset_size` samples over the group: shuffled with seed + epoch when
 * `shuffle`, padded to equal shards unless `drop_last`. */
int ddp_sampler_create(const ddp_group* group, int64_t dataset_size, int shuffle, uint64_t seed,
                       int drop_last, ddp_sampler** out);
void ddp_sampler_destroy(ddp_sampler* sampler);
int ddp_sampler_set_epoch(ddp_sampler* sampler, int64_t epoch);
/* The number of indices of this rank's shard per epoch (Python's len(sampler)); -1 for NULL. */
int64_t ddp_sampler_length(const ddp_sampler* sampler);
/* This epoch's indices into `out` (room for `capacity`; ddp_sampler_length() is enough). */
int ddp_sampler_indices(const ddp_sampler* sampler, int64_t* out, size_t capacity, size_t* written);

/* --- data-parallel gradient averaging over parameter tensors ---------------------------- */

/* DistributedDataParallel over the caller's parameters (no torch::nn::Module needed): on
 * creation, rank 0's values are copied into every rank's parameters; each backward of the
 * caller's autograd graph then averages the gradients in buckets, overlapped with backward,
 * so that every rank's .grad is the mean when backward returns. bucket_cap_mb <= 0: 25.
 * `comm_hook`: NULL or "allreduce" (the mean), "fp16" or "bf16" (compressed). */
int ddp_model_create(ddp_group* group, const ddp_tensor* parameters, size_t count,
                     double bucket_cap_mb, int find_unused_parameters, const char* comm_hook,
                     ddp_model** out);
void ddp_model_destroy(ddp_model* model);
/* Call before each forward (PyTorch's DDP does it in its forward). */
int ddp_model_prepare_forward(ddp_model* model);
/* While on (1), backward only accumulates gradients locally; the next backward after it is
 * turned off (0) averages the accumulated sum (PyTorch's no_sync()). */
int ddp_model_set_no_sync(ddp_model* model, int on);

/* --- checkpoints of named tensors (version 3) ------------------------------------------- */

/* Writes the `count` tensors under their `names` (non-empty, unique), with `step` and `epoch`, to
 * `path` as a ddp-cpp checkpoint file: atomically (a temporary file, fsync, rename; an existing
 * file is replaced only once the new one is complete on disk) and checksummed. group NULL: this
 * process writes (call it on one rank). Else every rank of the group calls it: rank 0 writes
 * (from its own tensors), and no rank returns before the file is on disk; when rank 0 fails,
 * every rank fails (DDP_E_CHECKPOINT), rank 0 with the cause. */
int ddp_checkpoint_save(ddp_group* group, const char* path, const char* const* names,
                        const ddp_tensor* tensors, size_t count, int64_t step, int64_t epoch);
/* Verifies the checkpoint file `path` (its checksums) and copies the tensors saved under `names`
 * into `tensors`, in place (onto their devices; no gradient is recorded). Every name must be in
 * the file with its tensor's shape and dtype, else nothing is changed and DDP_E_CHECKPOINT names
 * the first that is not (a damaged or truncated file is DDP_E_CHECKPOINT too, naming what is
 * wrong). Tensors in the file that are not asked for are ignored. `step` and `epoch` (either may
 * be NULL) receive the saved values. group NULL: this process alone. Else every rank calls it
 * and reads the file itself (a shared file system, or the same path on every host); when any
 * rank fails, every rank fails, naming the ranks (those that loaded keep what they loaded). */
int ddp_checkpoint_load(ddp_group* group, const char* path, const char* const* names,
                        const ddp_tensor* tensors, size_t count, int64_t* step, int64_t* epoch);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* DDP_C_API_H_ */
