// Completion, the once-only async step behind Work and Future: runs once, outcome sticky,
// concurrent waiters block for the first run and share its result.
#include "base/completion.h"

#include <atomic>
#include <stdexcept>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace ddp {
namespace {

TEST(Completion, StepRunsOnce) {
  Completion c;
  int runs = 0;
  EXPECT_FALSE(c.finished());
  c.run([&] { ++runs; });
  c.run([&] { ++runs; });
  EXPECT_EQ(runs, 1);
  EXPECT_TRUE(c.finished());
}

TEST(Completion, ErrorIsStickyAndTheStepIsNotRetried) {
  Completion c;
  int runs = 0;
  auto step = [&] {
    ++runs;
    throw std::runtime_error("boom");
  };
  EXPECT_THROW(c.run(step), std::runtime_error);
  EXPECT_TRUE(c.finished());
  try {
    c.run(step);
    FAIL() << "second run did not rethrow";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "boom");
  }
  EXPECT_EQ(runs, 1);
}

TEST(Completion, ClassifyMapsTheStoredError) {
  Completion c;
  auto classify = [](std::exception_ptr) {
    return std::make_exception_ptr(std::logic_error("classified"));
  };
  EXPECT_THROW(c.run([] { throw 7; }, classify), std::logic_error);
  EXPECT_THROW(c.run([] {}), std::logic_error);  // the classified error, not a new run
}

TEST(Completion, ConcurrentWaitersShareOneRun) {
  Completion c;
  std::atomic<int> runs{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&] {
      c.run([&] {
        ++runs;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      });
      EXPECT_TRUE(c.finished());
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(runs.load(), 1);
}

}  // namespace
}  // namespace ddp
