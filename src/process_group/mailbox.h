// send and recv where the transport has none: shared memory through the group's store.
//
// Note [Point to point]
// send and recv move one tensor between two ranks, matched as in PyTorch: by the two ranks, the
// tag, and the order of the calls on that channel (the n-th send from a to b with tag t meets the
// n-th recv on b from a with tag t). They are not collectives: the other ranks take no part, so
// they take no number in the group's sequence (which every rank shares) and stay out of the
// flight recorder's ring (whose verdicts compare every rank's collectives by number). Each is
// named by its number on its channel instead, the same on both sides: "recv #3 (from rank 0,
// tag 7, 8 x Float)" meets "send #3 (to rank 1, tag 7, 8 x Float)". Each is bounded by the
// group's timeout, like a collective.
// Gloo and NCCL have them natively; the hierarchy sends them over its flat Gloo group. The shm
// transport's protocol is collective (every rank passes every sync), so a group over shm moves
// them through this mailbox:
//   send: copies the tensor into a fresh memfd (Note [Shared segments]), publishes "pid fd dtype
//     count" under the message's key in the group's store, and is complete: its tensor may be
//     reused at once (the message is buffered, as a small Gloo send is).
//   recv: polls the store for the key, maps /proc/<pid>/fd/<fd>, copies the data out and marks
//     the message taken. While it waits it asks the transport every 50 ms whether the sender is
//     gone (its process exited or was killed, or it destroyed its group: the shm group's slots
//     say so); then the message can never come (a sender's group waits for its messages to be
//     taken before it leaves), and the recv fails at once, naming the sender, instead of at the
//     timeout.
//   The sender closes the memfd and deletes both keys once the message is taken: at its next
//     send, or when its group is destroyed, which waits for that (bounded by the timeout, and
//     not at all for receivers that are gone): a sender that exited right after its send would
//     take the message (its fd, and the store when it hosts it) with it.
// A message whose dtype or size differs from its recv's tensor fails the recv, naming both.
// Cost: two copies and a few store round trips per message (tens of microseconds on one host).
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include "base/thread_annotations.h"
#include "process_group/collective.h"
#include "process_group/shm/segment.h"
#include "process_group/transport/transport.h"

namespace ddp {

class Mailbox {
 public:
  // `peer_gone(r)`: why rank r can send nothing more, "" while it can (Transport::peer_gone).
  Mailbox(c10::intrusive_ptr<::c10d::Store> store, int rank, std::chrono::milliseconds timeout,
          std::function<std::string(int)> peer_gone);
  // Waits until every message sent is taken, bounded by the timeout, or until their receivers
  // are gone (one line on stderr for those that were not taken).
  ~Mailbox();
  Mailbox(const Mailbox&) = delete;
  Mailbox& operator=(const Mailbox&) = delete;

  // Sends `t` (contiguous, CPU) as message call.seq to rank call.root with call.tag. Complete on
  // return. Throws ddp::Error when the message cannot be made or published.
  void send(const CollectiveDesc& call, const at::Tensor& t) EXCLUDES(mu_);
  // Receives message call.seq from rank call.root with call.tag into `t` (contiguous, CPU).
  std::shared_ptr<Pending> recv(const CollectiveDesc& call, at::Tensor t);

 private:
  struct Sent {
    std::string key;
    CollectiveDesc call;
    shm::Segment data;  // holds the memfd open until the receiver mapped it
  };
  // Forgets the messages taken since the last look; `wait` until `deadline` for all of them.
  void collect(bool wait, std::chrono::steady_clock::time_point deadline) EXCLUDES(mu_);

  const c10::intrusive_ptr<::c10d::Store> store_;
  const int rank_;
  const std::chrono::milliseconds timeout_;
  const std::function<std::string(int)> peer_gone_;
  Mutex mu_;
  std::deque<Sent> sent_ GUARDED_BY(mu_);  // not yet taken, oldest first
};

// The store keys of message call.seq on its channel (sender, receiver, tag).
std::string mailbox_key(int sender, int receiver, int tag, uint64_t number);

}  // namespace ddp
