// The default process group and the free functions over it (see include/ddp/distributed.h).
#include <cstdlib>
#include <mutex>

#include "base/check.h"
#include "base/log.h"
#include "base/thread_annotations.h"
#include "ddp/distributed.h"
#include "ddp/env.h"
#include "process_group/flight_recorder.h"
#include "runtime/process_defaults.h"

namespace ddp {
namespace {

// The one piece of global state, for convenience only; components take groups explicitly.
Mutex g_mu;
std::shared_ptr<ProcessGroup> g_default GUARDED_BY(g_mu);

// Note [Groups at exit]
// A default group never destroyed is released at exit. One bound to a CUDA device (NCCL) must
// go before the CUDA runtime's exit handlers: afterwards its communicator's teardown fails
// ("driver shutting down") and c10d terminates the process, turning a program's exit status
// (a clean 0, or the 1 of an error already reported) into an abort with pages of backtrace.
// Exit handlers run in reverse order of registration and the runtime registered its own when
// the device was bound, before this one, so releasing the group here comes first. A group the
// program holds itself (a shared_ptr of its own) is the program's to release.
void release_at_exit() { destroy_process_group(); }

bool process_defaults_wanted(const InitOptions& options) {
  if (options.process_defaults) return *options.process_defaults;
  const std::optional<std::string> knob = env_knob("DDP_PROCESS_DEFAULTS");
  return !knob || (*knob != "0" && *knob != "false" && *knob != "off");
}

}  // namespace

std::shared_ptr<ProcessGroup> init_process_group(const InitOptions& options) {
  {
    MutexLock lock(&g_mu);
    DDP_CHECK(!g_default, Error,
              "init_process_group() called twice; call destroy_process_group() first");
  }
  auto pg = make_process_group(options);  // may take long: outside the lock
  {
    MutexLock lock(&g_mu);
    DDP_CHECK(!g_default, Error, "init_process_group() raced with another call");
    g_default = pg;
  }
  if (pg->bound_device_id()) {
    static std::once_flag once;
    std::call_once(once, [] { std::atexit(release_at_exit); });
  }
  if (process_defaults_wanted(options)) {  // process-wide settings: no lock of ours needed
    const std::string done = apply_process_defaults(*pg);
    if (debug_level_from_env() != DebugLevel::kOff) {
      log::note(pg->rank(), "process defaults: {}", done);
    }
  }
  return pg;
}

void destroy_process_group() {
  std::shared_ptr<ProcessGroup> old;
  {
    MutexLock lock(&g_mu);
    old.swap(g_default);
  }
  // `old` (and with it the sockets) is released here, outside the lock.
}

bool is_initialized() {
  MutexLock lock(&g_mu);
  return g_default != nullptr;
}

std::shared_ptr<ProcessGroup> default_group() {
  MutexLock lock(&g_mu);
  DDP_CHECK(g_default, Error, "no default process group: call ddp::init_process_group() first");
  return g_default;
}

int get_rank() {
  MutexLock lock(&g_mu);
  return g_default ? g_default->rank() : 0;
}

int get_world_size() {
  MutexLock lock(&g_mu);
  return g_default ? g_default->size() : 1;
}

int get_local_rank() {
  MutexLock lock(&g_mu);
  return g_default ? g_default->local_rank() : 0;
}

bool is_main_process() { return get_rank() == 0; }

void barrier() { default_group()->barrier().wait(); }
void monitored_barrier(std::optional<std::chrono::milliseconds> timeout) {
  default_group()->monitored_barrier(timeout);
}
void set_training_step(int64_t step) { flight::set_step(step); }
void all_reduce(at::Tensor& tensor, ReduceOp op) { default_group()->all_reduce(tensor, op).wait(); }
void broadcast(at::Tensor& tensor, int root) { default_group()->broadcast(tensor, root).wait(); }
void all_gather(std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  default_group()->all_gather(outputs, input).wait();
}
void reduce(at::Tensor& tensor, int root, ReduceOp op) {
  default_group()->reduce(tensor, root, op).wait();
}
void gather(std::vector<at::Tensor>& outputs, const at::Tensor& input, int root) {
  default_group()->gather(outputs, input, root).wait();
}
void scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, int root) {
  default_group()->scatter(output, inputs, root).wait();
}
void reduce_scatter(at::Tensor& output, const std::vector<at::Tensor>& inputs, ReduceOp op) {
  default_group()->reduce_scatter(output, inputs, op).wait();
}
void all_to_all_single(at::Tensor& output, const at::Tensor& input,
                       const std::vector<int64_t>& output_split_sizes,
                       const std::vector<int64_t>& input_split_sizes) {
  default_group()->all_to_all_single(output, input, output_split_sizes, input_split_sizes).wait();
}
void all_to_all(std::vector<at::Tensor>& outputs, const std::vector<at::Tensor>& inputs) {
  default_group()->all_to_all(outputs, inputs).wait();
}
void all_gather_into_tensor(at::Tensor& output, const at::Tensor& input) {
  default_group()->all_gather_into_tensor(output, input).wait();
}
void reduce_scatter_tensor(at::Tensor& output, const at::Tensor& input, ReduceOp op) {
  default_group()->reduce_scatter_tensor(output, input, op).wait();
}
void send(const at::Tensor& tensor, int dst, int tag) { default_group()->send(tensor, dst, tag); }
int recv(at::Tensor& tensor, int src, int tag) { return default_group()->recv(tensor, src, tag); }
Work isend(const at::Tensor& tensor, int dst, int tag) {
  return default_group()->isend(tensor, dst, tag);
}
Work irecv(at::Tensor& tensor, int src, int tag) {
  return default_group()->irecv(tensor, src, tag);
}
std::shared_ptr<ProcessGroup> new_group(std::vector<int> ranks, const NewGroupOptions& options) {
  return default_group()->new_group(std::move(ranks), options);
}
std::shared_ptr<ProcessGroup> split_group(const std::vector<std::vector<int>>& split_ranks,
                                          const NewGroupOptions& options) {
  return default_group()->split_group(split_ranks, options);
}

}  // namespace ddp
