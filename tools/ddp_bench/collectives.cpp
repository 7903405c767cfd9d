// ddp-bench collectives (see collectives.h).
#include "collectives.h"

#include <pthread.h>  // pthread_setaffinity_np
#include <sched.h>    // sched_getaffinity
#include <unistd.h>   // gethostname

#include <chrono>
#include <cstdio>
#include <algorithm>  // std::find
#include <cstring>    // std::memcpy
#include <atomic>
#include <map>
#include <optional>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "ddp/error.h"
#include "groups.h"
#include "pattern.h"
#include "report.h"
#include "sweep.h"

namespace ddp::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

constexpr int64_t kCacheLine = 64;  // bytes; buffers start on their own line

int64_t round_up(int64_t v, int64_t multiple) { return (v + multiple - 1) / multiple * multiple; }

// Memory reused by every size and collective: arenas of 64 MiB and more are mmap'ed afresh by
// malloc each time, and faulting their pages in again would dominate a sweep's run time.
class Scratch {
 public:
  // With `comm_group`, the arenas are that group's comm buffers (collective: every rank grows
  // them at the same sizes, as the sweep is the same everywhere).
  explicit Scratch(ProcessGroup* comm_group = nullptr) : comm_group_(comm_group) {}

  // `bytes` of memory as a 1-D tensor of `type` (bytes a multiple of its size); index 0 is the
  // input arena, 1 the output arena. Grows, never shrinks; contents are whatever was there.
  at::Tensor get(int index, int64_t bytes, at::ScalarType type) {
    at::Tensor& buf = bufs_[index];
    if (!buf.defined() || buf.numel() < bytes) {
      buf = at::Tensor();  // the old arena goes first: peak memory is one arena, not two
      buf = comm_group_ != nullptr ? comm_group_->comm_buffer(bytes, at::kByte)
                                   : at::empty({bytes}, at::kByte);
    }
    return buf.narrow(0, 0, bytes).view(type);
  }

 private:
  ProcessGroup* comm_group_;
  at::Tensor bufs_[2];
};

// Note [Buffer ring]
// One buffer reused every iteration stays in cache and flatters every backend (Open MPI's xhc
// README warns about exactly this). Each size therefore gets an arena of K slots that together
// span at least --ring-bytes (64 MiB: more than a last-level cache), filled once up front in
// one pass: iteration i uses slot i mod K, so by the time a slot is used, tens of MiB have been
// written after it. A slot used again (large sizes, where K is small) is refilled right after
// its previous use, K - 1 slots earlier. The fills and the verification run outside the timed
// region.
class Arena {
 public:
  // `in_count`/`out_count`: elements per rank of one slot's input and output (0: in place).
  Arena(Scratch& scratch, int64_t in_count, int64_t out_count, at::ScalarType type,
        int64_t ring_bytes) {
    const int64_t elem = static_cast<int64_t>(c10::elementSize(type));
    const int64_t line = kCacheLine / elem;
    in_count_ = in_count;
    out_count_ = out_count;
    in_stride_ = round_up(in_count, line);
    out_stride_ = out_count > 0 ? round_up(out_count, line) : 0;
    slots_ = ring_slots((in_stride_ + out_stride_) * elem, ring_bytes);
    in_ = scratch.get(0, slots_ * in_stride_ * elem, type);
    if (out_count > 0) out_ = scratch.get(1, slots_ * out_stride_ * elem, type);
  }

  int64_t slots() const { return slots_; }
  // Element offset of slot k's input in its arena (Note [Verification pattern]).
  int64_t offset(int64_t k) const { return k * in_stride_; }
  at::Tensor input(int64_t k) const { return in_.narrow(0, k * in_stride_, in_count_); }
  at::Tensor output(int64_t k) const { return out_.narrow(0, k * out_stride_, out_count_); }
  at::Tensor& whole_input() { return in_; }
  at::Tensor& whole_output() { return out_; }
  bool has_output() const { return out_.defined(); }

 private:
  int64_t in_count_ = 0, out_count_ = 0, in_stride_ = 0, out_stride_ = 0, slots_ = 1;
  at::Tensor in_, out_;
};

// One collective at one size and dtype on one group: what each rank sends, runs and expects.
class OpTest {
 public:
  OpTest(ProcessGroup& pg, Scratch& scratch, std::string op, at::ScalarType type, int64_t count,
         int64_t ring_bytes)
      : pg_(pg), op_(std::move(op)), type_(type), n_(pg.size()), r_(pg.rank()),
        arena_(scratch, input_count(op_, count, n_), output_count(op_, count, n_), type,
               ring_bytes) {
    chunk_ = (op_ == "all_gather" || op_ == "reduce_scatter") ? count / n_ : count;
  }

  int64_t slots() const { return arena_.slots(); }

  // Every slot ready for its first use, in one pass over each arena.
  void prepare_all() {
    if (op_ == "broadcast" && r_ != 0) {
      arena_.whole_input().zero_();
    } else {
      fill_periodic(arena_.whole_input(), tile(r_, type_));  // slot k: offset(k) + r
    }
    if (arena_.has_output()) arena_.whole_output().zero_();
  }

  // Slot k ready for its use number `use`.
  void prepare(int64_t k, int64_t use) {
    const int64_t o = arena_.offset(k);
    if (op_ == "broadcast" && r_ != 0) {
      arena_.input(k).zero_();
    } else {
      fill_periodic(arena_.input(k), tile(o + r_ + use, type_));
    }
    if (arena_.has_output()) arena_.output(k).zero_();
  }

  // The views a run of slot k passes to the group, made before the clock starts.
  struct Views {
    at::Tensor in, out;
    std::vector<at::Tensor> chunks;  // all_gather: of the output; reduce_scatter: of the input
  };
  Views views(int64_t k) const {
    Views v{arena_.input(k), arena_.has_output() ? arena_.output(k) : at::Tensor(), {}};
    if (op_ == "all_gather") v.chunks = v.out.chunk(n_);
    if (op_ == "reduce_scatter") v.chunks = v.in.chunk(n_);
    return v;
  }

  Work issue(Views& v) {
    if (op_ == "sendrecv") {
      // nccl-tests' sendrecv: each rank sends to the next and receives from the previous, both
      // posted before either is waited for.
      Work sent = pg_.isend(v.in, (r_ + 1) % n_);
      Work got = pg_.irecv(v.out, (r_ + n_ - 1) % n_);
      sent.wait();
      return got;
    }
    if (op_ == "all_reduce") return pg_.all_reduce(v.in, ReduceOp::kSum);
    if (op_ == "broadcast") return pg_.broadcast(v.in, 0);
    if (op_ == "all_gather") return pg_.all_gather(v.chunks, v.in);
    return pg_.reduce_scatter(v.out, v.chunks, ReduceOp::kSum);
  }

  // Whether slot k holds the expected result of its use number `use`.
  bool verify(int64_t k, int64_t use) const {
    const int64_t o = arena_.offset(k);
    if (op_ == "all_reduce")
      return matches_periodic(arena_.input(k), summed_tile(o + use, n_, type_));
    if (op_ == "broadcast") return matches_periodic(arena_.input(k), tile(o + use, type_));
    if (op_ == "sendrecv") {
      return matches_periodic(arena_.output(k), tile(o + (r_ + n_ - 1) % n_ + use, type_));
    }
    if (op_ == "all_gather") {
      const auto chunks = arena_.output(k).chunk(n_);
      for (int q = 0; q < n_; ++q) {
        if (!matches_periodic(chunks[q], tile(o + q + use, type_))) return false;
      }
      return true;
    }
    // Chunk r of rank s's input is tile(o + s + use + r * chunk): summed over s.
    return matches_periodic(arena_.output(k), summed_tile(o + use + r_ * chunk_, n_, type_));
  }

 private:
  static int64_t input_count(const std::string& op, int64_t count, int n) {
    return op == "all_gather" ? count / n : count;
  }
  static int64_t output_count(const std::string& op, int64_t count, int n) {
    if (op == "all_gather" || op == "sendrecv") return count;
    if (op == "reduce_scatter") return count / n;
    return 0;  // in place
  }

  ProcessGroup& pg_;
  const std::string op_;
  const at::ScalarType type_;
  const int n_, r_;
  int64_t chunk_ = 0;  // elements per rank's share
  Arena arena_;
};

// What one size of one collective gave on this rank.
struct Outcome {
  std::vector<double> times_s;  // timed iterations
  int64_t wrong = 0;
  std::string error;  // set when a collective threw
};

// Note [Timing]
// Each iteration starts after a barrier on the measured group, so the ranks enter it together
// (to within that backend's barrier skew), and is timed on every rank from issue to wait()'s
// return. An iteration's time is the mean over ranks (nccl-tests averages its ranks' times
// too); the reported time is the median over iterations, robust to the noise of a shared
// machine.
Outcome run_size(ProcessGroup& pg, Scratch& scratch, const std::string& op, at::ScalarType type,
                 int64_t count, const CollectivesOptions& o) {
  Outcome out;
  try {
    OpTest test(pg, scratch, op, type, count, o.ring_bytes);
    test.prepare_all();
    const int total = o.warmup + o.iters;
    for (int i = 0; i < total; ++i) {
      const int64_t k = i % test.slots();
      const int64_t use = i / test.slots();
      auto views = test.views(k);
      pg.barrier().wait();
      const auto start = Clock::now();
      Work work = test.issue(views);
      work.wait();
      const auto end = Clock::now();
      if (i >= o.warmup) out.times_s.push_back(seconds(start, end));
      if (!test.verify(k, use)) ++out.wrong;
      if (i + test.slots() < total) test.prepare(k, use + 1);
    }
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

// Single-core memcpy of `bytes` between buffers out of cache (the same ring as the
// collectives), median over iterations: the floor a shared-memory collective is compared with.
CollectiveRow measure_memcpy(int64_t bytes, const CollectivesOptions& o) {
  const int64_t stride = round_up(bytes, kCacheLine);
  const int64_t slots = ring_slots(2 * stride, o.ring_bytes);
  at::Tensor src = at::full({slots * stride}, 1, at::kByte);  // touched: no page faults later
  at::Tensor dst = at::zeros({slots * stride}, at::kByte);
  const int iters = std::max(o.iters, 5);
  std::vector<double> times;
  for (int i = 0; i < o.warmup + iters; ++i) {
    const int64_t k = i % slots;
    const auto start = Clock::now();
    std::memcpy(dst.data_ptr<uint8_t>() + k * stride, src.data_ptr<uint8_t>() + k * stride,
                static_cast<size_t>(bytes));
    const auto end = Clock::now();
    if (i >= o.warmup) times.push_back(seconds(start, end));
  }
  const double t = median(times);
  return {.backend = "memcpy",
          .op = "memcpy",
          .dtype = "uint8",
          .ranks = 1,
          .bytes = bytes,
          .count = bytes,
          .iters = iters,
          .time_us = t * 1e6,
          .algbw_gbps = bytes / t / 1e9,
          .busbw_gbps = bytes / t / 1e9};
}

// The round trip of one cache line between two CPUs of this process's affinity mask (median
// of 5 batches of 20000, ns), or nullopt with fewer than 2 CPUs. Shared-memory collectives move
// every byte between cores, so their times follow it: on this project's 2-vCPU VM it switches
// between ~100 and ~330 ns from one minute to the next (the host places the vCPUs near or far
// apart), and the staged 4 MiB all_reduce between ~630 and ~2300 us with it.
struct CoreToCore {
  int a = 0, b = 0;
  double round_trip_ns = 0;
};
std::optional<CoreToCore> measure_core_to_core() {
  cpu_set_t mask;
  if (sched_getaffinity(0, sizeof(mask), &mask) != 0 || CPU_COUNT(&mask) < 2) return std::nullopt;
  CoreToCore out;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE && cpus.size() < 2; ++c) {
    if (CPU_ISSET(c, &mask)) cpus.push_back(c);
  }
  out.a = cpus[0];
  out.b = cpus[1];
  auto pin = [](pthread_t t, int cpu) {
    cpu_set_t one;
    CPU_ZERO(&one);
    CPU_SET(cpu, &one);
    return pthread_setaffinity_np(t, sizeof(one), &one) == 0;
  };
  constexpr int64_t kTrips = 20000, kBatches = 5;
  alignas(64) std::atomic<int64_t> line{0};
  std::vector<double> ns;
  std::thread echo([&] {
    pin(pthread_self(), out.b);
    for (int64_t i = 0; i < kTrips * kBatches; ++i) {
      while (line.load(std::memory_order_acquire) != 2 * i + 1) {
      }
      line.store(2 * i + 2, std::memory_order_release);
    }
  });
  const bool pinned = pin(pthread_self(), out.a);
  for (int64_t batch = 0; batch < kBatches; ++batch) {
    const auto start = Clock::now();
    for (int64_t i = batch * kTrips; i < (batch + 1) * kTrips; ++i) {
      line.store(2 * i + 1, std::memory_order_release);
      while (line.load(std::memory_order_acquire) != 2 * i + 2) {
      }
    }
    ns.push_back(seconds(start, Clock::now()) * 1e9 / kTrips);
  }
  echo.join();
  sched_setaffinity(0, sizeof(mask), &mask);  // this thread back on all of them
  if (!pinned) return std::nullopt;
  out.round_trip_ns = median(ns);
  return out;
}

std::string host_name() {
  char name[256] = {0};
  gethostname(name, sizeof(name) - 1);
  return name;
}

// One table per op and dtype comparing each backend's time with the first available one's.
void print_comparison(const std::vector<CollectiveRow>& rows,
                      const std::vector<std::string>& backends, const CollectivesOptions& o) {
  if (backends.size() < 2) return;
  const std::string& base = backends.front();
  for (const auto& dtype : o.dtypes) {
    for (const auto& op : o.ops) {
      std::map<int64_t, std::map<std::string, double>> by_size;  // bytes -> backend -> us
      for (const auto& r : rows) {
        if (r.op == op && r.dtype == dtype) by_size[r.bytes][r.backend] = r.time_us;
      }
      if (by_size.empty()) continue;
      std::string head = fmt::format("# {:>11}", "size");
      for (const auto& b : backends) head += fmt::format(" {:>12}", b + "(us)");
      for (size_t i = 1; i < backends.size(); ++i) {
        head += fmt::format(" {:>14}", base + "/" + backends[i]);
      }
      std::printf("#\n# %s %s: time per backend; the last columns are speedups over %s\n%s\n",
                  op.c_str(), dtype.c_str(), base.c_str(), head.c_str());
      for (const auto& [bytes, times] : by_size) {
        std::string line = fmt::format("  {:>11}", format_bytes(bytes));
        for (const auto& b : backends) {
          auto it = times.find(b);
          line += it == times.end() ? fmt::format(" {:>12}", "-")
                                    : fmt::format(" {:>12.2f}", it->second);
        }
        for (size_t i = 1; i < backends.size(); ++i) {
          auto a = times.find(base), b = times.find(backends[i]);
          line += a != times.end() && b != times.end() && b->second > 0
                      ? fmt::format(" {:>13.2f}x", a->second / b->second)
                      : fmt::format(" {:>14}", "-");
        }
        std::printf("%s\n", line.c_str());
      }
    }
  }
}

}  // namespace

int run_collectives(const CollectivesOptions& o) {
  for (const auto& op : o.ops) bus_factor(op, 1);  // validates the names
  std::vector<at::ScalarType> types;
  for (const auto& d : o.dtypes) types.push_back(parse_dtype(d));
  const std::vector<int64_t> sizes = doubling_sizes(o.min_bytes, o.max_bytes);
  if (o.iters < 1 || o.warmup < 0) throw ConfigError("--iters must be >= 1 and --warmup >= 0");

  Groups groups;
  const bool main = groups.rank() == 0;
  const int n = groups.size();
  auto say = [&](const std::string& text) {
    if (!main) return;
    std::printf("%s\n", text.c_str());
    std::fflush(stdout);
  };
  say(
      fmt::format("# ddp-bench collectives: {} rank{} on {}; sizes {} to {}; {} iterations "
                  "after {} warm-up per size",
                  n, n > 1 ? "s" : "", host_name(), format_bytes(sizes.front()),
                  format_bytes(sizes.back()), o.iters, o.warmup));
  say("# time: median over iterations of the mean over ranks, each iteration after a barrier; "
      "algbw = size / time;\n# busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, "
      "reduce_scatter), 1 (broadcast, sendrecv), as in nccl-tests");
  say(
      fmt::format("# buffers: a ring of >= {} per size, so no iteration starts cache-warm; "
                  "every result of every iteration verified exactly",
                  format_bytes(o.ring_bytes)));

  std::vector<CollectiveRow> rows;
  // The floor, on rank 0 alone while the others wait.
  if (main) {
    rows.push_back(measure_memcpy(sizes.back(), o));
    say(fmt::format("# memcpy floor: one core copies {} (out of cache) in {:.1f} us: {:.2f} GB/s",
                    format_bytes(sizes.back()), rows.back().time_us, rows.back().algbw_gbps));
    if (const auto c2c = measure_core_to_core()) {
      say(fmt::format("# core to core: a cache line's round trip between CPUs {} and {} takes "
                      "{:.0f} ns (shared-memory collectives follow it; a VM's can change "
                      "from one run to the next)",
                      c2c->a, c2c->b, c2c->round_trip_ns));
    }
  }
  groups.control().barrier().wait();

  Scratch private_scratch;
  bool failed = false;
  std::vector<std::string> available;
  std::vector<std::string> seen;
  for (const auto& backend : o.backends) {
    if (std::find(seen.begin(), seen.end(), backend) != seen.end()) continue;
    seen.push_back(backend);
    std::string why;
    const auto formed_at = Clock::now();
    std::shared_ptr<ProcessGroup> pg = groups.form(backend, why);
    if (!pg) {
      say(fmt::format("#\n# backend {}: unavailable, skipped: {}", backend, why));
      continue;
    }
    available.push_back(backend);
    say(fmt::format("#\n# backend {}: group of {} formed in {:.2f} s (reports itself as '{}'){}",
                    backend, pg->size(), seconds(formed_at, Clock::now()), pg->backend(),
                    uses_comm_buffers(backend) ? "; buffers from ProcessGroup::comm_buffer" : ""));
    std::optional<Scratch> comm_scratch;
    if (uses_comm_buffers(backend)) comm_scratch.emplace(pg.get());
    Scratch& scratch = comm_scratch ? *comm_scratch : private_scratch;
    for (size_t ti = 0; ti < types.size(); ++ti) {
      const int64_t elem = static_cast<int64_t>(c10::elementSize(types[ti]));
      for (const auto& op : o.ops) {
        say(fmt::format("#\n# {}: {}{}, {}", backend, op,
                        op == "all_reduce" || op == "reduce_scatter" ? " (sum)"
                        : op == "broadcast"                          ? " (root 0)"
                        : op == "sendrecv" ? " (to the next rank, from the previous)"
                                           : "",
                        o.dtypes[ti]));
        say(collective_table_header());
        for (int64_t bytes : sizes) {
          const int64_t count = elements_for(op, bytes, elem, n);
          if (count == 0) continue;  // smaller than one element per rank
          Outcome got = run_size(*pg, scratch, op, types[ti], count, o);
          // Across ranks: per-iteration times summed, wrong results counted, failures flagged.
          at::Tensor agg = at::zeros({o.iters + 2}, at::kDouble);
          for (size_t i = 0; i < got.times_s.size(); ++i) agg[i] = got.times_s[i];
          agg[o.iters] = static_cast<double>(got.wrong);
          agg[o.iters + 1] = got.error.empty() ? 0.0 : 1.0;
          groups.control().all_reduce(agg, ReduceOp::kSum).wait();
          if (agg[o.iters + 1].item<double>() > 0) {
            say(fmt::format("  {:>11} failed: {}", format_bytes(bytes),
                            got.error.empty() ? "on another rank (see its output)" : got.error));
            failed = true;
            break;  // the next sizes of this op would fail the same way
          }
          std::vector<double> mean_times;
          for (int i = 0; i < o.iters; ++i) mean_times.push_back(agg[i].item<double>() / n);
          const double time_s = median(mean_times);
          const int64_t used = count * elem;
          const double algbw = used / time_s / 1e9;
          CollectiveRow row{.backend = backend,
                            .op = op,
                            .dtype = o.dtypes[ti],
                            .ranks = n,
                            .bytes = used,
                            .count = count,
                            .iters = o.iters,
                            .time_us = time_s * 1e6,
                            .algbw_gbps = algbw,
                            .busbw_gbps = algbw * bus_factor(op, n),
                            .wrong = static_cast<int64_t>(agg[o.iters].item<double>())};
          if (row.wrong > 0) failed = true;
          say(collective_table_line(row));
          rows.push_back(row);
        }
      }
    }
    pg->barrier().wait();
  }

  if (main) {
    print_comparison(rows, available, o);
    if (!o.csv.empty()) {
      write_collectives_csv(o.csv, rows);
      say("# csv: " + o.csv);
    }
    if (!o.png.empty()) say("# " + plot_collectives(o.png, rows));
    int64_t wrong = 0;
    for (const auto& r : rows) wrong += r.wrong;
    say(fmt::format("# {}: {} results wrong{}", failed ? "FAILED" : "verified", wrong,
                    failed ? "" : " (every iteration checked)"));
  }
  groups.control().barrier().wait();
  return failed ? 1 : 0;
}

}  // namespace ddp::bench
