// The C ABI (include/ddp/c_api.h) over the C++ library.
//
// Note [C ABI]
// Every exported function body runs inside guarded(): a ddp::Error (or anything else thrown)
// becomes a status code and the calling thread's last error, so that no exception unwinds into
// a C, Rust or JVM frame (undefined behaviour there). Handles are heap objects holding the C++
// objects; a ddp_model holds its group (shared) so that destroying the group handle first is
// safe. DDP over bare parameter tensors: the tensors are registered (not copied: the same
// TensorImpl) as the parameters of a module with no forward of its own, and wrapped in
// DistributedDataParallel, whose reducer hooks their gradient accumulators; the binding's own
// autograd graph then drives it, and ddp_model_prepare_forward stands for the wrapper's forward.
#include "ddp/c_api.h"

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <torch/nn/module.h>

#include "ddp/checkpoint.h"
#include "ddp/comm_hooks.h"
#include "ddp/config.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/error.h"
#include "ddp/process_group.h"
#include "ddp/sampler.h"
#include "ddp/stateful.h"
#include "ddp/training_state.h"

struct ddp_group {
  std::shared_ptr<ddp::ProcessGroup> pg;
};

struct ddp_sampler {
  ddp::DistributedSampler sampler;
};

namespace ddp::c_api {

// The parameters of a ddp_model: registered tensors, no computation (Note [C ABI]).
class ParameterList : public torch::nn::Module {
 public:
  explicit ParameterList(const std::vector<at::Tensor>& parameters) {
    for (size_t i = 0; i < parameters.size(); ++i) {
      register_parameter(std::to_string(i), parameters[i], parameters[i].requires_grad());
    }
  }
  void forward() {}
};

// The caller's named tensors as one saved state (ddp_checkpoint_save / _load).
class NamedTensors : public Stateful {
 public:
  explicit NamedTensors(std::vector<std::pair<std::string, at::Tensor>> tensors)
      : tensors_(std::move(tensors)) {}
  StateDict state_dict() override { return {.tensors = tensors_}; }
  std::string check(const StateDict& saved, const LoadContext&) override {
    for (const auto& [name, t] : tensors_) {
      const at::Tensor* s = saved.find(name);
      if (s == nullptr) return fmt::format("the file has no tensor named '{}'", name);
      if (!s->defined() || s->sizes() != t.sizes() || s->scalar_type() != t.scalar_type()) {
        return fmt::format("'{}' is {} in the file, {} {} here", name,
                           s->defined() ? fmt::format("{} {}", c10::str(s->sizes()),
                                                      c10::toString(s->scalar_type()))
                                        : "undefined",
                           c10::str(t.sizes()), c10::toString(t.scalar_type()));
      }
    }
    return "";
  }
  void load_state_dict(const StateDict& saved, const LoadContext&) override {
    at::NoGradGuard no_grad;  // parameters are leaves that require grad
    for (auto& [name, t] : tensors_) t.copy_(*saved.find(name));
  }
  std::string kind() const override { return "named tensors"; }

 private:
  std::vector<std::pair<std::string, at::Tensor>> tensors_;
};

// A no_sync() guard held between two C calls (the guard itself neither copies nor moves).
struct NoSyncHold {
  explicit NoSyncHold(DistributedDataParallelBase& model) : guard(model.no_sync()) {}
  NoSyncGuard guard;
};

}  // namespace ddp::c_api

struct ddp_model {
  std::shared_ptr<ddp::ProcessGroup> pg;  // outlives the wrapper
  std::unique_ptr<ddp::DistributedDataParallel<ddp::c_api::ParameterList>> ddp;
  std::unique_ptr<ddp::c_api::NoSyncHold> no_sync;
};

namespace {

thread_local std::string t_last_error;

// Thrown for a caller's mistake found here (a NULL handle, an unknown enum value).
struct InvalidArgument : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The status code of a ddp::Error: its most specific class (TimeoutError is a CollectiveError).
int status_of(const ddp::Error& e) {
  if (dynamic_cast<const ddp::CheckpointError*>(&e) != nullptr ||
      dynamic_cast<const ddp::IncompatibleStateError*>(&e) != nullptr) {
    return DDP_E_CHECKPOINT;
  }
  if (dynamic_cast<const ddp::ConfigError*>(&e) != nullptr) return DDP_E_CONFIG;
  if (dynamic_cast<const ddp::RendezvousError*>(&e) != nullptr) return DDP_E_RENDEZVOUS;
  if (dynamic_cast<const ddp::TimeoutError*>(&e) != nullptr) return DDP_E_TIMEOUT;
  if (dynamic_cast<const ddp::CollectiveError*>(&e) != nullptr) return DDP_E_COLLECTIVE;
  if (dynamic_cast<const ddp::InternalError*>(&e) != nullptr) return DDP_E_INTERNAL;
  return DDP_E_ERROR;
}

int failed(int status, std::string message) {
  t_last_error = std::move(message);
  return status;
}

template <typename Body>
int guarded(const char* call, Body&& body) {
  try {
    body();
    return DDP_OK;
  } catch (const InvalidArgument& e) {
    return failed(DDP_E_INVALID, fmt::format("{}: {}", call, e.what()));
  } catch (const ddp::Error& e) {
    return failed(status_of(e), e.what());  // names rank, call and remedy already
  } catch (const c10::Error& e) {
    return failed(DDP_E_INTERNAL, fmt::format("{}: {}", call, e.what_without_backtrace()));
  } catch (const std::exception& e) {
    return failed(DDP_E_INTERNAL, fmt::format("{}: {}", call, e.what()));
  } catch (...) {
    return failed(DDP_E_INTERNAL, fmt::format("{}: an unknown exception", call));
  }
}

template <typename T>
T& need(T* handle, const char* what) {
  if (handle == nullptr) throw InvalidArgument(fmt::format("the {} is NULL", what));
  return *handle;
}

at::ScalarType scalar_type(ddp_dtype t) {
  switch (t) {
    case DDP_FLOAT32: return at::kFloat;
    case DDP_FLOAT64: return at::kDouble;
    case DDP_FLOAT16: return at::kHalf;
    case DDP_BFLOAT16: return at::kBFloat16;
    case DDP_INT32: return at::kInt;
    case DDP_INT64: return at::kLong;
    case DDP_INT8: return at::kChar;
    case DDP_UINT8: return at::kByte;
  }
  throw InvalidArgument(fmt::format("unknown ddp_dtype {}", static_cast<int>(t)));
}

ddp::ReduceOp reduce_op(ddp_reduce_op op) {
  switch (op) {
    case DDP_SUM: return ddp::ReduceOp::kSum;
    case DDP_AVG: return ddp::ReduceOp::kAvg;
    case DDP_MAX: return ddp::ReduceOp::kMax;
    case DDP_MIN: return ddp::ReduceOp::kMin;
  }
  throw InvalidArgument(fmt::format("unknown ddp_reduce_op {}", static_cast<int>(op)));
}

// `count` elements at `data` as a CPU tensor sharing the memory.
at::Tensor host_tensor(const void* data, size_t count, ddp_dtype dtype) {
  if (data == nullptr && count > 0) throw InvalidArgument("the data pointer is NULL");
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(count)},
                       at::TensorOptions().dtype(scalar_type(dtype)));
}

at::Tensor& tensor_of(ddp_tensor t) {
  at::Tensor& tensor = need(static_cast<at::Tensor*>(t), "tensor");
  if (!tensor.defined()) throw InvalidArgument("the tensor is undefined");
  return tensor;
}

// `t`'s elements as `parts` equal consecutive blocks, each shaped `shape` (views that write
// into `t`): a gather's output or a scatter's input, checked against the other side.
std::vector<at::Tensor> blocks_of(const at::Tensor& t, int parts, const at::Tensor& other,
                                  const char* what) {
  if (!t.is_contiguous()) throw InvalidArgument(fmt::format("the {} must be contiguous", what));
  if (t.scalar_type() != other.scalar_type()) {
    throw InvalidArgument(fmt::format("the {} is {}, the other tensor {}", what,
                                      c10::toString(t.scalar_type()),
                                      c10::toString(other.scalar_type())));
  }
  const int64_t n = other.numel();
  if (t.numel() != n * parts) {
    throw InvalidArgument(
        fmt::format("the {} has {} elements; it needs {} (the group's {} ranks x {})", what,
                    t.numel(), n * parts, parts, n));
  }
  std::vector<at::Tensor> blocks;
  const at::Tensor flat = t.view({-1});
  for (int r = 0; r < parts; ++r) blocks.push_back(flat.narrow(0, r * n, n).view(other.sizes()));
  return blocks;
}

// The `count` named tensors of a checkpoint call, checked.
std::vector<std::pair<std::string, at::Tensor>> named_tensors(const char* const* names,
                                                              const ddp_tensor* tensors,
                                                              size_t count) {
  if (count > 0) {
    need(names, "names array");
    need(tensors, "tensor array");
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (size_t i = 0; i < count; ++i) {
    if (names[i] == nullptr || names[i][0] == '\0') {
      throw InvalidArgument(fmt::format("names[{}] is NULL or empty", i));
    }
    for (const auto& [name, t] : out) {
      if (name == names[i])
        throw InvalidArgument(fmt::format("the name '{}' is given twice", name));
    }
    out.emplace_back(names[i], tensor_of(tensors[i]));
  }
  return out;
}

// Every rank's "did it fail" (0 or 1), by rank: an all_reduce of one-hot flags.
std::vector<int> failures(ddp::ProcessGroup& pg, bool failed_here) {
  at::Tensor flags = at::zeros({pg.size()}, at::kInt);
  flags[pg.rank()] = failed_here ? 1 : 0;
  pg.all_reduce(flags).wait();
  std::vector<int> ranks;
  for (int r = 0; r < pg.size(); ++r) {
    if (flags[r].item<int>() != 0) ranks.push_back(r);
  }
  return ranks;
}

ddp::CommHook hook_named(const char* name) {
  const std::string n = name == nullptr ? "allreduce" : name;
  if (n == "allreduce") return ddp::comm_hooks::allreduce();
  if (n == "fp16") return ddp::comm_hooks::fp16_compress();
  if (n == "bf16") return ddp::comm_hooks::bf16_compress();
  throw InvalidArgument(fmt::format("unknown comm hook '{}' (allreduce, fp16 or bf16)", n));
}

}  // namespace

extern "C" {

const char* ddp_version(void) { return DDP_VERSION; }
int ddp_abi_version(void) { return DDP_C_API_VERSION; }
const char* ddp_last_error(void) { return t_last_error.c_str(); }

int ddp_group_create(int abi_version, const char* backend, int rank, int world_size,
                     const char* master_addr, int master_port, ddp_group** out) {
  if (abi_version > DDP_C_API_VERSION || abi_version < 1) {
    t_last_error = fmt::format(
        "ddp_group_create: the program was built against ddp-cpp's C ABI version {}, this "
        "library (ddp-cpp {}) provides version {}; run it with a ddp-cpp at least as new as "
        "the headers it was built with",
        abi_version, DDP_VERSION, DDP_C_API_VERSION);
    return DDP_E_ABI;
  }
  return guarded("ddp_group_create", [&] {
    need(out, "output pointer");
    ddp::InitOptions o;
    if (backend != nullptr) o.backend = backend;
    if (rank >= 0) {
      o.rank = rank;
      o.world_size = world_size;
      if (master_addr != nullptr)
        o.master_addr = master_addr;
      else if (world_size > 1)
        o.master_addr = "127.0.0.1";
      if (master_port > 0) o.master_port = master_port;
    }
    auto group = std::make_unique<ddp_group>();
    group->pg = ddp::make_process_group(o);
    *out = group.release();
  });
}

int ddp_group_new(ddp_group* parent, const int* ranks, size_t count, ddp_group** out) {
  return guarded("ddp_group_new", [&] {
    need(out, "output pointer");
    ddp::ProcessGroup& pg = *need(parent, "parent group").pg;
    if (count > 0) need(ranks, "ranks array");
    std::vector<int> members(ranks, ranks + count);
    std::sort(members.begin(), members.end());  // PyTorch's order; duplicates stay, refused below
    std::shared_ptr<ddp::ProcessGroup> sub = pg.new_group(members);
    if (!sub) {
      *out = nullptr;
      return;
    }
    *out = new ddp_group{std::move(sub)};
  });
}

void ddp_group_destroy(ddp_group* group) {
  guarded("ddp_group_destroy", [&] { delete group; });
}

int ddp_group_rank(const ddp_group* group) { return group != nullptr ? group->pg->rank() : -1; }
int ddp_group_size(const ddp_group* group) { return group != nullptr ? group->pg->size() : -1; }
int ddp_group_local_rank(const ddp_group* group) {
  return group != nullptr ? group->pg->local_rank() : -1;
}
const char* ddp_group_backend(const ddp_group* group) {
  return group != nullptr ? group->pg->backend().c_str() : "";
}

int ddp_all_reduce(ddp_group* group, void* data, size_t count, ddp_dtype dtype, ddp_reduce_op op) {
  return guarded("ddp_all_reduce", [&] {
    at::Tensor t = host_tensor(data, count, dtype);
    need(group, "group").pg->all_reduce(t, reduce_op(op)).wait();
  });
}

int ddp_broadcast(ddp_group* group, void* data, size_t count, ddp_dtype dtype, int root) {
  return guarded("ddp_broadcast", [&] {
    at::Tensor t = host_tensor(data, count, dtype);
    need(group, "group").pg->broadcast(t, root).wait();
  });
}

int ddp_send(ddp_group* group, const void* data, size_t count, ddp_dtype dtype, int dst, int tag) {
  return guarded("ddp_send",
                 [&] { need(group, "group").pg->send(host_tensor(data, count, dtype), dst, tag); });
}

int ddp_recv(ddp_group* group, void* data, size_t count, ddp_dtype dtype, int src, int tag) {
  return guarded("ddp_recv", [&] {
    at::Tensor t = host_tensor(data, count, dtype);
    need(group, "group").pg->recv(t, src, tag);
  });
}

int ddp_all_gather(ddp_group* group, void* output, const void* input, size_t count,
                   ddp_dtype dtype) {
  return guarded("ddp_all_gather", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    at::Tensor out = host_tensor(output, count * static_cast<size_t>(pg.size()), dtype);
    const at::Tensor in = host_tensor(input, count, dtype);
    pg.all_gather_into_tensor(out, in).wait();
  });
}

int ddp_reduce_scatter(ddp_group* group, void* output, const void* input, size_t count,
                       ddp_dtype dtype, ddp_reduce_op op) {
  return guarded("ddp_reduce_scatter", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    at::Tensor out = host_tensor(output, count, dtype);
    const at::Tensor in = host_tensor(input, count * static_cast<size_t>(pg.size()), dtype);
    pg.reduce_scatter_tensor(out, in, reduce_op(op)).wait();
  });
}

int ddp_reduce(ddp_group* group, void* data, size_t count, ddp_dtype dtype, ddp_reduce_op op,
               int root) {
  return guarded("ddp_reduce", [&] {
    at::Tensor t = host_tensor(data, count, dtype);
    need(group, "group").pg->reduce(t, root, reduce_op(op)).wait();
  });
}

int ddp_barrier(ddp_group* group) {
  return guarded("ddp_barrier", [&] { need(group, "group").pg->barrier().wait(); });
}

int ddp_gather(ddp_group* group, void* output, const void* input, size_t count, ddp_dtype dtype,
               int root) {
  return guarded("ddp_gather", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    const at::Tensor in = host_tensor(input, count, dtype);
    std::vector<at::Tensor> outs;
    if (pg.rank() == root) {
      at::Tensor out = host_tensor(output, count * static_cast<size_t>(pg.size()), dtype);
      for (int r = 0; r < pg.size(); ++r) outs.push_back(out.narrow(0, r * in.numel(), in.numel()));
    }
    pg.gather(outs, in, root).wait();
  });
}

int ddp_scatter(ddp_group* group, void* output, const void* input, size_t count, ddp_dtype dtype,
                int root) {
  return guarded("ddp_scatter", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    at::Tensor out = host_tensor(output, count, dtype);
    std::vector<at::Tensor> ins;
    if (pg.rank() == root) {
      const at::Tensor in = host_tensor(input, count * static_cast<size_t>(pg.size()), dtype);
      for (int r = 0; r < pg.size(); ++r) ins.push_back(in.narrow(0, r * out.numel(), out.numel()));
    }
    pg.scatter(out, ins, root).wait();
  });
}

int ddp_all_to_all(ddp_group* group, void* output, const void* input, size_t count,
                   ddp_dtype dtype) {
  return guarded("ddp_all_to_all", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    const size_t n = count * static_cast<size_t>(pg.size());
    at::Tensor out = host_tensor(output, n, dtype);
    pg.all_to_all_single(out, host_tensor(input, n, dtype)).wait();
  });
}

int ddp_tensor_all_reduce(ddp_group* group, ddp_tensor tensor, ddp_reduce_op op) {
  return guarded("ddp_tensor_all_reduce", [&] {
    need(group, "group").pg->all_reduce(tensor_of(tensor), reduce_op(op)).wait();
  });
}

int ddp_tensor_broadcast(ddp_group* group, ddp_tensor tensor, int root) {
  return guarded("ddp_tensor_broadcast",
                 [&] { need(group, "group").pg->broadcast(tensor_of(tensor), root).wait(); });
}

int ddp_tensor_send(ddp_group* group, ddp_tensor tensor, int dst, int tag) {
  return guarded("ddp_tensor_send",
                 [&] { need(group, "group").pg->send(tensor_of(tensor), dst, tag); });
}

int ddp_tensor_recv(ddp_group* group, ddp_tensor tensor, int src, int tag) {
  return guarded("ddp_tensor_recv",
                 [&] { need(group, "group").pg->recv(tensor_of(tensor), src, tag); });
}

int ddp_tensor_all_gather(ddp_group* group, ddp_tensor output, ddp_tensor input) {
  return guarded("ddp_tensor_all_gather", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    pg.all_gather_into_tensor(tensor_of(output), tensor_of(input)).wait();
  });
}

int ddp_tensor_gather(ddp_group* group, ddp_tensor output, ddp_tensor input, int root) {
  return guarded("ddp_tensor_gather", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    const at::Tensor& in = tensor_of(input);
    std::vector<at::Tensor> outs;
    if (pg.rank() == root) outs = blocks_of(tensor_of(output), pg.size(), in, "output");
    pg.gather(outs, in, root).wait();
  });
}

int ddp_tensor_reduce_scatter(ddp_group* group, ddp_tensor output, ddp_tensor input,
                              ddp_reduce_op op) {
  return guarded("ddp_tensor_reduce_scatter", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    pg.reduce_scatter_tensor(tensor_of(output), tensor_of(input), reduce_op(op)).wait();
  });
}

int ddp_tensor_scatter(ddp_group* group, ddp_tensor output, ddp_tensor input, int root) {
  return guarded("ddp_tensor_scatter", [&] {
    ddp::ProcessGroup& pg = *need(group, "group").pg;
    at::Tensor& out = tensor_of(output);
    std::vector<at::Tensor> ins;
    if (pg.rank() == root) ins = blocks_of(tensor_of(input), pg.size(), out, "input");
    pg.scatter(out, ins, root).wait();
  });
}

int ddp_tensor_reduce(ddp_group* group, ddp_tensor tensor, ddp_reduce_op op, int root) {
  return guarded("ddp_tensor_reduce", [&] {
    need(group, "group").pg->reduce(tensor_of(tensor), root, reduce_op(op)).wait();
  });
}

int ddp_tensor_all_to_all(ddp_group* group, ddp_tensor output, ddp_tensor input) {
  return guarded("ddp_tensor_all_to_all", [&] {
    need(group, "group").pg->all_to_all_single(tensor_of(output), tensor_of(input)).wait();
  });
}

int ddp_sampler_create(const ddp_group* group, int64_t dataset_size, int shuffle, uint64_t seed,
                       int drop_last, ddp_sampler** out) {
  return guarded("ddp_sampler_create", [&] {
    need(out, "output pointer");
    const ddp::ProcessGroup& pg = *need(group, "group").pg;
    ddp::SamplerOptions o;
    o.num_replicas = pg.size();
    o.rank = pg.rank();
    o.shuffle = shuffle != 0;
    o.seed = seed;
    o.drop_last = drop_last != 0;
    *out = new ddp_sampler{ddp::DistributedSampler(dataset_size, o)};
  });
}

void ddp_sampler_destroy(ddp_sampler* sampler) {
  guarded("ddp_sampler_destroy", [&] { delete sampler; });
}

int ddp_sampler_set_epoch(ddp_sampler* sampler, int64_t epoch) {
  return guarded("ddp_sampler_set_epoch",
                 [&] { need(sampler, "sampler").sampler.set_epoch(epoch); });
}

int64_t ddp_sampler_length(const ddp_sampler* sampler) {
  return sampler != nullptr ? sampler->sampler.num_samples() : -1;
}

int ddp_sampler_indices(const ddp_sampler* sampler, int64_t* out, size_t capacity,
                        size_t* written) {
  return guarded("ddp_sampler_indices", [&] {
    const std::vector<int64_t> indices = need(sampler, "sampler").sampler.indices();
    if (indices.size() > capacity) {
      throw InvalidArgument(
          fmt::format("room for {} indices, this epoch has {}", capacity, indices.size()));
    }
    if (!indices.empty()) {
      need(out, "output array");
      std::copy(indices.begin(), indices.end(), out);
    }
    if (written != nullptr) *written = indices.size();
  });
}

int ddp_model_create(ddp_group* group, const ddp_tensor* parameters, size_t count,
                     double bucket_cap_mb, int find_unused_parameters, const char* comm_hook,
                     ddp_model** out) {
  return guarded("ddp_model_create", [&] {
    need(out, "output pointer");
    auto model = std::make_unique<ddp_model>();
    model->pg = need(group, "group").pg;
    if (count > 0) need(parameters, "parameter array");
    std::vector<at::Tensor> params;
    for (size_t i = 0; i < count; ++i) params.push_back(tensor_of(parameters[i]));
    ddp::DDPOptions o;
    o.process_group = model->pg;
    if (bucket_cap_mb > 0) o.bucket_cap_mb = bucket_cap_mb;
    o.find_unused_parameters = find_unused_parameters != 0;
    ddp::CommHook hook = hook_named(comm_hook);
    model->ddp = std::make_unique<ddp::DistributedDataParallel<ddp::c_api::ParameterList>>(
        std::make_shared<ddp::c_api::ParameterList>(params), o);
    if (comm_hook != nullptr) model->ddp->register_comm_hook(std::move(hook));
    *out = model.release();
  });
}

void ddp_model_destroy(ddp_model* model) {
  guarded("ddp_model_destroy", [&] { delete model; });
}

int ddp_model_prepare_forward(ddp_model* model) {
  return guarded("ddp_model_prepare_forward", [&] { need(model, "model").ddp->forward(); });
}

int ddp_model_set_no_sync(ddp_model* model, int on) {
  return guarded("ddp_model_set_no_sync", [&] {
    ddp_model& m = need(model, "model");
    if (on != 0 && !m.no_sync) m.no_sync = std::make_unique<ddp::c_api::NoSyncHold>(*m.ddp);
    if (on == 0) m.no_sync.reset();
  });
}

int ddp_checkpoint_save(ddp_group* group, const char* path, const char* const* names,
                        const ddp_tensor* tensors, size_t count, int64_t step, int64_t epoch) {
  return guarded("ddp_checkpoint_save", [&] {
    if (path == nullptr || path[0] == '\0') throw InvalidArgument("the path is NULL or empty");
    auto object = std::make_shared<ddp::c_api::NamedTensors>(named_tensors(names, tensors, count));
    ddp::ProcessGroup* pg = group != nullptr ? group->pg.get() : nullptr;
    const bool writes = pg == nullptr || pg->rank() == 0;
    std::exception_ptr error;
    if (writes) {
      try {
        ddp::TrainingState state;
        state.add("tensors", object);
        ddp::CheckpointMeta meta;
        meta.step = step;
        meta.epoch = epoch;
        meta.model_label = "ddp_checkpoint_save";
        ddp::save_checkpoint(path, state, meta);
      } catch (...) {
        error = std::current_exception();
      }
    }
    if (pg != nullptr && pg->size() > 1) {
      at::Tensor ok = at::full({1}, error ? 0 : 1, at::kInt);
      pg->broadcast(ok, 0).wait();  // no rank returns before the file is on disk
      if (!error && ok.item<int>() == 0) {
        throw ddp::CheckpointError(fmt::format(
            "[rank {}] ddp_checkpoint_save: rank 0 failed to write {} (its error names the "
            "cause); nothing was written",
            pg->rank(), path));
      }
    }
    if (error) std::rethrow_exception(error);
  });
}

int ddp_checkpoint_load(ddp_group* group, const char* path, const char* const* names,
                        const ddp_tensor* tensors, size_t count, int64_t* step, int64_t* epoch) {
  return guarded("ddp_checkpoint_load", [&] {
    if (path == nullptr || path[0] == '\0') throw InvalidArgument("the path is NULL or empty");
    auto object = std::make_shared<ddp::c_api::NamedTensors>(named_tensors(names, tensors, count));
    ddp::ProcessGroup* pg = group != nullptr ? group->pg.get() : nullptr;
    std::exception_ptr error;
    ddp::CheckpointMeta meta;
    try {
      ddp::TrainingState state;
      state.add("tensors", object);
      ddp::LoadOptions o;
      if (pg != nullptr) {
        o.rank = pg->rank();
        o.world_size = pg->size();
      }
      o.model_label = "ddp_checkpoint_load";
      meta = ddp::load_checkpoint(path, state, o).meta;
    } catch (...) {
      error = std::current_exception();
    }
    if (pg != nullptr && pg->size() > 1) {
      const std::vector<int> failed = failures(*pg, error != nullptr);
      if (!error && !failed.empty()) {
        throw ddp::CheckpointError(fmt::format(
            "[rank {}] ddp_checkpoint_load: rank(s) {} could not load {} (their errors name the "
            "cause); this rank loaded it, so the ranks now differ: load again, or stop",
            pg->rank(), fmt::join(failed, ", "), path));
      }
    }
    if (error) std::rethrow_exception(error);
    if (step != nullptr) *step = meta.step;
    if (epoch != nullptr) *epoch = meta.epoch;
  });
}

}  // extern "C"
