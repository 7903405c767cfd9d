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
#include <torch/nn/module.h>

#include "ddp/comm_hooks.h"
#include "ddp/config.h"
#include "ddp/distributed_data_parallel.h"
#include "ddp/error.h"
#include "ddp/process_group.h"
#include "ddp/sampler.h"

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

}  // extern "C"
