// The PowerSGD comm hook (see include/ddp/comm_hooks.h).
//
// Note [PowerSGD]
// This is PyTorch's powerSGD_hook (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py,
// 1.13 and 2.x alike) step for step, so that a C++ port of a Python job trains the same: the
// same split of a bucket's gradients into compressed and uncompressed, the same grouping by
// shape (first appearance order), the same random Q (numpy's RandomState(random_seed) draws a
// seed per initialization, `randint(1e9)`; torch's CPU generator seeded with it fills each Q
// in turn), the same Gram-Schmidt (rank <= 2 or 16-bit) or QR, the same order of operations
// and the same state transitions (iter counted at the last bucket, error feedback as
// copy - decompressed, P and Q kept for warm start). tests/collective/test_powersgd.cpp checks
// it against python3-torch's hook on the same gradients.
//
// Per bucket, three collectives, chained (Note [Chained futures]): the uncompressed gradients
// (issued during backward, as the bucket becomes ready), then P and Q (when DDP waits for the
// bucket at the end of backward). Where we differ from PyTorch:
//   - the divisor is the bucket's (the world size, or the ranks still training under
//     ddp::Join), not always the world size;
//   - a 0-dimensional or empty gradient is sent uncompressed (PyTorch's view fails on it);
//   - with orthogonalization_epsilon 0, an all-zero column of P or Q (a gradient matrix that
//     is zero on every rank) is a ddp::Error saying to set the epsilon, where PyTorch divides
//     by zero and trains on NaN; P and Q are the same on every rank, so all ranks throw at
//     the same stage (one check per column: a device sync per column on CUDA);
//   - state is keyed by bucket index, as PyTorch's, but a bucket whose size no longer matches
//     its saved state (buckets changed after compression started) is an error naming the
//     bucket, not a silent shape error;
//   - no CUDA synchronize at the end: later work is ordered on the stream anyway.
// The state is saved with checkpoints (TrainingState::add(key, state)): per rank, since the error
// feedback is each rank's own; P and Q are equal on every rank.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <utility>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include "ddp/comm_hooks.h"
#include "base/check.h"
#include "base/tensor_bytes.h"
#include "ddp/error.h"

namespace ddp::comm_hooks {

namespace {

constexpr int64_t kStateVersion = 1;

// numpy's legacy RandomState.randint(1_000_000_000): 32-bit Mersenne Twister outputs masked to
// the bit length of the range (2^30 - 1), rejected until <= 999,999,999. std::mt19937 seeded
// with an integer is numpy's init_genrand.
int64_t numpy_randint_1e9(std::mt19937& rng) {
  constexpr uint32_t kMax = 999'999'999, kMask = (1u << 30) - 1;
  uint32_t v;
  do {
    v = static_cast<uint32_t>(rng()) & kMask;
  } while (v > kMax);
  return v;
}

// Thrown where PyTorch would divide by zero: a column of P or Q that is all zero.
[[noreturn]] void zero_column(const char* what) {
  throw Error(fmt::format(
      "PowerSGD: a column of {} is all zero, so orthogonalizing it would divide by zero and "
      "turn the averaged gradients into NaN (PyTorch's hook does so silently). A gradient "
      "matrix is zero on every rank: a parameter that no rank used (find_unused_parameters) or "
      "a frozen layer. Set PowerSGDOptions::orthogonalization_epsilon (e.g. 1e-8), or leave "
      "such parameters out of the model's parameters",
      what));
}

// Python's _orthogonalize_gram_schmidt on a batch of matrices (B x n x r), in place. `what`
// names them for the zero-column error (epsilon 0 only). The matrices are the same on every
// rank (the random or all-reduced Q, the all-reduced P), so every rank throws alike.
void gram_schmidt(const at::Tensor& matrices, double epsilon, const char* what) {
  const int64_t cols = matrices.size(2);
  for (int64_t i = 0; i < cols; ++i) {
    at::Tensor col = matrices.narrow(2, i, 1);
    at::Tensor norm = at::linalg_vector_norm(col, 2, {1}, /*keepdim=*/true);
    if (epsilon == 0) {
      if (norm.eq(0).any().item<bool>()) zero_column(what);
      col.div_(norm);
    } else {
      col.div_(norm + epsilon);
    }
    if (i + 1 < cols) {
      at::Tensor rest = matrices.narrow(2, i + 1, cols - i - 1);
      rest.sub_(at::sum(col * rest, {1}, /*keepdim=*/true) * col);
    }
  }
}

// Python's _orthogonalize: Gram-Schmidt for rank <= 2 or 16-bit types, else Householder QR.
void orthogonalize(at::Tensor matrices, double epsilon, const char* what) {
  const int64_t rank = matrices.size(2);
  const auto dtype = matrices.scalar_type();
  if (rank <= 2 || dtype == at::kHalf || dtype == at::kBFloat16) {
    gram_schmidt(matrices, epsilon, what);
  } else {
    at::Tensor r = at::empty({matrices.size(0), rank, rank}, matrices.options());
    at::linalg_qr_out(matrices, r, matrices);
  }
}

}  // namespace

struct PowerSGDState::Impl {
  PowerSGDOptions o;
  std::mt19937 rng;
  int64_t iter = 0;
  std::map<int64_t, at::Tensor> error, p, q;  // by bucket index
  int64_t numel_before = 0, numel_after = 0;

  void maybe_increase_iter(bool last_bucket) {
    if (last_bucket) ++iter;
  }
};

PowerSGDState::PowerSGDState(PowerSGDOptions options) : impl_(std::make_unique<Impl>()) {
  const PowerSGDOptions& o = options;
  DDP_CHECK(o.matrix_approximation_rank >= 1, ConfigError,
            "PowerSGD: matrix_approximation_rank = {}; it must be at least 1 (1-4 are usual)",
            o.matrix_approximation_rank);
  DDP_CHECK(o.start_powerSGD_iter >= 0, ConfigError,
            "PowerSGD: start_powerSGD_iter = {}; it must be >= 0", o.start_powerSGD_iter);
  DDP_CHECK(!((o.use_error_feedback || o.warm_start) && o.start_powerSGD_iter <= 1), ConfigError,
            "PowerSGD: start_powerSGD_iter = {}, but with use_error_feedback or warm_start it "
            "must be > 1: DDP rebuilds its buckets after the first iteration, and state kept "
            "per bucket from before would not fit them (PyTorch refuses it too)",
            o.start_powerSGD_iter);
  DDP_CHECK(o.min_compression_rate >= 0 && std::isfinite(o.min_compression_rate), ConfigError,
            "PowerSGD: min_compression_rate = {}; it must be a finite number >= 0",
            o.min_compression_rate);
  DDP_CHECK(o.orthogonalization_epsilon >= 0 && std::isfinite(o.orthogonalization_epsilon),
            ConfigError, "PowerSGD: orthogonalization_epsilon = {}; it must be finite and >= 0",
            o.orthogonalization_epsilon);
  impl_->o = options;
  impl_->rng.seed(options.random_seed);
}

PowerSGDState::~PowerSGDState() = default;

const PowerSGDOptions& PowerSGDState::options() const { return impl_->o; }

int64_t PowerSGDState::iter() const { return impl_->iter; }

PowerSGDState::CompressionStats PowerSGDState::compression_stats() const {
  CompressionStats s;
  s.numel_before = impl_->numel_before;
  s.numel_after = impl_->numel_after;
  if (s.numel_after > 0) s.rate = static_cast<double>(s.numel_before) / s.numel_after;
  return s;
}

std::string PowerSGDState::state_dict() const {
  const Impl& s = *impl_;
  torch::serialize::OutputArchive ar;
  auto cu = ar.compilation_unit();
  ar.write("version", at::tensor({kStateVersion}), /*is_buffer=*/true);
  const PowerSGDOptions& o = s.o;
  // What decides the shapes and meaning of the state, checked on load.
  ar.write("options", at::tensor({int64_t{o.matrix_approximation_rank},
                                  int64_t{o.use_error_feedback}, int64_t{o.warm_start},
                                  int64_t{o.batch_tensors_with_same_shape},
                                  int64_t{o.random_seed}}),
           /*is_buffer=*/true);
  ar.write("counters", at::tensor({s.iter, s.numel_before, s.numel_after}), /*is_buffer=*/true);
  std::ostringstream rng;
  rng << s.rng;
  ar.write("rng", bytes_tensor(rng.str()), /*is_buffer=*/true);
  auto write_map = [&](const char* name, const std::map<int64_t, at::Tensor>& m) {
    torch::serialize::OutputArchive sub(cu);
    for (const auto& [bucket, t] : m) {
      sub.write(fmt::format("bucket/{}", bucket), t.detach(), /*is_buffer=*/true);
    }
    ar.write(name, sub);
  };
  write_map("error", s.error);
  write_map("p", s.p);
  write_map("q", s.q);
  std::ostringstream os;
  ar.save_to(os);
  return std::move(os).str();
}

void PowerSGDState::load_state_dict(const std::string& bytes, bool keep_error_feedback) {
  Impl next;
  next.o = impl_->o;
  auto bad = [](const std::string& what) {
    return Error("PowerSGD state: " + what);
  };
  try {
    torch::serialize::InputArchive ar;
    ar.load_from(bytes.data(), bytes.size());
    at::Tensor version, options, counters, rng;
    if (!ar.try_read("version", version, true) || version.numel() != 1 ||
        version.item<int64_t>() != kStateVersion) {
      throw bad("not a PowerSGD state of this version of ddp-cpp");
    }
    if (!ar.try_read("options", options, true) || options.numel() != 5 ||
        !ar.try_read("counters", counters, true) || counters.numel() != 3 ||
        !ar.try_read("rng", rng, true)) {
      throw bad("malformed (options, counters or generator missing)");
    }
    const auto* opt = options.data_ptr<int64_t>();
    const PowerSGDOptions& o = next.o;
    const int64_t want[5] = {o.matrix_approximation_rank, o.use_error_feedback, o.warm_start,
                             o.batch_tensors_with_same_shape, o.random_seed};
    const char* names[5] = {"matrix_approximation_rank", "use_error_feedback", "warm_start",
                            "batch_tensors_with_same_shape", "random_seed"};
    for (int i = 0; i < 5; ++i) {
      if (opt[i] != want[i]) {
        throw bad(fmt::format("saved with {} = {}, but this run has {}: use the same PowerSGD "
                              "options to resume",
                              names[i], opt[i], want[i]));
      }
    }
    const auto* c = counters.data_ptr<int64_t>();
    next.iter = c[0];
    next.numel_before = c[1];
    next.numel_after = c[2];
    std::istringstream is(tensor_bytes(rng));
    is >> next.rng;
    if (!is) throw bad("malformed generator state");
    auto read_map = [&](const char* name, std::map<int64_t, at::Tensor>& m) {
      torch::serialize::InputArchive sub;
      if (!ar.try_read(name, sub)) throw bad(fmt::format("no '{}' tensors", name));
      for (const std::string& key : sub.keys()) {
        int64_t bucket = -1;
        if (std::sscanf(key.c_str(), "bucket/%ld", &bucket) != 1 || bucket < 0) {
          throw bad(fmt::format("unexpected entry '{}/{}'", name, key));
        }
        at::Tensor t;
        sub.read(key, t, true);
        m[bucket] = t;
      }
    };
    read_map("error", next.error);
    read_map("p", next.p);
    read_map("q", next.q);
  } catch (const c10::Error& e) {
    throw bad(fmt::format("LibTorch cannot read it ({})", e.what_without_backtrace()));
  }
  if (!keep_error_feedback) next.error.clear();
  *impl_ = std::move(next);
}

namespace {

// One bucket's work in the PowerSGD phase, shared by its chained stages.
struct BucketWork {
  std::shared_ptr<PowerSGDState> state;
  ProcessGroup* group = nullptr;
  int64_t index = 0;
  bool last = false;
  int divisor = 1;
  at::Tensor input, input_copy;
  at::Tensor p_memory, q_memory;               // the state's P and Q of this bucket
  std::vector<at::Tensor> uncompressed;        // views of the gradients sent as they are
  std::vector<at::Tensor> matrices, ps, qs;    // B x n x m, B x n x r, B x m x r
  std::vector<std::vector<at::Tensor>> batch;  // the gradients stacked into matrices[i], if >1
};

}  // namespace

CommHook powerSGD_hook(std::shared_ptr<PowerSGDState> state) {
  DDP_CHECK(state != nullptr, ConfigError, "powerSGD_hook: the state is null");
  return [state](GradBucket& bucket) -> Future {
    PowerSGDState::Impl& s = *state->impl_;
    const PowerSGDOptions& o = s.o;
    ProcessGroup& pg = bucket.process_group();
    at::Tensor input = bucket.buffer();
    const int divisor = bucket.divisor();

    // Plain all-reduce in the first start_powerSGD_iter iterations.
    if (s.iter < o.start_powerSGD_iter) {
      s.maybe_increase_iter(bucket.is_last());
      input.div_(divisor);
      return Future(pg.all_reduce(input, ReduceOp::kSum), input);
    }

    auto w = std::make_shared<BucketWork>();
    w->state = state;
    w->group = &pg;
    w->index = static_cast<int64_t>(bucket.index());
    w->last = bucket.is_last();
    w->divisor = divisor;
    w->input = input;
    const int64_t b = w->index;
    // State loaded from a checkpoint sits on the CPU: move it to the bucket's device once.
    for (auto* m : {&s.error, &s.p, &s.q}) {
      auto it = m->find(b);
      if (it != m->end() && it->second.device() != input.device()) {
        it->second = it->second.to(input.device());
      }
    }

    // Error feedback: add what compression lost here last time.
    if (o.use_error_feedback) {
      auto it = s.error.find(b);
      if (it != s.error.end()) {
        DDP_CHECK(it->second.numel() == input.numel(), Error,
                  "[rank {}] PowerSGD: bucket {} holds {} gradient values, but its error "
                  "feedback was saved for {}: the buckets changed after compression started "
                  "(another model, bucket_cap_mb or parameter order than the checkpoint's)",
                  pg.rank(), b, input.numel(), it->second.numel());
        input.add_(it->second);
      } else {
        s.error[b] = at::zeros_like(input);
      }
      w->input_copy = input.clone();
    }

    // Step I: which gradients are worth compressing.
    std::vector<at::Tensor> to_compress;
    int64_t total_p = 0, total_q = 0;
    for (const at::Tensor& t : bucket.gradients()) {
      if (t.dim() == 0 || t.numel() == 0) {
        w->uncompressed.push_back(t);
        s.numel_before += t.numel();
        s.numel_after += t.numel();
        continue;
      }
      at::Tensor m = t.view({t.size(0), -1});
      const int64_t n = m.size(0), cols = m.size(1);
      const int64_t r = std::min<int64_t>({n, cols, o.matrix_approximation_rank});
      const int64_t full = n * cols, compressed = (n + cols) * r;
      s.numel_before += full;
      if (static_cast<double>(compressed) * o.min_compression_rate < static_cast<double>(full)) {
        to_compress.push_back(m);
        total_p += n * r;
        total_q += cols * r;
        s.numel_after += compressed;
      } else {
        w->uncompressed.push_back(t);
        s.numel_after += full;
      }
    }

    // Step II: the uncompressed gradients, contiguous.
    std::vector<at::Tensor> flat;
    for (const at::Tensor& t : w->uncompressed) flat.push_back(t.reshape({-1}));
    at::Tensor uncompressed_memory =
        flat.empty() ? at::empty({0}, input.options()) : at::cat(flat);

    // Step III: P and Q memory (kept across iterations with warm start).
    bool randomize = false;
    if (!o.warm_start || s.p.count(b) == 0) {
      randomize = true;
      s.p[b] = at::empty({total_p}, input.options());
      s.q[b] = at::empty({total_q}, input.options());
    }
    DDP_CHECK(s.p[b].numel() == total_p && s.q[b].numel() == total_q, Error,
              "[rank {}] PowerSGD: bucket {} needs P and Q of {} and {} values, but its saved "
              "ones have {} and {}: the buckets changed after compression started",
              pg.rank(), b, total_p, total_q, s.p[b].numel(), s.q[b].numel());

    // Group by shape, in order of first appearance (Python's defaultdict).
    std::vector<std::pair<std::vector<int64_t>, std::vector<at::Tensor>>> by_shape;
    for (const at::Tensor& m : to_compress) {
      auto it = std::find_if(by_shape.begin(), by_shape.end(),
                             [&](const auto& e) { return e.first == m.sizes().vec(); });
      if (it == by_shape.end()) {
        by_shape.emplace_back(m.sizes().vec(), std::vector<at::Tensor>{m});
      } else {
        it->second.push_back(m);
      }
    }
    w->p_memory = s.p[b];
    w->q_memory = s.q[b];
    int64_t p_at = 0, q_at = 0;
    auto add_matrix = [&](at::Tensor batched, std::vector<at::Tensor> originals) {
      const int64_t bs = batched.size(0), n = batched.size(1), cols = batched.size(2);
      const int64_t r = std::min<int64_t>({n, cols, o.matrix_approximation_rank});
      w->matrices.push_back(batched);
      w->batch.push_back(std::move(originals));
      w->ps.push_back(w->p_memory.narrow(0, p_at, bs * n * r).view({bs, n, r}));
      w->qs.push_back(w->q_memory.narrow(0, q_at, bs * cols * r).view({bs, cols, r}));
      p_at += bs * n * r;
      q_at += bs * cols * r;
    };
    for (auto& [shape, group] : by_shape) {
      if (o.batch_tensors_with_same_shape && group.size() > 1) {
        add_matrix(at::stack(group), group);
      } else {
        for (const at::Tensor& m : group) add_matrix(m.unsqueeze(0), {});
      }
    }

    // Q: the previous iteration's (warm start), or fresh from a seed every rank draws alike.
    const double eps = o.orthogonalization_epsilon;
    if (!randomize) {
      for (const at::Tensor& q : w->qs) orthogonalize(q, eps, "Q (warm start)");
    } else {
      at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(
          static_cast<uint64_t>(numpy_randint_1e9(s.rng)));
      for (const at::Tensor& q : w->qs) {
        q.copy_(at::randn(q.sizes(), gen, q.options().device(at::kCPU)));
        orthogonalize(q, eps, "the random Q");
      }
    }
    for (size_t i = 0; i < w->matrices.size(); ++i) at::bmm_out(w->ps[i], w->matrices[i], w->qs[i]);

    Future uncompressed(pg.all_reduce(uncompressed_memory, ReduceOp::kSum), uncompressed_memory);
    return uncompressed
        .then([w](at::Tensor reduced) {
          reduced.div_(w->divisor);
          int64_t at = 0;
          for (const at::Tensor& t : w->uncompressed) {
            t.copy_(reduced.narrow(0, at, t.numel()).view_as(t));
            at += t.numel();
          }
          // P is orthogonalized next, so it needs no division.
          return Future(w->group->all_reduce(w->p_memory, ReduceOp::kSum), w->p_memory);
        })
        .then([w, eps](at::Tensor) {
          for (const at::Tensor& p : w->ps) orthogonalize(p, eps, "P = sum over ranks of M Q");
          for (size_t i = 0; i < w->matrices.size(); ++i) {
            at::bmm_out(w->qs[i], w->matrices[i].transpose(1, 2), w->ps[i]);
          }
          return Future(w->group->all_reduce(w->q_memory, ReduceOp::kSum), w->q_memory);
        })
        .then([w](at::Tensor q) {
          PowerSGDState::Impl& s = *w->state->impl_;
          q.div_(w->divisor);
          for (size_t i = 0; i < w->matrices.size(); ++i) {
            at::bmm_out(w->matrices[i], w->ps[i], w->qs[i].transpose(1, 2));
            // A stacked batch is a copy: back into the gradients it came from.
            for (size_t k = 0; k < w->batch[i].size(); ++k) w->batch[i][k].copy_(w->matrices[i][k]);
          }
          if (s.o.use_error_feedback) s.error[w->index] = w->input_copy - w->input;
          if (!s.o.warm_start) {  // PyTorch clears all; the others' stages hold their own
            s.p.erase(w->index);
            s.q.erase(w->index);
          }
          s.maybe_increase_iter(w->last);
          return Future::completed(w->input);
        });
  };
}

}  // namespace ddp::comm_hooks
