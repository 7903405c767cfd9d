// send and recv through shared memory and the group's store (Note [Point to point] in
// mailbox.h).
#include "process_group/mailbox.h"

#include <unistd.h>  // getpid

#include <cstdio>
#include <cstring>  // memcpy
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "base/check.h"
#include "process_group/work_state.h"

namespace ddp {
namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

std::string channel(int sender, int receiver, int tag) {
  return fmt::format("p2p/{}-{}/{}", sender, receiver, tag);
}

std::string taken_key(const std::string& key) { return key + "/taken"; }

// Messages sent on a channel so far, or -1 when the store cannot say.
int64_t sent_so_far(::c10d::Store& store, int sender, int receiver, int tag) {
  try {
    const std::string key = channel(sender, receiver, tag) + "/sent";
    return store.check({key}) ? store.add(key, 0) : 0;
  } catch (const std::exception&) {
    return -1;
  }
}

// How often a waiting recv asks whether its sender is gone.
constexpr auto kPeerLook = std::chrono::milliseconds(50);

// One recv through the mailbox: the first wait() (or an is_completed() that finds the message)
// takes it.
class MailboxRecv final : public Pending {
 public:
  MailboxRecv(c10::intrusive_ptr<::c10d::Store> store, int rank, const CollectiveDesc& call,
              at::Tensor t, std::function<std::string(int)> peer_gone)
      : store_(std::move(store)), rank_(rank), call_(call),
        key_(mailbox_key(call.root, rank, call.tag, call.seq)), t_(std::move(t)),
        peer_gone_(std::move(peer_gone)) {}

  void wait(const detail::WorkState& s) override {
    MutexLock lock(&mu_);
    if (!taken_) receive(s);
    DDP_CHECK(failure_.empty(), CollectiveError, "[rank {}] {} failed: {}", rank_, call_.describe(),
              failure_);
  }

  bool is_completed() const override {
    MutexLock lock(&mu_);
    if (taken_) return true;
    try {
      if (!store_->check({key_})) return false;
      take();
    } catch (const std::exception&) {
      return false;  // wait() says what failed
    }
    return true;
  }

 private:
  void receive(const detail::WorkState& s) REQUIRES(mu_) {
    const Clock::time_point deadline = s.issued + s.timeout;
    auto pause = std::chrono::microseconds(20);
    Clock::time_point next_look = Clock::now() + kPeerLook;
    while (!store_->check({key_})) {
      const Clock::time_point now = Clock::now();
      if (peer_gone_ && now >= next_look) {
        next_look = now + kPeerLook;
        if (const std::string gone = peer_gone_(call_.root); !gone.empty()) {
          // Published just before it went? Then the message is there, and take() says whether
          // its data still is.
          if (store_->check({key_})) break;
          throw CollectiveError(fmt::format(
              "[rank {}] {} failed: {} before sending it; its own error (ddprun's root-cause "
              "summary) says why.",
              rank_, call_.describe(), gone));
        }
      }
      if (now >= deadline) {
        const int64_t sent = sent_so_far(*store_, call_.root, rank_, call_.tag);
        throw TimeoutError(fmt::format(
            "[rank {}] {} timed out after {:.1f} s: rank {} {} with tag {} to this rank{}. It "
            "may be stuck or dead, or send with another tag or to another rank; if the work is "
            "legitimately slow, raise DDP_COLLECTIVE_TIMEOUT or InitOptions::timeout.",
            rank_, call_.describe(), seconds(Clock::now() - s.issued), call_.root,
            sent < 0 ? "has not sent it" : fmt::format("has sent {} message(s)", sent), call_.tag,
            sent < 0 ? "" : fmt::format(" (this recv waits for #{})", call_.seq)));
      }
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(2000));
    }
    take();
  }

  // Copies the message out and marks it taken, also when it does not fit (the sender must not
  // wait for it): failure_ then says why.
  void take() const REQUIRES(mu_) {
    const std::vector<uint8_t> value = store_->get(key_);
    std::istringstream in(std::string(value.begin(), value.end()));
    int pid = 0, fd = -1;
    std::string dtype;
    uint64_t count = 0;
    in >> pid >> fd >> dtype >> count;
    std::string failure;
    if (!in || dtype != name(call_.dtype) || count != call_.count) {
      failure = fmt::format(
          "rank {} sent {} x {}; a send and its recv must have the same dtype and number of "
          "elements",
          call_.root, count, dtype);
    } else if (count > 0) {
      try {
        const size_t n = t_.numel() * t_.element_size();
        shm::Segment data = shm::Segment::open(pid, fd, n);
        std::memcpy(t_.data_ptr(), data.data(), n);
      } catch (const std::exception& e) {
        failure = fmt::format(
            "rank {} sent it but its process (pid {}) is gone, or no longer holds it ({})",
            call_.root, pid, e.what());
      }
    }
    store_->set(taken_key(key_), bytes("1"));
    taken_ = true;
    failure_ = std::move(failure);
  }

  const c10::intrusive_ptr<::c10d::Store> store_;
  const int rank_;
  const CollectiveDesc call_;
  const std::string key_;
  const at::Tensor t_;
  const std::function<std::string(int)> peer_gone_;  // may be empty
  mutable Mutex mu_;
  mutable bool taken_ GUARDED_BY(mu_) = false;
  mutable std::string failure_ GUARDED_BY(mu_);  // why the message taken did not fit
};

}  // namespace

std::string mailbox_key(int sender, int receiver, int tag, uint64_t number) {
  return fmt::format("{}/{}", channel(sender, receiver, tag), number);
}

Mailbox::Mailbox(c10::intrusive_ptr<::c10d::Store> store, int rank,
                 std::chrono::milliseconds timeout, std::function<std::string(int)> peer_gone)
    : store_(std::move(store)), rank_(rank), timeout_(timeout), peer_gone_(std::move(peer_gone)) {}

Mailbox::~Mailbox() {
  collect(true, Clock::now() + timeout_);
  MutexLock lock(&mu_);
  if (sent_.empty()) return;
  const std::string gone = peer_gone_ ? peer_gone_(sent_.front().call.root) : "";
  const std::string why = gone.empty()
                              ? fmt::format("within the timeout ({:.1f} s)", seconds(timeout_))
                              : fmt::format("(the receiver is gone: {})", gone);
  std::fprintf(stderr,
               "[rank %d] ddp: %zu message(s) sent were not received %s before the process "
               "group was destroyed, the first %s: they are dropped\n",
               rank_, sent_.size(), why.c_str(), sent_.front().call.describe().c_str());
}

void Mailbox::send(const CollectiveDesc& call, const at::Tensor& t) {
  collect(false, {});
  Sent m{mailbox_key(rank_, call.root, call.tag, call.seq), call, {}};
  const size_t n = t.numel() * t.element_size();
  if (n > 0) {
    m.data = shm::Segment::create(fmt::format("ddp-p2p-{}", m.key), n);
    std::memcpy(m.data.data(), t.data_ptr(), n);
  }
  store_->set(m.key, bytes(fmt::format("{} {} {} {}", getpid(), n > 0 ? m.data.fd() : -1,
                                       name(call.dtype), call.count)));
  store_->add(channel(rank_, call.root, call.tag) + "/sent", 1);
  MutexLock lock(&mu_);
  sent_.push_back(std::move(m));
}

std::shared_ptr<Pending> Mailbox::recv(const CollectiveDesc& call, at::Tensor t) {
  return std::make_shared<MailboxRecv>(store_, rank_, call, std::move(t), peer_gone_);
}

void Mailbox::collect(bool wait, Clock::time_point deadline) {
  auto pause = std::chrono::microseconds(100);
  Clock::time_point next_look = Clock::now() + kPeerLook;
  while (true) {
    {
      MutexLock lock(&mu_);
      try {
        // A send looks at the oldest messages only, up to the first not taken: a receiver that
        // lags must not cost every send a round trip per message waiting.
        for (auto it = sent_.begin(); it != sent_.end();) {
          if (!store_->check({taken_key(it->key)})) {
            if (!wait) break;
            ++it;
            continue;
          }
          store_->deleteKey(taken_key(it->key));
          store_->deleteKey(it->key);
          it = sent_.erase(it);
        }
      } catch (const std::exception&) {
        return;  // the store is gone: nobody can take them any more
      }
      if (sent_.empty() || !wait || Clock::now() >= deadline) return;
      // Waiting for receivers that are gone would only run out the timeout.
      if (peer_gone_ && Clock::now() >= next_look) {
        next_look = Clock::now() + kPeerLook;
        bool all_gone = true;
        for (const Sent& m : sent_) all_gone = all_gone && !peer_gone_(m.call.root).empty();
        if (all_gone) return;
      }
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(10000));
  }
}

}  // namespace ddp
