// /proc/<pid>/stat: the parser on command names that contain spaces and ')', and a pid whose
// start time differs (a reused pid) taken for gone. Torch-free.
#include <sys/wait.h>  // waitpid
#include <unistd.h>    // fork, getpid

#include <cstdint>
#include <optional>
#include <string>

#include <gtest/gtest.h>

#include "base/proc_stat.h"

namespace ddp {
namespace {

// A real line (fields 1-22 and more), with `comm` as the command name.
std::string stat_line(const std::string& comm, char state, uint64_t start_time) {
  return std::to_string(4242) + " (" + comm + ") " + state +
         " 1 4242 4242 0 -1 4194560 120 0 0 0 3 1 0 0 20 0 1 0 " + std::to_string(start_time) +
         " 5083136 256 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 3 0 0 0 0 0\n";
}

TEST(ProcStat, ParsesStateAndStartTime) {
  const auto stat = parse_proc_stat(stat_line("ddp-train", 'S', 123456));
  ASSERT_TRUE(stat);
  EXPECT_EQ(stat->state, 'S');
  EXPECT_EQ(stat->start_time, 123456u);
  EXPECT_FALSE(stat->stopped());
  EXPECT_FALSE(stat->dead());
}

TEST(ProcStat, CommandNamesWithSpacesAndParenthesesAreSkipped) {
  for (const std::string comm : {"a b", "x) T 1 2 3", ") (", "((", "x)", " ) Z ) "}) {
    const auto stat = parse_proc_stat(stat_line(comm, 't', 77));
    ASSERT_TRUE(stat) << comm;
    EXPECT_EQ(stat->state, 't') << comm;
    EXPECT_EQ(stat->start_time, 77u) << comm;
    EXPECT_TRUE(stat->stopped()) << comm;
  }
}

TEST(ProcStat, MalformedLinesAreRefused) {
  EXPECT_FALSE(parse_proc_stat(""));
  EXPECT_FALSE(parse_proc_stat("4242 (no closing parenthesis S 1"));
  EXPECT_FALSE(parse_proc_stat("4242 (short) S 1 2 3"));
  EXPECT_FALSE(parse_proc_stat("4242 (bad) S 1 4242 4242 0 -1 4 1 0 0 0 3 1 0 0 20 0 1 0 12x 5"));
}

TEST(ProcStat, ThisProcessIsAliveUnderItsOwnStartTimeOnly) {
  const int me = static_cast<int>(getpid());
  const uint64_t start = own_start_time();
  ASSERT_NE(start, 0u);
  ASSERT_TRUE(read_proc_stat(me));
  EXPECT_EQ(read_proc_stat(me)->start_time, start);
  EXPECT_TRUE(live_process(me, start));
  EXPECT_TRUE(live_process(me, 0));  // start time unknown: any
  EXPECT_FALSE(live_process(me, start + 1)) << "a reused pid is another process";
}

TEST(ProcStat, ExitedAndZombieProcessesAreGone) {
  const pid_t child = fork();
  if (child == 0) _exit(0);
  // A zombie until reaped.
  std::optional<ProcStat> stat = read_proc_stat(child);
  for (int i = 0; i < 1000 && !(stat && stat->dead()); ++i) {
    usleep(1000);
    stat = read_proc_stat(child);
  }
  ASSERT_TRUE(stat && stat->dead());
  EXPECT_FALSE(live_process(child, 0));
  waitpid(child, nullptr, 0);
  EXPECT_FALSE(read_proc_stat(child));
  EXPECT_FALSE(live_process(child, 0));
  EXPECT_FALSE(read_proc_stat(0));
  EXPECT_FALSE(read_proc_stat(-1));
}

}  // namespace
}  // namespace ddp
