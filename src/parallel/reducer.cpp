// The reducer (see Note [Reducer] in reducer.h).
#include "parallel/reducer.h"

#include <algorithm>
#include <cstdio>
#include <numeric>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "base/check.h"
#include "base/log.h"
#include "process_group/flight_recorder.h"
#include "process_group/internal.h"  // impl_of: the bucket names in the flight records
#include "parallel/bucketing.h"

namespace ddp::detail {
namespace {

using Clock = std::chrono::steady_clock;

// A tensor sharing `storage` at `offset` (elements), shaped like `like`, contiguous. Not an
// autograd view, so optimizers may detach_() and zero_() it as they do any gradient.
at::Tensor slot_in(const at::Tensor& contents, int64_t offset, const at::Tensor& like) {
  return at::empty({0}, contents.options())
      .set_(contents.storage(), offset, like.sizes(), at::empty(like.sizes()).strides());
}

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  return a.defined() && b.defined() && a.data_ptr() == b.data_ptr() && a.sizes() == b.sizes();
}

std::string key_of(const at::Tensor& t) {
  return fmt::format("{}/{}", c10::toString(t.scalar_type()), t.device().str());
}

}  // namespace

struct Reducer::Bucket {
  std::vector<size_t> vars;       // parameter indices
  at::Tensor contents;            // flat
  std::vector<at::Tensor> views;  // per slot, into contents
  size_t pending = 0;             // slots not yet ready this iteration
  bool launched = false;
  Future future;
};

Reducer::Reducer(std::vector<at::Tensor> params, std::vector<std::string> names,
                 ProcessGroup& group, ReducerOptions options)
    : params_(std::move(params)), names_(std::move(names)), group_(&group), rank_(group.rank()),
      options_(options), hook_(comm_hooks::allreduce()) {
  const size_t n = params_.size();
  DDP_ASSERT(names_.size() == n, "{} names for {} parameters", names_.size(), n);
  fired_.assign(n, 0);
  ready_.assign(n, 0);
  location_.resize(n);
  divisor_ = group.size();
  passthrough_ = group.size() == 1;
  if (passthrough_) {
    if (options_.debug != DebugLevel::kOff) {
      log::line(group.rank(), "world size 1: gradients need no reduction");
    }
  } else {
    build_initial_buckets();
  }

  for (size_t i = 0; i < n; ++i) {
    auto acc = torch::autograd::impl::grad_accumulator(params_[i]);
    DDP_ASSERT(acc != nullptr, "parameter {} has no gradient accumulator", names_[i]);
    hook_keys_.push_back(
        acc->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, i](const torch::autograd::variable_list& outputs,
                      const torch::autograd::variable_list&) {
              on_gradient(i);
              return outputs;
            })));
    accumulators_.push_back(std::move(acc));
  }
}

Reducer::~Reducer() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  // Collectives still in flight (an iteration abandoned by an exception) must not outlive the
  // buffers they write into.
  for (auto& b : buckets_) {
    if (b.launched) {
      try {
        b.future.wait();
      } catch (...) {
      }
    }
  }
}

// Before any iteration, gradients are expected in reverse registration order.
std::vector<size_t> Reducer::initial_order() const {
  std::vector<size_t> order(params_.size());
  std::iota(order.rbegin(), order.rend(), 0);
  return order;
}

void Reducer::build_initial_buckets() {
  build_buckets(initial_order());
  log_layout("initial");
}

void Reducer::register_comm_hook(CommHook hook) {
  check_not_in_hook("register_comm_hook");
  MutexLock lock(&mu_);
  DDP_CHECK(hook != nullptr, Error, "register_comm_hook: the hook is empty");
  DDP_CHECK(iterations_ == 0 && phase_ == Phase::kIdle, Error,
            "[rank {}] register_comm_hook must be called before the first forward through "
            "DistributedDataParallel (every rank must use the same hook from the start)",
            group_->rank());
  hook_ = std::move(hook);
  custom_hook_ = true;
  if (passthrough_) {
    passthrough_ = false;
    build_initial_buckets();
  }
}

double Reducer::since_start() const {
  return std::chrono::duration<double>(Clock::now() - start_).count();
}

void Reducer::build_buckets(const std::vector<size_t>& order) {
  std::vector<TensorSpec> specs;
  for (const auto& p : params_) {
    specs.push_back({static_cast<int64_t>(p.numel() * p.element_size()), key_of(p)});
  }
  auto assignment =
      assign_buckets(specs, order, {options_.first_bucket_bytes(), options_.bucket_bytes()});
  at::NoGradGuard no_grad;
  std::vector<Bucket> buckets(assignment.size());
  for (size_t b = 0; b < assignment.size(); ++b) {
    Bucket& bucket = buckets[b];
    bucket.vars = std::move(assignment[b]);
    int64_t total = 0;
    for (size_t v : bucket.vars) total += params_[v].numel();
    // In the transport's own memory where it has some (shm: peers reduce it in place).
    bucket.contents = group_->comm_buffer(total, params_[bucket.vars.front()].options());
    int64_t offset = 0;
    for (size_t slot = 0; slot < bucket.vars.size(); ++slot) {
      const size_t v = bucket.vars[slot];
      location_[v] = {b, slot};
      at::Tensor view = slot_in(bucket.contents, offset, params_[v]);
      offset += params_[v].numel();
      if (options_.ddp.gradient_as_bucket_view) {
        // .grad becomes this slot (keeping any value it had, e.g. across a rebuild).
        at::Tensor& grad = params_[v].mutable_grad();
        if (grad.defined()) view.copy_(grad);
        if (grad.defined()) grad = view;
      }
      bucket.views.push_back(std::move(view));
    }
  }
  buckets_ = std::move(buckets);
}

std::vector<std::vector<std::string>> Reducer::layout() const {
  check_not_in_hook("the bucket layout");
  MutexLock lock(&mu_);
  std::vector<std::vector<std::string>> out;
  for (const auto& b : buckets_) {
    std::vector<std::string> names;
    for (size_t v : b.vars) names.push_back(names_[v]);
    out.push_back(std::move(names));
  }
  return out;
}

std::vector<int64_t> Reducer::bucket_order() const {
  check_not_in_hook("bucket_order");
  MutexLock lock(&mu_);
  std::vector<int64_t> order;
  if (!rebuilt_) return order;
  if (pending_order_) return {pending_order_->begin(), pending_order_->end()};
  for (const auto& b : buckets_) {
    for (size_t v : b.vars) order.push_back(static_cast<int64_t>(v));
  }
  return order;
}

void Reducer::restore_bucket_order(const std::vector<int64_t>& order) {
  check_not_in_hook("restore_bucket_order");
  MutexLock lock(&mu_);
  DDP_CHECK(phase_ != Phase::kBackward, Error, "[rank {}] restore_bucket_order during a backward",
            group_->rank());
  if (passthrough_ || order.empty()) return;
  std::vector<char> seen(params_.size(), 0);
  bool permutation = order.size() == params_.size();
  for (int64_t v : order) {
    permutation = permutation && v >= 0 && v < static_cast<int64_t>(params_.size()) && !seen[v];
    if (permutation) seen[v] = 1;
  }
  DDP_CHECK(permutation, Error,
            "[rank {}] DistributedDataParallel: the saved bucket order ({} entries) is not a "
            "permutation of this model's {} parameters: it was saved from another model",
            group_->rank(), order.size(), params_.size());
  rebuilt_ = true;
  if (pending_order_) {  // rebound: built at the next forward, in step with the other ranks
    pending_order_ = std::vector<size_t>(order.begin(), order.end());
    return;
  }
  build_buckets(std::vector<size_t>(order.begin(), order.end()));
  log_layout("restored");
}

void Reducer::log_layout(const char* when) const {
  if (options_.debug == DebugLevel::kOff) return;
  std::string s =
      fmt::format("{} bucket layout: {} parameters in {} buckets (first {:.2f} MB, cap {:.2f} MB)",
                  when, params_.size(), buckets_.size(), options_.first_bucket_bytes() / 1048576.0,
                  options_.bucket_bytes() / 1048576.0);
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const auto& bucket = buckets_[b];
    std::vector<std::string> names;
    for (size_t v : bucket.vars) names.push_back(names_[v]);
    s += fmt::format("\n  bucket {} ({}, {:.3f} MB{}): {}", b, key_of(bucket.contents),
                     bucket.contents.numel() * bucket.contents.element_size() / 1048576.0,
                     group_->is_comm_buffer(bucket.contents) ? ", shared memory" : "",
                     fmt::join(names, ", "));
  }
  log::line(group_->rank(), s);
}

void Reducer::prepare_for_forward(bool sync) {
  check_not_in_hook("a forward through the wrapper");
  MutexLock lock(&mu_);
  DDP_CHECK(phase_ != Phase::kBackward, Error,
            "[rank {}] DistributedDataParallel: the previous backward did not finish reducing "
            "gradients (an exception interrupted it), so the ranks are out of step. Recreate "
            "the process group and the model, or restart from a checkpoint.",
            group_->rank());
  settle_rebind();
  maybe_rebuild_buckets();
  sync_ = sync;
  phase_ = Phase::kForwarded;
}

void Reducer::maybe_rebuild_buckets() {
  const bool allowed = !options_.ddp.find_unused_parameters || options_.ddp.static_graph;
  if (rebuilt_ || iterations_ < 1 || !allowed) return;
  rebuilt_ = true;
  // Rank 0's observed order, so that every rank builds the same buckets. Parameters that never
  // fired (static graph, unused) go last, in reverse registration order.
  std::vector<int64_t> order(first_hook_order_.begin(), first_hook_order_.end());
  std::vector<char> seen(params_.size(), 0);
  for (size_t v : first_hook_order_) seen[v] = 1;
  for (size_t v = params_.size(); v-- > 0;) {
    if (!seen[v]) order.push_back(static_cast<int64_t>(v));
  }
  at::Tensor t = at::tensor(order, at::kLong);
  group_->broadcast(t, 0).wait();
  const int64_t* data = t.data_ptr<int64_t>();
  build_buckets(std::vector<size_t>(data, data + t.numel()));
  log_layout("rebuilt (observed ready order)");
}

void Reducer::on_gradient(size_t var) {
  check_not_in_hook("a backward (a gradient hook)");
  MutexLock lock(&mu_);
  if (phase_ == Phase::kIdle || !sync_ || passthrough_) return;  // accumulate locally
  DDP_CHECK(phase_ != Phase::kFinalized, Error,
            "[rank {}] DistributedDataParallel: parameter '{}' received a gradient after this "
            "iteration's gradients were already reduced. Each forward through DDP must be "
            "followed by exactly one backward: sum the losses into one backward() (a second "
            "backward would not be reduced across ranks).",
            group_->rank(), names_[var]);
  if (phase_ == Phase::kForwarded) begin_backward();
  if (fired_[var]++ == 0) hook_order_.push_back(var);
  if (options_.ddp.static_graph && !recorded_) return;  // recording: all reduced in finalize
  const int expected = recorded_ ? expected_fires_[var] : 1;
  if (fired_[var] > expected) {
    fail_iteration();
    throw Error(fmt::format(
        "[rank {}] DistributedDataParallel: parameter '{}' was marked ready twice in one "
        "iteration (its gradient arrived {} times; {} expected). This happens with reentrant "
        "backward (activation checkpointing) or when one forward's graph is backpropagated "
        "twice. Use one backward per forward, or static_graph=true if the pattern is the same "
        "every iteration.",
        group_->rank(), names_[var], fired_[var], expected));
  }
  if (fired_[var] == expected) {
    mark_ready(var);
    stats_.last_gradient_s = since_start();
  }
}

void Reducer::begin_backward() {
  phase_ = Phase::kBackward;
  start_ = Clock::now();
  stats_ = IterationStats{};
  stats_.bucket_launch_s.assign(buckets_.size(), -1.0);
  std::fill(fired_.begin(), fired_.end(), 0);
  std::fill(ready_.begin(), ready_.end(), 0);
  hook_order_.clear();
  next_launch_ = 0;
  for (auto& b : buckets_) {
    b.pending = b.vars.size();
    b.launched = false;
    b.future = Future();
  }
  torch::autograd::Engine::get_default_engine().queue_callback([this] { finalize(); });
  if (recorded_) {
    // static_graph: parameters that were unused when recorded are ready right away.
    for (size_t v = 0; v < params_.size(); ++v) {
      if (expected_fires_[v] == 0) mark_ready(v);
    }
  }
}

void Reducer::mark_ready(size_t var) {
  ready_[var] = 1;
  stats_.ready_order.push_back(names_[var]);
  const Location loc = location_[var];
  Bucket& bucket = buckets_[loc.bucket];
  at::Tensor& view = bucket.views[loc.slot];
  {
    at::NoGradGuard no_grad;
    at::Tensor& grad = params_[var].mutable_grad();
    if (!grad.defined()) {
      view.zero_();  // no gradient here (unused on this rank): contributes zero
    } else if (!same_memory(grad, view)) {
      view.copy_(grad);
      if (options_.ddp.gradient_as_bucket_view) grad = view;
    }
  }
  if (--bucket.pending == 0) launch_ready_buckets();
}

void Reducer::launch_ready_buckets() {
  while (next_launch_ < buckets_.size() && buckets_[next_launch_].pending == 0) {
    launch_bucket(next_launch_++);
    stats_.bucket_launch_s[next_launch_ - 1] = since_start();
  }
}

void Reducer::launch_bucket(size_t b) {
  Bucket& bucket = buckets_[b];
  std::vector<at::Tensor> params;
  for (size_t v : bucket.vars) params.push_back(params_[v]);
  GradBucket gb(b, b + 1 == buckets_.size(), bucket.contents, bucket.views, std::move(params),
                *group_, divisor_);
  struct InHook {  // marks this thread as running user code with mu_ held, until it returns
    std::atomic<std::thread::id>& thread;
    explicit InHook(std::atomic<std::thread::id>& t) : thread(t) {
      thread.store(std::this_thread::get_id());
    }
    ~InHook() { thread.store(std::thread::id{}); }
  } in_hook(hook_thread_);
  // The flight recorder names the bucket of the collective the hook issues (Note [Flight
  // recorder]): its index and its first parameters.
  constexpr size_t kNamesRecorded = 3;
  std::string names;
  for (size_t i = 0; i < bucket.vars.size() && i < kNamesRecorded; ++i) {
    names += (i > 0 ? ", " : "") + names_[bucket.vars[i]];
  }
  if (bucket.vars.size() > kNamesRecorded) names += ", ...";
  flight::annotate_next(&detail::impl_of(*group_), static_cast<int>(b), std::move(names));
  struct ClearNote {  // a hook that issues nothing (or throws) leaves no note behind
    ~ClearNote() { flight::clear_note(); }
  } clear_note;
  bucket.future = hook_(gb);
  bucket.launched = true;
}

void Reducer::check_not_in_hook(const char* call) const {
  DDP_CHECK(hook_thread_.load() != std::this_thread::get_id(), Error,
            "[rank {}] DistributedDataParallel: {} was called from inside a comm hook. A hook "
            "runs during backward while DDP holds its lock, so it must not call back into the "
            "wrapper or the model's DDP (no forward, no backward, no bucket queries): use only "
            "its GradBucket and the process group, and return a Future.",
            rank_.load(), call);
}

void Reducer::set_divisor(int divisor) {
  check_not_in_hook("set_divisor (ddp::Join)");
  MutexLock lock(&mu_);
  DDP_ASSERT(divisor >= 1, "divisor {}", divisor);
  divisor_ = divisor;
}

bool Reducer::needs_used_bitmap() const {
  const bool recording = options_.ddp.static_graph && !recorded_;
  return (options_.ddp.find_unused_parameters && !recorded_) || recording;
}

void Reducer::shadow_backward() {
  check_not_in_hook("ddp::Join's shadow iteration");
  MutexLock lock(&mu_);
  DDP_ASSERT(phase_ == Phase::kForwarded, "shadow_backward without prepare_for_forward");
  if (passthrough_) return;
  const bool bitmap = needs_used_bitmap();
  for (size_t b = 0; b < buckets_.size(); ++b) {
    buckets_[b].contents.zero_();
    launch_bucket(b);
  }
  at::Tensor unused = at::zeros({static_cast<int64_t>(params_.size())}, at::kInt);
  Work used_work;
  if (bitmap) used_work = group_->all_reduce(unused, ReduceOp::kSum);
  for (auto& bucket : buckets_) {
    bucket.future.wait();
    bucket.launched = false;
  }
  if (bitmap) used_work.wait();
  // Keep the iteration-dependent state in step with the ranks that trained this iteration.
  if (options_.ddp.static_graph && !recorded_) {
    recorded_ = true;
    expected_fires_.assign(params_.size(), 0);
    recorded_globally_unused_.assign(params_.size(), 0);
  }
  ++iterations_;
  phase_ = Phase::kIdle;
}

void Reducer::rebind(ProcessGroup& group) {
  check_not_in_hook("rebind (a new process group)");
  MutexLock lock(&mu_);
  // An iteration the old group failed in: what it launched finishes or fails (bounded by that
  // group's timeout; a failed transport fails it at once).
  fail_iteration();
  std::vector<size_t> order;
  for (const Bucket& b : buckets_) order.insert(order.end(), b.vars.begin(), b.vars.end());
  group_ = &group;
  rank_.store(group.rank());
  divisor_ = group.size();
  passthrough_ = group.size() == 1 && !custom_hook_;
  // What the ranks of the new group must agree on starts over together: members that had
  // iterated (or recorded the static graph) and newcomers that had not would otherwise issue
  // different collectives. A rebuilt order stays (a newcomer receives it with the state).
  if (!rebuilt_) {
    iterations_ = 0;
    first_hook_order_.clear();
  }
  recorded_ = false;
  expected_fires_.clear();
  recorded_globally_unused_.clear();
  if (order.size() != params_.size()) order = initial_order();  // no buckets yet (world size 1)
  // The buckets are built again at the next forward, in the new transport's memory (shm: the
  // new group's segment). Not here: a comm buffer is allocated in step on every rank, and a
  // replica being healed receives its bucket order after this (restore_bucket_order).
  pending_order_ = std::move(order);
}

void Reducer::settle_rebind() {
  if (!pending_order_) return;
  if (!passthrough_) {
    build_buckets(*pending_order_);
    if (options_.debug != DebugLevel::kOff) log_layout("rebound to a new process group");
  }
  pending_order_.reset();
}

void Reducer::fail_iteration() {
  // Let what was launched finish (other ranks take part in it), then start over cleanly.
  for (auto& b : buckets_) {
    if (b.launched) {
      try {
        b.future.wait();
      } catch (...) {
      }
      b.launched = false;
    }
  }
  phase_ = Phase::kIdle;
}

void Reducer::finalize() {
  check_not_in_hook("the end of backward");
  MutexLock lock(&mu_);
  if (phase_ != Phase::kBackward) return;
  try {
    finalize_locked();
  } catch (...) {
    fail_iteration();
    throw;
  }
}

// Marks parameters that got no (or too few) gradients ready, or explains why it may not.
// Returns the parameters whose hooks never fired on this rank.
std::vector<size_t> Reducer::handle_missing_gradients() {
  std::vector<size_t> silent;
  std::vector<std::string> missing;
  for (size_t v = 0; v < params_.size(); ++v) {
    if (fired_[v] == 0) silent.push_back(v);
    if (ready_[v]) continue;
    if (recorded_ && fired_[v] != expected_fires_[v]) {
      throw Error(fmt::format(
          "[rank {}] DistributedDataParallel(static_graph=true): parameter '{}' received {} "
          "gradient(s) this iteration but {} when the graph was recorded in the first "
          "iteration; the graph is not static. Use find_unused_parameters=true instead.",
          group_->rank(), names_[v], fired_[v], expected_fires_[v]));
    }
    if (!options_.ddp.find_unused_parameters && !options_.ddp.static_graph) {
      missing.push_back(names_[v]);
    }
  }
  if (!missing.empty()) {
    throw Error(fmt::format(
        "[rank {}] DistributedDataParallel: {} parameter(s) received no gradient in this "
        "iteration: {}. They were not used to compute the loss, or their gradient does not "
        "flow back to them. Pass find_unused_parameters=true (or static_graph=true if the set "
        "never changes), or exclude them from the module (requires_grad(false)).",
        group_->rank(), missing.size(), fmt::join(missing, ", ")));
  }
  for (size_t v = 0; v < params_.size(); ++v) {
    if (!ready_[v]) mark_ready(v);
  }
  return silent;
}

void Reducer::finalize_locked() {
  stats_.finalize_start_s = since_start();
  const bool recording = options_.ddp.static_graph && !recorded_;
  const std::vector<size_t> silent = handle_missing_gradients();
  DDP_ASSERT(next_launch_ == buckets_.size(), "{} of {} buckets launched", next_launch_,
             buckets_.size());

  // Which parameters did any rank use? (find_unused_parameters; static_graph records it once.)
  std::vector<char> globally_unused(params_.size(), 0);
  const bool need_bitmap = needs_used_bitmap();
  at::Tensor used;
  Work used_work;
  if (need_bitmap) {
    used = at::ones({static_cast<int64_t>(params_.size())}, at::kInt);
    int* u = used.data_ptr<int>();
    for (size_t v : silent) u[v] = 0;
    used_work = group_->all_reduce(used, ReduceOp::kSum);
  }
  // Without the bitmap, which parameters to write back is known now: each bucket is written
  // back as soon as it is reduced, while the transport works on the next one.
  if (!need_bitmap && recorded_) globally_unused = recorded_globally_unused_;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    Bucket& bucket = buckets_[b];
    at::Tensor result = bucket.future.wait();
    if (!result.is_same(bucket.contents)) {
      DDP_CHECK(result.sizes() == bucket.contents.sizes(), Error,
                "[rank {}] comm hook returned a tensor of {} elements for bucket {} of {}",
                group_->rank(), result.numel(), b, bucket.contents.numel());
      bucket.contents.copy_(result);
    }
    if (!need_bitmap) write_back(bucket.vars, globally_unused);
  }
  if (need_bitmap) {
    used_work.wait();
    const int* u = used.data_ptr<int>();
    for (size_t v = 0; v < params_.size(); ++v) globally_unused[v] = u[v] == 0;
    for (const Bucket& bucket : buckets_) write_back(bucket.vars, globally_unused);
  }

  if (recording) {
    recorded_ = true;
    expected_fires_ = fired_;
    recorded_globally_unused_ = globally_unused;
  }
  if (iterations_++ == 0) first_hook_order_ = hook_order_;
  stats_.finalize_end_s = since_start();
  last_stats_ = stats_;
  phase_ = Phase::kFinalized;
  if (options_.debug == DebugLevel::kDetail) {
    // One line per iteration: at most 10 a second (Note [Logging]).
    static log::RateLimit per_iteration(10, std::chrono::seconds(1));
    log::limited(per_iteration, group_->rank(),
                 fmt::format("iteration {} ready order: {}", iterations_,
                             fmt::join(stats_.ready_order, ", ")));
  }
}

void Reducer::write_back(const std::vector<size_t>& vars,
                         const std::vector<char>& globally_unused) {
  at::NoGradGuard no_grad;
  for (size_t v : vars) {
    if (globally_unused[v]) continue;  // used by no rank: .grad stays as it was
    const Location loc = location_[v];
    const at::Tensor& view = buckets_[loc.bucket].views[loc.slot];
    at::Tensor& grad = params_[v].mutable_grad();
    if (options_.ddp.gradient_as_bucket_view) {
      if (!same_memory(grad, view)) grad = view;
    } else if (grad.defined()) {
      grad.copy_(view);
    } else {
      grad = view.clone();
    }
  }
}

}  // namespace ddp::detail
