// The shared-memory transport (see Note [Shared-memory collectives] in group.h).
#include "process_group/shm/group.h"

#include <linux/futex.h>  // FUTEX_WAIT, FUTEX_WAKE
#include <sys/syscall.h>  // SYS_futex
#include <unistd.h>       // getpid, syscall

#include <algorithm>
#include <cerrno>
#include <climits>  // INT_MAX
#include <cstring>  // memcpy
#include <ctime>    // timespec

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/check.h"
#include "base/proc_stat.h"     // live_process: a dead or stopped peer
#include "ddp/relayed_error.h"  // Relayed: a peer's failure, announced
#include "process_group/desync.h"
#include "process_group/shm/reduce.h"

namespace ddp::shm {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::duration;
using std::chrono::microseconds;
using std::chrono::milliseconds;

// How long a waiter spins before it sleeps. At a collective's first sync the peers may still be
// computing (backward), so the spin is short and the core goes back to that work. Later syncs
// of the same collective wait for peers known to be inside it, moving their share of one
// chunk: they arrive within microseconds unless descheduled, and a sleep there would cost a
// wake-up (tens of microseconds on a VM, where an idle vCPU must be woken by the hypervisor)
// at every chunk, as the ranks then take turns sleeping.
// sched_yield() is no middle way: on a busy machine it hands the core to any other process
// (a compiler) for a whole time slice, and ours came back milliseconds later at every chunk.
constexpr microseconds kSpinFirst{30};
constexpr microseconds kSpinInside{200};
// A sleeping waiter wakes at least this often to check the deadline, aborts and its peers.
constexpr milliseconds kPoll{50};
// Elements are reduced and pushed to the peers' buffers in blocks of this many bytes: the
// block is read back from L1 for each peer instead of from memory.
constexpr size_t kSharedBlockBytes = size_t{32} << 10;
constexpr int kRing = 4;  // fingerprints kept per rank; a peer is at most one collective ahead
constexpr size_t kAbortReasonBytes = 1024;
constexpr size_t kPage = 4096;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

double seconds(Clock::duration d) { return duration<double>(d).count(); }

uint64_t pack(const CollectiveDesc& fp) {
  return static_cast<uint64_t>(fp.op) | static_cast<uint64_t>(fp.dtype) << 8 |
         static_cast<uint64_t>(fp.reduce) << 16 |
         static_cast<uint64_t>(static_cast<uint32_t>(fp.root)) << 32;
}

CollectiveDesc unpack(uint64_t word, uint64_t count, uint64_t seq) {
  CollectiveDesc fp;
  fp.op = static_cast<OpKind>(word & 0xff);
  fp.dtype = static_cast<DType>((word >> 8) & 0xff);
  fp.reduce = static_cast<Reduce>((word >> 16) & 0xff);
  fp.root = static_cast<int32_t>(static_cast<uint32_t>(word >> 32));
  fp.count = count;
  fp.seq = seq;
  return fp;
}

// Slice p of m elements split over n ranks, in whole 64-byte groups where possible.
std::pair<size_t, size_t> slice(size_t m, int n, int p) {
  const size_t per = round_up((m + n - 1) / n, 16);
  const size_t lo = std::min(m, per * static_cast<size_t>(p));
  return {lo, std::min(m, lo + per)};
}

}  // namespace

// The segment's first word, the layout word: "DDPSHM" in the high 48 bits, the layout version
// in the low 16. Local rank 0 (which created the segment) writes it; every other rank checks it
// before it touches any slot, so ranks of builds whose segments differ refuse each other
// instead of reading each other's fields at the wrong offsets. Bump kLayoutVersion with any
// change to Control, Slot, kRing or the staging areas.
constexpr uint64_t kSegmentMark = 0x4444'5053'484d'0000;
constexpr uint64_t kVersionMask = 0xffff;
constexpr uint64_t kLayoutVersion = 1;

struct Group::Control {
  std::atomic<uint64_t> magic;      // kSegmentMark | kLayoutVersion, once rank 0 started
  std::atomic<uint32_t> wake;       // futex word: bumped by an arrival when someone sleeps
  std::atomic<uint32_t> sleepers;   // ranks inside a futex wait (or about to be)
  std::atomic<int32_t> abort_rank;  // 1 + the rank that gave up first; 0 = none
  std::atomic<uint32_t> abort_ready;
  char abort_reason[kAbortReasonBytes];
};

struct alignas(64) Group::Slot {
  std::atomic<uint64_t> arrived;      // syncs this rank has reached (Note [Shared-memory ...])
  std::atomic<uint64_t> current_seq;  // the collective it runs or ran last
  std::atomic<int32_t> pid;
  std::atomic<uint32_t> left;        // 1 once this rank destroyed its group
  std::atomic<uint64_t> start_time;  // of pid, so a reused pid is not taken for our rank
  struct Published {
    std::atomic<uint64_t> seq;
    std::atomic<uint64_t> word;  // pack(fingerprint)
    std::atomic<uint64_t> count;
    std::atomic<uint64_t> buffer;  // SharedBuffer::id holding the data; 0: private memory
    std::atomic<uint64_t> offset;  // bytes into that buffer
  } ring[kRing];
};

size_t Group::segment_bytes(int size, size_t chunk_bytes) {
  return round_up(sizeof(Control), kPage) + round_up(sizeof(Slot) * size, kPage) +
         2 * chunk_bytes * static_cast<size_t>(size);
}

Group::Group(Options options, Segment segment)
    : o_(options), segment_(std::move(segment)), pid_(static_cast<int>(getpid())) {
  DDP_ASSERT(segment_.size() >= segment_bytes(o_.size, o_.chunk_bytes),
             "shm segment of {} bytes is too small", segment_.size());
  DDP_ASSERT(o_.chunk_bytes >= 64 * static_cast<size_t>(o_.size),
             "shm chunk of {} bytes is too small", o_.chunk_bytes);
  char* base = segment_.data();
  ctl_ = reinterpret_cast<Control*>(base);
  Slot* slots = reinterpret_cast<Slot*>(base + round_up(sizeof(Control), kPage));
  for (int r = 0; r < o_.size; ++r) slots_.push_back(&slots[r]);
  stopped_since_.assign(o_.size, Clock::time_point{});
  const Clock::time_point deadline = Clock::now() + o_.timeout;
  if (o_.rank == 0) {
    ctl_->magic.store(kSegmentMark | kLayoutVersion, std::memory_order_release);
  } else {
    uint64_t word = 0;
    while ((word = ctl_->magic.load(std::memory_order_acquire)) == 0) {
      DDP_CHECK(Clock::now() < deadline, RendezvousError,
                "[rank {}] rank {} created the shared segment but did not start its transport "
                "within {:.1f} s; it may have died or been stopped, or run an older ddp-cpp build",
                me(), name(0), seconds(o_.timeout));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    DDP_CHECK((word & ~kVersionMask) == kSegmentMark, RendezvousError,
              "[rank {}] the shared-memory segment of rank {} is not a ddp-cpp segment (its first "
              "word is {:#x}): every rank must run the same ddp-cpp build",
              me(), name(0), word);
    DDP_CHECK((word & kVersionMask) == kLayoutVersion, RendezvousError,
              "[rank {}] the shared-memory segment of rank {} has layout version {}, this build "
              "expects {}: every rank must run the same ddp-cpp build",
              me(), name(0), word & kVersionMask, kLayoutVersion);
  }
  Slot& mine = *slots_[o_.rank];
  mine.start_time.store(own_start_time());
  mine.pid.store(pid_);
  // Every rank must be identifiable before any collective waits for it: a peer stopped or
  // killed between the segment handshake and this point would otherwise never be named.
  for (int r = 0; r < o_.size; ++r) {
    while (slots_[r]->pid.load() == 0) {
      DDP_CHECK(Clock::now() < deadline, RendezvousError,
                "[rank {}] rank {} mapped the shared segment but did not start its transport "
                "within {:.1f} s; it may have died or been stopped",
                me(), name(r), seconds(o_.timeout));
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  executor_ = std::thread([this] { executor_loop(); });
}

Group::~Group() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  queued_.signal_all();
  done_.signal_all();
  if (executor_.joinable()) executor_.join();
  // Peers still waiting for this rank learn at once that it will not come.
  slots_[o_.rank]->left.store(1, std::memory_order_seq_cst);
  ctl_->wake.fetch_add(1, std::memory_order_seq_cst);
  futex(&ctl_->wake, FUTEX_WAKE, INT_MAX, nullptr);
  MutexLock lock(&mu_);
  for (auto& op : queue_) {
    op->error = std::make_exception_ptr(CollectiveError(
        fmt::format("[rank {}] {} was not run: its process group was destroyed first", me(),
                    op->fp.describe())));
    op->body = nullptr;
    op->done.store(true);
  }
  queue_.clear();
  done_.signal_all();
}

char* Group::staging(int rank, int half) const {
  const size_t off = round_up(sizeof(Control), kPage) + round_up(sizeof(Slot) * o_.size, kPage);
  return segment_.data() + off + (static_cast<size_t>(rank) * 2 + half) * o_.chunk_bytes;
}

// ---- Execution ---------------------------------------------------------------------------

std::shared_ptr<Op> Group::submit(uint64_t seq, CollectiveDesc fp, std::function<void()> body,
                                  Placement placement) {
  auto op = std::make_shared<Op>();
  op->seq = seq;
  op->fp = fp;
  op->fp.seq = seq;
  op->body = std::move(body);
  op->placement = std::move(placement);
  {
    MutexLock lock(&mu_);
    DDP_ASSERT(!stopping_, "collective issued on a destroyed shm group");
    queue_.push_back(op);
  }
  queued_.signal();
  return op;
}

void Group::executor_loop() {
  while (true) {
    {
      MutexLock lock(&mu_);
      while (!stopping_ && queue_.empty()) queued_.wait();
      if (stopping_) return;
    }
    // A thread inside wait() may be running the queue already: then it is not our turn, and
    // blocking on the mutex would only add a hand-off; it wakes us if work remains.
    if (!exec_mu_.try_lock()) {
      MutexLock lock(&mu_);
      while (!stopping_ && !queue_.empty() && helping_) done_.wait();
      continue;
    }
    MutexLock exec(&exec_mu_, std::adopt_lock);
    run_front();
  }
}

void Group::run_front() {
  std::shared_ptr<Op> op;
  {
    MutexLock lock(&mu_);
    if (queue_.empty()) return;
    op = std::move(queue_.front());
    queue_.pop_front();
  }
  execute(*op);
  op->done.store(true);
  {
    MutexLock lock(&mu_);  // pairs with the waiter's check of op->done
  }
  done_.signal_all();
}

void Group::execute(Op& op) {
  if (failed_) {
    op.error = std::make_exception_ptr(CollectiveError(fmt::format(
        "[rank {}] {} was not run: this process group failed at an earlier collective: {}", me(),
        op.fp.describe(), failed_message_)));
  } else {
    try {
      begin(op);
      op.body();
    } catch (const Error& e) {
      op.error = std::current_exception();
      failed_message_ = e.what();
      failed_ = op.error;
    } catch (const std::exception& e) {
      failed_message_ = fmt::format("[rank {}] {} failed: {}", me(), op.fp.describe(), e.what());
      op.error = std::make_exception_ptr(CollectiveError(failed_message_));
      failed_ = op.error;
    }
    if (failed_) raise_abort(failed_message_);
  }
  op.body = nullptr;  // releases the tensors
  op.placement = {};
  current_ = nullptr;
}

void Group::set_helping(bool helping) {
  {
    MutexLock lock(&mu_);
    helping_ = helping;
  }
  if (!helping) done_.signal_all();
}

void Group::wait(Op& op) {
  if (!op.done.load() && exec_mu_.try_lock()) {
    {
      MutexLock exec(&exec_mu_, std::adopt_lock);
      set_helping(true);
      while (!op.done.load()) {
        {
          MutexLock lock(&mu_);
          if (queue_.empty()) break;
        }
        run_front();
      }
    }
    set_helping(false);  // wakes the executor for whatever was queued behind `op`
  }
  if (!op.done.load()) {
    MutexLock lock(&mu_);
    while (!op.done.load()) done_.wait();
  }
  if (op.error) std::rethrow_exception(op.error);
}

// ---- Collectives -------------------------------------------------------------------------

void Group::register_buffer(const std::shared_ptr<SharedBuffer>& buffer) {
  DDP_ASSERT(buffer && static_cast<int>(buffer->base.size()) == o_.size, "bad shared buffer");
  MutexLock lock(&buffers_mu_);
  std::erase_if(buffers_, [](const auto& kv) { return kv.second.expired(); });
  buffers_[reinterpret_cast<uintptr_t>(buffer->base[o_.rank])] = buffer;
}

Placement Group::find(const void* data, size_t bytes) const {
  const auto at = reinterpret_cast<uintptr_t>(data);
  MutexLock lock(&buffers_mu_);
  auto it = buffers_.upper_bound(at);  // the first buffer starting after `data`
  if (it == buffers_.begin()) return {};
  --it;
  std::shared_ptr<SharedBuffer> b = it->second.lock();
  if (!b || at + bytes > it->first + b->bytes) return {};
  return {std::move(b), at - it->first};
}

std::shared_ptr<Op> Group::all_reduce(uint64_t seq, void* data, size_t count, DType dtype,
                                      Reduce op, std::shared_ptr<void> keep, Placement placement) {
  CollectiveDesc fp{OpKind::kAllReduce, dtype, op, 0, count};
  return submit(
      seq, fp,
      [this, data, count, dtype, op, placement, keep = std::move(keep)] {
        all_reduce_here(data, count, dtype, op, placement);
      },
      placement);
}

std::shared_ptr<Op> Group::run(uint64_t seq, CollectiveDesc fp, std::function<void()> body,
                               Placement placement) {
  return submit(seq, fp, std::move(body), std::move(placement));
}

void Group::restart_deadline() {
  exec_mu_.assert_held();  // reached from an op's body (a std::function), under exec_mu_
  DDP_ASSERT(current_ != nullptr, "restart_deadline outside a collective");
  deadline_ = Clock::now() + o_.timeout;
}

void Group::all_reduce_here(void* data, size_t count, DType dtype, Reduce op,
                            const Placement& placement) {
  exec_mu_.assert_held();  // reached from an op's body (a std::function), under exec_mu_
  DDP_ASSERT(current_ != nullptr, "all_reduce_here outside a collective");
  if (placement.buffer) {
    DDP_ASSERT(placement.buffer->base[o_.rank] + placement.offset == static_cast<char*>(data) &&
                   placement.offset + count * element_size(dtype) <= placement.buffer->bytes,
               "all_reduce #{}: placement does not hold the data", current_->seq);
  }
  if (o_.size == 1) return;  // the sum, max, min and mean of one rank are its own values
  if (!placement.buffer || current_->placement.buffer != placement.buffer) {
    // Only the op's own placement was published: any other data is staged.
    return staged_all_reduce(static_cast<char*>(data), count, dtype, op, /*synced_once=*/false);
  }
  sync();  // every rank's data is in place, and every placement published
  if (placed_alike(placement)) {
    shared_all_reduce(placement, count, dtype, op);
    sync();  // every slice is in every buffer
    return;
  }
  staged_all_reduce(static_cast<char*>(data), count, dtype, op, /*synced_once=*/true);
}

void Group::broadcast_here(void* data, size_t total, int root) {
  exec_mu_.assert_held();  // reached from an op's body (a std::function), under exec_mu_
  DDP_ASSERT(current_ != nullptr, "broadcast_here outside a collective");
  if (o_.size == 1) return;
  char* bytes = static_cast<char*>(data);
  size_t a = 0;
  do {
    const size_t m = std::min(o_.chunk_bytes, total - a);
    const int h = next_half();
    if (o_.rank == root) std::memcpy(staging(root, h), bytes + a, m);
    sync();
    if (o_.rank != root) std::memcpy(bytes + a, staging(root, h), m);
    a += m;
  } while (a < total);
}

bool Group::placed_alike(const Placement& mine) const {
  const uint64_t seq = current_->seq;
  for (int p = 0; p < o_.size; ++p) {
    const Slot::Published& e = slots_[p]->ring[seq % kRing];
    if (e.buffer.load(std::memory_order_relaxed) != mine.buffer->id ||
        e.offset.load(std::memory_order_relaxed) != mine.offset) {
      return false;
    }
  }
  return true;
}

bool Group::any_peer_placed() const {
  const uint64_t seq = current_->seq;
  for (int p = 0; p < o_.size; ++p) {
    if (p != o_.rank && slots_[p]->ring[seq % kRing].buffer.load(std::memory_order_relaxed) != 0) {
      return true;
    }
  }
  return false;
}

// Slice `rank` of the elements, in blocks: reduce the block of every rank's buffer in rank
// order into ours, then copy it into every peer's buffer (read back from L1).
void Group::shared_all_reduce(const Placement& where, size_t count, DType dtype, Reduce op) {
  const int n = o_.size;
  const size_t es = element_size(dtype);
  const SharedBuffer& b = *where.buffer;
  const auto [lo, hi] = slice(count, n, o_.rank);
  const size_t block = std::max<size_t>(1, kSharedBlockBytes / es);
  std::vector<const void*> srcs(n);
  for (size_t i = lo; i < hi; i += block) {
    const size_t m = std::min(block, hi - i);
    const size_t at = where.offset + i * es;
    for (int p = 0; p < n; ++p) srcs[p] = b.base[p] + at;
    char* mine = b.base[o_.rank] + at;
    reduce(dtype, op, mine, srcs.data(), n, m);
    for (int p = 0; p < n; ++p) {
      if (p != o_.rank) std::memcpy(b.base[p] + at, mine, m * es);
    }
  }
}

// The staged protocol (Note [Shared-memory collectives]). `synced_once`: this rank's data is
// in a shared buffer but a peer's is not, and the collective's first sync is behind us; the
// peers that staged their first chunk before it wait at one more sync for ours.
void Group::staged_all_reduce(char* bytes, size_t count, DType dtype, Reduce op, bool synced_once) {
  const int n = o_.size;
  const size_t es = element_size(dtype);
  const size_t per = o_.chunk_bytes / es;
  std::vector<const void*> srcs(n);
  size_t a = 0;
  bool first = true;
  do {
    const size_t m = std::min(per, count - a);
    const int h = next_half();
    std::memcpy(staging(o_.rank, h), bytes + a * es, m * es);
    sync();
    if (first && !synced_once && any_peer_placed()) sync();  // their first chunk is staged now
    first = false;
    const auto [lo, hi] = slice(m, n, o_.rank);
    for (int p = 0; p < n; ++p) srcs[p] = staging(p, h) + lo * es;
    reduce(dtype, op, staging(o_.rank, h) + lo * es, srcs.data(), n, hi - lo);
    sync();
    for (int p = 0; p < n; ++p) {
      const auto [plo, phi] = slice(m, n, p);
      std::memcpy(bytes + (a + plo) * es, staging(p, h) + plo * es, (phi - plo) * es);
    }
    a += m;
  } while (a < count);
}

std::shared_ptr<Op> Group::broadcast(uint64_t seq, void* data, size_t count, DType dtype, int root,
                                     std::shared_ptr<void> keep) {
  CollectiveDesc fp{OpKind::kBroadcast, dtype, Reduce::kSum, root, count};
  return submit(seq, fp, [this, data, count, dtype, root, keep = std::move(keep)] {
    broadcast_here(data, count * element_size(dtype), root);
  });
}

std::shared_ptr<Op> Group::all_gather(uint64_t seq, std::vector<void*> outputs, const void* input,
                                      size_t count, DType dtype, std::shared_ptr<void> keep) {
  CollectiveDesc fp{OpKind::kAllGather, dtype, Reduce::kSum, 0, count};
  return submit(seq, fp,
                [this, outputs = std::move(outputs), input, count, dtype, keep = std::move(keep)] {
                  all_gather_here(outputs, input, count * element_size(dtype));
                });
}

void Group::all_gather_here(const std::vector<void*>& outputs, const void* input, size_t total) {
  exec_mu_.assert_held();  // reached from an op's body (a std::function), under exec_mu_
  DDP_ASSERT(current_ != nullptr, "all_gather_here outside a collective");
  const char* in = static_cast<const char*>(input);
  if (outputs[o_.rank] != input) std::memcpy(outputs[o_.rank], in, total);
  if (o_.size == 1) return;
  size_t a = 0;
  do {
    const size_t m = std::min(o_.chunk_bytes, total - a);
    const int h = next_half();
    std::memcpy(staging(o_.rank, h), in + a, m);
    sync();
    for (int p = 0; p < o_.size; ++p) {
      if (p != o_.rank) std::memcpy(static_cast<char*>(outputs[p]) + a, staging(p, h), m);
    }
    a += m;
  } while (a < total);
}

std::shared_ptr<Op> Group::reduce_scatter(uint64_t seq, void* output,
                                          std::vector<const void*> inputs, size_t count,
                                          DType dtype, Reduce op, std::shared_ptr<void> keep) {
  CollectiveDesc fp{OpKind::kReduceScatter, dtype, op, 0, count};
  return submit(seq, fp,
                [this, output, inputs = std::move(inputs), count, dtype, op,
                 keep = std::move(keep)] {
                  reduce_scatter_here(output, inputs, count, dtype, op);
                });
}

void Group::reduce_scatter_here(void* output, const std::vector<const void*>& inputs, size_t count,
                                DType dtype, Reduce op) {
  exec_mu_.assert_held();  // reached from an op's body (a std::function), under exec_mu_
  DDP_ASSERT(current_ != nullptr, "reduce_scatter_here outside a collective");
  const int n = o_.size;
  const size_t es = element_size(dtype);
  char* out = static_cast<char*>(output);
  if (n == 1) {
    const void* src[1] = {inputs[0]};
    reduce(dtype, op, out, src, 1, count);  // a copy (avg divides by 1)
    return;
  }
  const size_t per = std::max<size_t>(1, o_.chunk_bytes / (es * n));  // of each input per chunk
  std::vector<const void*> srcs(n);
  size_t a = 0;
  do {
    const size_t m = std::min(per, count - a);
    const int h = next_half();
    for (int q = 0; q < n; ++q) {
      std::memcpy(staging(o_.rank, h) + q * m * es, static_cast<const char*>(inputs[q]) + a * es,
                  m * es);
    }
    sync();
    for (int p = 0; p < n; ++p) srcs[p] = staging(p, h) + o_.rank * m * es;
    reduce(dtype, op, out + a * es, srcs.data(), n, m);
    a += m;
  } while (a < count);
}

void Group::barrier_here() {
  exec_mu_.assert_held();  // reached from an op's body (a std::function), under exec_mu_
  DDP_ASSERT(current_ != nullptr, "barrier_here outside a collective");
  if (o_.size > 1) sync();
}

std::shared_ptr<Op> Group::barrier(uint64_t seq) {
  return submit(seq, CollectiveDesc{}, [this] {
    exec_mu_.assert_held();  // bodies run under exec_mu_ (run_front)
    sync();
  });
}

// ---- Protocol ----------------------------------------------------------------------------

void Group::begin(const Op& op) {
  current_ = &op;
  fingerprints_checked_ = false;
  started_ = Clock::now();
  deadline_ = started_ + o_.timeout;
  Slot::Published& e = slots_[o_.rank]->ring[op.seq % kRing];
  e.seq.store(op.seq, std::memory_order_relaxed);
  e.word.store(pack(op.fp), std::memory_order_relaxed);
  e.count.store(op.fp.count, std::memory_order_relaxed);
  e.buffer.store(op.placement.buffer ? op.placement.buffer->id : 0, std::memory_order_relaxed);
  e.offset.store(op.placement.offset, std::memory_order_relaxed);
  slots_[o_.rank]->current_seq.store(op.seq, std::memory_order_release);
}

void Group::sync() {
  const uint64_t g = ++generation_;
  slots_[o_.rank]->arrived.store(g, std::memory_order_seq_cst);
  if (ctl_->sleepers.load(std::memory_order_seq_cst) != 0) {
    ctl_->wake.fetch_add(1, std::memory_order_seq_cst);
    futex(&ctl_->wake, FUTEX_WAKE, INT_MAX, nullptr);
  }
  wait_for_all(g);
  if (!fingerprints_checked_) {
    fingerprints_checked_ = true;
    check_fingerprints();
  }
}

bool Group::all_arrived(uint64_t g) const {
  for (const Slot* s : slots_) {
    if (s->arrived.load(std::memory_order_acquire) < g) return false;
  }
  return true;
}

void Group::wait_for_all(uint64_t g) {
  if (all_arrived(g)) return;
  // Not the first sync of the collective: the peers are inside it, about to arrive.
  const microseconds spin = fingerprints_checked_ ? kSpinInside : kSpinFirst;
  const Clock::time_point spin_start = Clock::now();
  for (unsigned i = 1;; ++i) {
    cpu_relax();
    if (all_arrived(g)) return;
    if ((i & 127) == 0 && Clock::now() - spin_start > spin) break;
  }
  std::fill(stopped_since_.begin(), stopped_since_.end(), Clock::time_point{});
  while (true) {
    ctl_->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t w = ctl_->wake.load(std::memory_order_seq_cst);
    if (all_arrived(g)) {
      ctl_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
      return;
    }
    const auto left = std::min<Clock::duration>(kPoll, deadline_ - Clock::now());
    if (left > Clock::duration::zero()) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      futex(&ctl_->wake, FUTEX_WAIT, w, &ts);  // EAGAIN/ETIMEDOUT/EINTR: all just re-check
    }
    ctl_->sleepers.fetch_sub(1, std::memory_order_seq_cst);
    if (all_arrived(g)) return;
    check_abort();
    const Clock::time_point now = Clock::now();
    check_peers(g, now);
    if (now >= deadline_) fail_timeout(g);
  }
}

void Group::check_fingerprints() {
  const Op& op = *current_;
  for (int p = 0; p < o_.size; ++p) {
    if (p == o_.rank) continue;
    const Slot::Published& e = slots_[p]->ring[op.seq % kRing];
    const uint64_t seq = e.seq.load(std::memory_order_acquire);
    const CollectiveDesc theirs = unpack(e.word.load(), e.count.load(), seq);
    if (seq == op.seq && theirs == op.fp) continue;
    std::string their_call;
    if (seq == op.seq) {
      their_call = theirs.describe();
    } else {
      const uint64_t cur = slots_[p]->current_seq.load();
      const Slot::Published& c = slots_[p]->ring[cur % kRing];
      their_call = unpack(c.word.load(), c.count.load(), cur).describe();
    }
    throw CollectiveError(
        desync_error(me(), op.fp.describe(), name(p), their_call, "found by shared memory"));
  }
}

std::string Group::where_is(int p) const {
  const uint64_t cur = slots_[p]->current_seq.load();
  const Op& op = *current_;
  if (cur == 0) return fmt::format("rank {} has not issued any collective", name(p));
  const Slot::Published& c = slots_[p]->ring[cur % kRing];
  const std::string call = unpack(c.word.load(), c.count.load(), cur).describe();
  if (cur < op.seq) {
    return fmt::format("rank {} has not reached it; its last collective was {}", name(p), call);
  }
  return fmt::format("rank {} is in {}", name(p), call);
}

std::string Group::peer_gone(int peer) const {
  const Slot& s = *slots_[peer];
  if (s.left.load() != 0) {
    return fmt::format("rank {} destroyed its process group (or is shutting down)", name(peer));
  }
  const int pid = s.pid.load();
  if (pid == 0 || pid == pid_) return "";
  if (!live_process(pid, s.start_time.load())) {
    return fmt::format("rank {} (pid {}) exited or was killed", name(peer), pid);
  }
  return "";
}

void Group::check_peers(uint64_t g, Clock::time_point now) {
  const Op& op = *current_;
  for (int p = 0; p < o_.size; ++p) {
    const Slot& s = *slots_[p];
    if (p == o_.rank || s.arrived.load() >= g) continue;
    DDP_CHECK(s.left.load() == 0, CollectiveError,
              "[rank {}] {} failed: rank {} destroyed its process group (or is shutting down) "
              "without reaching it; {}.",
              me(), op.fp.describe(), name(p), where_is(p));
    const int pid = s.pid.load();
    if (pid == pid_) continue;  // a thread of this process
    const std::optional<ProcStat> peer = live_process(pid, s.start_time.load());
    DDP_CHECK(peer.has_value(), CollectiveError,
              "[rank {}] {} failed: rank {} (pid {}) exited or was killed before reaching it. "
              "Its own error (ddprun's root-cause summary) says why.",
              me(), op.fp.describe(), name(p), pid);
    if (!peer->stopped()) {
      stopped_since_[p] = Clock::time_point{};
      continue;
    }
    if (stopped_since_[p] == Clock::time_point{}) stopped_since_[p] = now;
    DDP_CHECK(now - stopped_since_[p] < kStoppedLimit, CollectiveError,
              "[rank {}] {} failed: rank {} (pid {}) is stopped (SIGSTOP, or held by a "
              "debugger) and has not reached it for {:.1f} s; {}. Resume it (kill -CONT {}) or "
              "end the job.",
              me(), op.fp.describe(), name(p), pid, seconds(now - stopped_since_[p]), where_is(p),
              pid);
  }
}

void Group::fail_timeout(uint64_t g) {
  const Op& op = *current_;
  std::vector<std::string> behind;
  for (int p = 0; p < o_.size; ++p) {
    if (slots_[p]->arrived.load() < g) behind.push_back(where_is(p));
  }
  // The limit counts from the op's start, or from its last restart_deadline() (the hierarchy's
  // cross-host step): then the op has been waiting longer than the limit.
  const bool restarted = deadline_ - o_.timeout > started_;
  throw TimeoutError(fmt::format(
      "[rank {}] {} timed out after {:.1f} s (limit {:.1f} s{}): {}. A rank that is behind may "
      "be stuck in computation or I/O, or issuing collectives in a different order. If the "
      "work is legitimately slow, raise DDP_COLLECTIVE_TIMEOUT or InitOptions::timeout.",
      me(), op.fp.describe(), seconds(Clock::now() - started_), seconds(o_.timeout),
      restarted ? ", counted again after a step that waited elsewhere" : "",
      fmt::join(behind, "; ")));
}

void Group::check_abort() const {
  if (ctl_->abort_ready.load(std::memory_order_acquire) == 0) return;
  const int who = ctl_->abort_rank.load() - 1;
  if (who == o_.rank) return;
  const Op& op = *current_;
  // Relayed: the launcher blames `who`, even when this rank records its error first.
  throw Relayed<CollectiveError>(
      name(who), fmt::format("[rank {}] {} failed because rank {} gave up first: {}", me(),
                             op.fp.describe(), name(who), std::string(ctl_->abort_reason)));
}

void Group::raise_abort(const std::string& reason) {
  int32_t none = 0;
  if (!ctl_->abort_rank.compare_exchange_strong(none, o_.rank + 1)) return;  // someone was first
  const size_t n = std::min(reason.size(), kAbortReasonBytes - 1);
  std::memcpy(ctl_->abort_reason, reason.data(), n);
  ctl_->abort_reason[n] = '\0';
  ctl_->abort_ready.store(1, std::memory_order_release);
  ctl_->wake.fetch_add(1, std::memory_order_seq_cst);
  futex(&ctl_->wake, FUTEX_WAKE, INT_MAX, nullptr);
}

}  // namespace ddp::shm
