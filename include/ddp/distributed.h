// The default process group and PyTorch-style free functions over it.
//
//   ddp::init_process_group();          // once, at start-up (reads the launch environment)
//   if (ddp::is_main_process()) ...;    // rank 0
//   ddp::all_reduce(t);                 // blocking, over the default group
//   ddp::destroy_process_group();
//
// The default group is a convenience for programs; every component also accepts a
// ProcessGroup explicitly, so a test can host several ranks in one process. One convention:
//   - a call that uses a group takes `ProcessGroup&` (ddp::all_reduce(EvalStats, pg),
//     Checkpointer::save/latest_valid/load: their overloads without a group are single-process);
//   - an object that keeps a group holds a `std::shared_ptr<ProcessGroup>` in its options
//     (DDPOptions::process_group, SyncBatchNormOptions::process_group);
//   - the default group is used only where a field or parameter says so: those options when
//     null, SamplerOptions when num_replicas/rank are unset, and the free functions below.
// Before init_process_group() (or after destroy), get_rank() is 0 and get_world_size() is 1 so
// that single-process code runs unchanged; the collectives throw ddp::Error.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

#include "ddp/process_group.h"

namespace ddp {

// Creates the default group (make_process_group) and returns it. Throws ddp::Error if one
// already exists.
std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options = {});
// Releases the default group (in-flight collectives must have been waited for).
void destroy_process_group();
bool is_initialized();
// The default group; throws ddp::Error when init_process_group() was not called.
std::shared_ptr<ProcessGroup> default_group();

int get_rank();
int get_world_size();
int get_local_rank();
bool is_main_process();  // global rank 0

// Blocking collectives over the default group.
void barrier();
// ProcessGroup::monitored_barrier over the default group: a barrier through the store that
// names every rank that did not arrive within `timeout` (unset: the group's timeout).
void monitored_barrier(std::optional<std::chrono::milliseconds> timeout = std::nullopt);
void all_reduce(at::Tensor& tensor, ReduceOp op = ReduceOp::kSum);
void broadcast(at::Tensor& tensor, int root = 0);
void all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input);
// ProcessGroup's collectives of the same names (ddp/process_group.h says what each does).
void reduce(at::Tensor& tensor, int root = 0, ReduceOp op = ReduceOp::kSum);
void gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, int root = 0);
void scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, int root = 0);
void reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs,
                    ReduceOp op = ReduceOp::kSum);
void all_to_all_single(at::Tensor& output, const at::Tensor& input,
                       const std::vector<int64_t>& output_split_sizes = {},
                       const std::vector<int64_t>& input_split_sizes = {});
void all_to_all(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs);
void all_gather_into_tensor(at::Tensor& output, const at::Tensor& input);
void reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input,
                           ReduceOp op = ReduceOp::kSum);
// Point to point over the default group (ProcessGroup::isend says how they match); recv
// returns `src`.
void send(const at::Tensor& tensor, int dst, int tag = 0);
int recv(at::Tensor& tensor, int src, int tag = 0);
Work isend(const at::Tensor& tensor, int dst, int tag = 0);
Work irecv(at::Tensor& tensor, int src, int tag = 0);
// ProcessGroup::new_group and split_group of the default group: every rank calls them.
std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks = {},
                                        const NewGroupOptions& options = {});
std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& split_ranks,
                                          const NewGroupOptions& options = {});

// The training step this process is at, recorded with each collective it issues from now on
// (every group's flight recorder), so that a hang report says "its last completed collective
// is #56 at step 812". Cheap (an atomic store): call it once per optimizer step.
void set_training_step(int64_t step);

}  // namespace ddp
