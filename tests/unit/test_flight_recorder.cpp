// The flight recorder's ring, its JSON form and its verdicts, alone (no sockets).
#include <signal.h>    // kill
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // fork, getpid

#include <chrono>
#include <functional>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "base/proc_stat.h"  // own_start_time
#include "process_group/flight_recorder.h"

namespace ddp::flight {
namespace {

CollectiveDesc call(uint64_t seq, const char* op, const char* dtype, uint64_t count,
                    ReduceOp reduce = ReduceOp::kSum) {
  CollectiveDesc c;
  c.seq = seq;
  c.op = *collective_named(op);
  c.dtype = dtype_named(dtype).value_or(DType::kU8);
  c.count = count;
  c.reduce = reduce;
  return c;
}

Record make(uint64_t seq, const char* op, const char* dtype, int64_t count, State state,
            int64_t step = -1, ReduceOp reduce = ReduceOp::kSum) {
  Record r;
  r.call = call(seq, op, dtype, count, reduce);
  r.state = state;
  r.step = step;
  return r;
}

// The one description of a collective (process_group/collective.h) that the fingerprints, the
// flight records, Work::description() and the desync checks share.
TEST(CollectiveDesc, DescribesComparesAndRoundTripsEveryField) {
  CollectiveDesc a = call(12, "all_reduce", "Float", 1024);
  EXPECT_EQ(a.describe(), "all_reduce #12 (sum, 1024 x Float)");
  CollectiveDesc b = a;
  b.seq = 13;
  EXPECT_TRUE(a.same_call(b)) << "the number is not part of the call";
  EXPECT_FALSE(a == b);
  for (auto change : std::vector<std::function<void(CollectiveDesc&)>>{
           [](CollectiveDesc& c) { c.reduce = ReduceOp::kMax; },
           [](CollectiveDesc& c) { c.dtype = DType::kBF16; },
           [](CollectiveDesc& c) { c.count = 1023; }, [](CollectiveDesc& c) { c.root = 1; },
           [](CollectiveDesc& c) { c.op = Collective::kReduceScatter; }}) {
    CollectiveDesc d = a;
    change(d);
    EXPECT_FALSE(a.same_call(d)) << d.describe();
    const auto words = d.to_words();
    EXPECT_EQ(CollectiveDesc::from_words(words.data()), d) << d.describe();
  }
  CollectiveDesc bc = call(3, "broadcast", "Long", 1);
  bc.root = 2;
  EXPECT_EQ(bc.describe(), "broadcast #3 (from rank 2, 1 x Long)");
  EXPECT_EQ(call(4, "all_gather", "BFloat16", 8).describe(), "all_gather #4 (8 x BFloat16)");
  EXPECT_EQ(call(5, "barrier", "-", 0).describe(), "barrier #5");
  for (DType t : {DType::kU8, DType::kBool, DType::kBF16, DType::kF64, DType::kOther}) {
    EXPECT_EQ(dtype_named(name(t)), t);
  }
  EXPECT_EQ(reduce_op_named("min"), ReduceOp::kMin);
  EXPECT_EQ(collective_named("reduce_scatter"), Collective::kReduceScatter);
  EXPECT_FALSE(collective_named("all_to_all_single"));
  // The rooted ones and the all-to-all, as their errors and records name them.
  CollectiveDesc r = call(6, "reduce", "Float", 8, ReduceOp::kMax);
  r.root = 1;
  EXPECT_EQ(r.describe(), "reduce #6 (max to rank 1, 8 x Float)");
  CollectiveDesc g = call(7, "gather", "Int", 8);
  EXPECT_EQ(g.describe(), "gather #7 (to rank 0, 8 x Int)");
  g.op = Collective::kScatter;
  g.root = 2;
  EXPECT_EQ(g.describe(), "scatter #7 (from rank 2, 8 x Int)");
  EXPECT_EQ(call(9, "all_to_all", "Float", 4).describe(), "all_to_all #9 (4 x Float per peer)");
  EXPECT_EQ(call(10, "all_to_all", "Float", 0).describe(), "all_to_all #10 (uneven splits, Float)");
  for (Collective c :
       {Collective::kReduce, Collective::kGather, Collective::kScatter, Collective::kAllToAll}) {
    EXPECT_EQ(collective_named(name(c)), c);
    CollectiveDesc d = a;
    d.op = c;
    EXPECT_EQ(CollectiveDesc::from_words(d.to_words().data()), d) << d.describe();
  }
}

TEST(FlightRecorder, RecordsIssueCompletionStepAndBucketNotes) {
  Ring ring(4);
  set_step(811);
  ring.issue(call(1, "broadcast", "Long", 3), nullptr);
  ring.finish(1, true);
  set_step(812);
  int owner = 0;
  annotate_next(&owner, 2, "fc.weight, fc.bias");
  EXPECT_EQ(take_note(nullptr), nullptr);
  const Note* note = take_note(&owner);
  ASSERT_NE(note, nullptr);
  ring.issue(call(2, "all_reduce", "Float", 1024), note);
  EXPECT_EQ(take_note(&owner), nullptr) << "a note is taken once";
  ring.issue(call(3, "barrier", "-", 0), nullptr);
  ring.finish(3, false);
  set_step(-1);

  const std::vector<Record> got = ring.snapshot();
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].call.seq, 1u);
  EXPECT_EQ(got[0].call.op, Collective::kBroadcast);
  EXPECT_EQ(got[0].call.dtype, DType::kI64);
  EXPECT_EQ(got[0].call.count, 3u);
  EXPECT_EQ(got[0].state, State::kCompleted);
  EXPECT_EQ(got[0].step, 811);
  EXPECT_EQ(got[0].bucket, -1);
  EXPECT_GT(got[0].completed_us, 0);
  EXPECT_GE(got[0].completed_us, got[0].issued_us);
  EXPECT_EQ(got[1].state, State::kIssued);
  EXPECT_EQ(got[1].completed_us, 0);
  EXPECT_EQ(got[1].step, 812);
  EXPECT_EQ(got[1].bucket, 2);
  EXPECT_EQ(got[1].params, "fc.weight, fc.bias");
  EXPECT_EQ(got[1].describe(), "all_reduce #2 (sum, 1024 x Float)");
  EXPECT_EQ(got[2].state, State::kFailed);
  EXPECT_EQ(got[2].bucket, -1) << "the note was meant for one collective";
}

// A GPU collective: wait() returned (enqueued on the stream), its CUDA event fired later.
TEST(FlightRecorder, RecordsEnqueueAndCompletionSeparately) {
  Ring ring(4);
  ring.issue(call(1, "all_reduce", "Float", 8), nullptr);
  ring.enqueue(1);
  std::vector<Record> got = ring.snapshot();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].state, State::kEnqueued);
  EXPECT_GE(got[0].enqueued_us, got[0].issued_us);
  EXPECT_EQ(got[0].completed_us, 0);
  ring.enqueue(1);  // once only
  ring.finish(1, true);
  got = ring.snapshot();
  EXPECT_EQ(got[0].state, State::kCompleted);
  EXPECT_GE(got[0].completed_us, got[0].enqueued_us);
  ring.finish(1, false);  // a finished record stays as it is
  EXPECT_EQ(ring.snapshot()[0].state, State::kCompleted);
  // A rank whose GPU never finished an earlier collective: the verdict says so.
  PeerView behind;
  behind.rank = 1;
  Record stuck = make(1, "all_reduce", "Float", 8, State::kEnqueued);
  behind.records = std::vector<Record>{stuck};
  EXPECT_EQ(verdict(0, make(2, "all_reduce", "Float", 8, State::kIssued), {behind}),
            "rank 1 never issued all_reduce #2; it has on its GPU stream, not finished, "
            "all_reduce #1 (sum, 8 x Float); it has completed no collective yet");
  // JSON keeps the state and both times.
  stuck.enqueued_us = 77;
  const std::vector<Record> back = records_from_json(nlohmann::json::parse(
      nlohmann::json{{"records", to_json(std::vector<Record>{stuck})}}.dump()));
  ASSERT_EQ(back.size(), 1u);
  EXPECT_EQ(back[0].state, State::kEnqueued);
  EXPECT_EQ(back[0].enqueued_us, 77);
}

// Note [GPU completion]: works enqueued on a stream are completed when their event fires, and
// one running past the timeout is reported (oldest first) and kept.
TEST(FlightRecorder, InFlightWorksCompleteByEventAndTheOverdueOneIsNamed) {
  using std::chrono::milliseconds;
  Ring ring(8);
  InFlight inflight;
  bool first_done = false;
  bool second_done = false;
  const auto t0 = std::chrono::steady_clock::now();
  for (uint64_t seq : {1, 2}) {
    ring.issue(call(seq, "all_reduce", "Float", 4), nullptr);
    ring.enqueue(seq);
  }
  inflight.add({call(1, "all_reduce", "Float", 4), t0, [&] { return first_done; }});
  inflight.add(
      {call(2, "all_reduce", "Float", 4), t0 + milliseconds(10), [&] { return second_done; }});
  EXPECT_FALSE(inflight.sweep(&ring, milliseconds(100), t0 + milliseconds(50)));
  EXPECT_EQ(ring.snapshot()[0].state, State::kEnqueued);
  first_done = true;
  EXPECT_FALSE(inflight.sweep(&ring, milliseconds(100), t0 + milliseconds(60)));
  EXPECT_EQ(ring.snapshot()[0].state, State::kCompleted);
  EXPECT_EQ(ring.snapshot()[1].state, State::kEnqueued);
  EXPECT_EQ(inflight.size(), 1u);
  const auto overdue = inflight.sweep(&ring, milliseconds(100), t0 + milliseconds(200));
  ASSERT_TRUE(overdue);
  EXPECT_EQ(overdue->seq, 2u);
  EXPECT_EQ(inflight.size(), 1u) << "an overdue work stays held";
  second_done = true;
  EXPECT_FALSE(inflight.sweep(&ring, milliseconds(100), t0 + milliseconds(300)));
  EXPECT_EQ(inflight.size(), 0u);
  EXPECT_EQ(ring.snapshot()[1].state, State::kCompleted);
}

TEST(FlightRecorder, KeepsTheLastCapacityRecordsInOrder) {
  Ring ring(4);
  for (uint64_t s = 1; s <= 10; ++s) {
    ring.issue(call(s, "all_reduce", "Float", s), nullptr);
    ring.finish(s, true);
  }
  ring.finish(3, false);  // overwritten long ago: no effect on slot 3 % 4 (now seq 7)
  const std::vector<Record> got = ring.snapshot();
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(got[i].call.seq, 7 + i);
    EXPECT_EQ(got[i].state, State::kCompleted);
  }
}

TEST(FlightRecorder, JsonRoundTrip) {
  Record a = make(5, "all_reduce", "Float", 4, State::kCompleted, 812);
  a.bucket = 1;
  a.params = "conv1.weight";
  a.issued_us = 123;
  a.completed_us = 456;
  const Record b = make(6, "broadcast", "Long", 1, State::kIssued);
  const nlohmann::json doc = {{"records", to_json(std::vector<Record>{a, b})}};
  const std::vector<Record> back = records_from_json(nlohmann::json::parse(doc.dump()));
  ASSERT_EQ(back.size(), 2u);
  EXPECT_EQ(back[0].call.seq, 5u);
  EXPECT_EQ(back[0].step, 812);
  EXPECT_EQ(back[0].bucket, 1);
  EXPECT_EQ(back[0].params, "conv1.weight");
  EXPECT_EQ(back[0].issued_us, 123);
  EXPECT_EQ(back[0].completed_us, 456);
  EXPECT_EQ(back[0].state, State::kCompleted);
  EXPECT_EQ(back[1].describe(), "broadcast #6 (from rank 0, 1 x Long)");
  EXPECT_EQ(back[0].call, a.call);
  EXPECT_EQ(back[1].call, b.call);
  EXPECT_EQ(back[1].state, State::kIssued);
  EXPECT_EQ(back[1].bucket, -1);
}

TEST(FlightRecorder, VerdictNamesTheRankBehindAndWhereItStands) {
  const Record failed = make(57, "all_reduce", "Float", 4, State::kIssued, 812);
  PeerView behind;
  behind.rank = 1;
  behind.records = std::vector<Record>{make(55, "all_reduce", "Float", 4, State::kCompleted, 811),
                                       make(56, "all_reduce", "Float", 4, State::kCompleted, 812)};
  EXPECT_EQ(verdict(0, failed, {behind}),
            "rank 1 never issued all_reduce #57; its last completed collective is #56 "
            "(all_reduce) at step 812");
  // Stuck inside an earlier collective that has not completed.
  behind.records = std::vector<Record>{make(55, "all_reduce", "Float", 4, State::kCompleted),
                                       make(56, "broadcast", "Long", 1, State::kIssued)};
  EXPECT_EQ(
      verdict(0, failed, {behind}),
      "rank 1 never issued all_reduce #57; it waits in broadcast #56 (from rank 0, 1 x Long); "
      "its last "
      "completed collective is #55 (all_reduce)");
  behind.records = std::vector<Record>{};
  EXPECT_EQ(verdict(0, failed, {behind}),
            "rank 1 never issued all_reduce #57; it has issued no collective yet");
  // A peer that issued the same collective is not at fault.
  PeerView fine;
  fine.rank = 2;
  fine.records = std::vector<Record>{make(57, "all_reduce", "Float", 4, State::kIssued)};
  EXPECT_EQ(verdict(0, failed, {fine}), "");
}

TEST(FlightRecorder, VerdictNamesADesyncWithBothCalls) {
  const Record failed = make(12, "all_reduce", "Float", 4, State::kFailed);
  PeerView other;
  other.rank = 1;
  other.records = std::vector<Record>{make(12, "broadcast", "Long", 1, State::kFailed)};
  EXPECT_EQ(verdict(0, failed, {other}),
            "rank 0 issued all_reduce #12 (sum, 4 x Float), rank 1 issued broadcast #12 (from "
            "rank 0, 1 x Long)");
  other.records = std::vector<Record>{make(12, "all_reduce", "Float", 8, State::kFailed)};
  EXPECT_EQ(verdict(0, failed, {other}),
            "rank 0 issued all_reduce #12 (sum, 4 x Float), rank 1 issued all_reduce #12 (sum, 8 "
            "x Float)");
}

// The reduce op is part of the call: sum on one rank and max on another is a desync (the
// recorder once compared only op, dtype and count).
TEST(FlightRecorder, VerdictNamesAReduceOpDesync) {
  const Record failed = make(12, "all_reduce", "Float", 4, State::kFailed);
  PeerView other;
  other.rank = 1;
  other.records =
      std::vector<Record>{make(12, "all_reduce", "Float", 4, State::kFailed, -1, ReduceOp::kMax)};
  EXPECT_EQ(verdict(0, failed, {other}),
            "rank 0 issued all_reduce #12 (sum, 4 x Float), rank 1 issued all_reduce #12 (max, 4 "
            "x Float)");
}

TEST(FlightRecorder, VerdictNamesSilentStoppedAndExitedRanks) {
  const Record failed = make(3, "barrier", "-", 0, State::kIssued);
  PeerView stopped{.rank = 1, .pid = 4242, .liveness = Liveness::kStopped};
  PeerView gone{.rank = 2, .pid = 4343, .liveness = Liveness::kGone};
  PeerView silent{.rank = 3, .silence = "did not answer within 3 s"};
  EXPECT_EQ(verdict(0, failed, {silent, stopped, gone}),
            "rank 1 (pid 4242) is stopped (SIGSTOP or a debugger) and did not answer; rank 2 "
            "(pid 4343) has exited; rank 3 did not answer within 3 s (no records): it may be "
            "stopped, dead or unreachable");
  const std::string t = table(0, {failed}, {stopped});
  EXPECT_NE(t.find("rank 0: last issued barrier #3 (issued), last completed none"),
            std::string::npos)
      << t;
}

TEST(FlightRecorder, ProcessStateTellsRunningStoppedAndGone) {
  EXPECT_EQ(process_state(getpid()), Liveness::kRunning);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    pause();
    _exit(0);
  }
  ASSERT_EQ(kill(child, SIGSTOP), 0);
  Liveness seen = Liveness::kUnknown;
  for (int i = 0; i < 200 && seen != Liveness::kStopped; ++i) {  // up to 2 s
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    seen = process_state(child);
  }
  EXPECT_EQ(seen, Liveness::kStopped);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  EXPECT_EQ(process_state(child), Liveness::kGone);
}

// The start time a peer published names its process: the same pid with another start time is
// a process that took the pid over, and the peer is gone.
TEST(FlightRecorder, AReusedPidIsGone) {
  const uint64_t start = own_start_time();
  ASSERT_NE(start, 0u);
  EXPECT_EQ(process_state(getpid(), start), Liveness::kRunning);
  EXPECT_EQ(process_state(getpid(), start + 1), Liveness::kGone);
}

}  // namespace
}  // namespace ddp::flight
