// Forming a group over a TCPStore with ranks as threads: every way of getting it wrong fails on
// every rank, in bounded time, with a message that names what was wrong.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include "ddp/config.h"  // DDP_WITH_NCCL
#include "ddp/error.h"
#include "ddp/process_group.h"
#include "support/ranks.h"
#include "support/store_peers.h"  // SilentListener

namespace ddp {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using testing::message_of;

InitOptions quick(int rank, int world, int port, std::chrono::milliseconds rdzv = 1s) {
  auto o = testing::thread_rank(rank, world, port);
  o.rendezvous_timeout = rdzv;
  return o;
}

void expect_contains(const std::string& message, std::initializer_list<std::string> needles) {
  for (const auto& n : needles) {
    EXPECT_NE(message.find(n), std::string::npos) << "'" << n << "' not in: " << message;
  }
}

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

TEST(Rendezvous, AllRanksJoin) {
  testing::run_ranks(3, [](ProcessGroup& pg) {
    EXPECT_EQ(pg.size(), 3);
    EXPECT_EQ(pg.backend(), testing::test_backend());
  });
}

TEST(Rendezvous, MissingRankIsNamedOnEveryRankWithinTheTimeout) {
  const int port = testing::free_port();
  const auto start = Clock::now();
  // Ranks 0 and 2 of 3 start; rank 1 never does.
  const std::vector<int> started = {0, 2};
  // 3 s: connecting alone can take a second on a loaded 2-core machine (CI runs tests while
  // other work competes), and both present ranks must have joined before the timeout.
  auto errors =
      testing::run_threads(2, [&](int i) { make_process_group(quick(started[i], 3, port, 3s)); });
  const double took = seconds_since(start);
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(errors[i]) << "rank " << started[i] << " formed a group with a rank missing";
    EXPECT_THROW(std::rethrow_exception(errors[i]), RendezvousError);
    expect_contains(message_of(errors[i]), {"2/3 ranks joined", "missing ranks: 1", "3.0 s"});
  }
  EXPECT_LT(took, 10.0);
}

TEST(Rendezvous, UnreachableStoreNamesTheEndpoint) {
  const int port = testing::free_port();  // nobody listens there
  const auto start = Clock::now();
  try {
    make_process_group(quick(1, 2, port, 1s));
    FAIL() << "joined a group without rank 0";
  } catch (const RendezvousError& e) {
    expect_contains(e.what(), {"[rank 1]", fmt::format("127.0.0.1:{}", port), "MASTER_ADDR",
                               "Missing ranks: 0"});
  }
  EXPECT_LT(seconds_since(start), 5.0);
}

// A port that accepts connections and never answers: the store's host is stopped (SIGSTOP) or
// frozen, or MASTER_PORT belongs to another program. LibTorch 1.13's TCPStore blocked forever
// there; the rendezvous ends within its timeout, naming the endpoint and what did not answer.
TEST(Rendezvous, SilentEndpointIsABoundedErrorNamingIt) {
  testing::SilentListener silent;
  const auto start = Clock::now();
  try {
    make_process_group(quick(1, 2, silent.port(), 2s));
    FAIL() << "joined a group through a port that never answers";
  } catch (const RendezvousError& e) {
    expect_contains(e.what(), {"[rank 1]", fmt::format("127.0.0.1:{}", silent.port()),
                               "accepted the connection but did not answer", "SIGSTOP"});
  }
  EXPECT_LT(seconds_since(start), 6.0);
}

TEST(Rendezvous, PortInUseIsAClearError) {
  // Someone else listens on the port rank 0 wants for its store.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  try {
    make_process_group(quick(0, 2, port, 2s));
    FAIL() << "hosted a store on a busy port";
  } catch (const RendezvousError& e) {
    expect_contains(e.what(), {"[rank 0]", std::to_string(port), "already in use", "--master-port",
                               "--standalone"});
  }
  close(fd);
}

TEST(Rendezvous, DuplicateRankFailsEveryRank) {
  const int port = testing::free_port();
  const std::vector<int> ranks = {0, 1, 1};  // WORLD_SIZE 3 but rank 2 is missing, 1 doubled
  const auto start = Clock::now();
  auto errors =
      testing::run_threads(3, [&](int i) { make_process_group(quick(ranks[i], 3, port, 5s)); });
  for (int i = 0; i < 3; ++i) {
    ASSERT_TRUE(errors[i]) << "thread " << i << " formed a group";
    expect_contains(message_of(errors[i]), {"duplicate RANK", "RANK=1"});
  }
  EXPECT_LT(seconds_since(start), 4.0);  // the abort is seen well before the 5 s timeout
}

TEST(Rendezvous, WorldSizeMismatchFailsEveryRank) {
  const int port = testing::free_port();
  const auto start = Clock::now();
  auto errors = testing::run_threads(2, [&](int r) {
    make_process_group(quick(r, r == 0 ? 2 : 3, port, 5s));
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(errors[r]) << "rank " << r << " formed a group";
    expect_contains(message_of(errors[r]), {"WORLD_SIZE differs between ranks"});
  }
  EXPECT_LT(seconds_since(start), 4.0);
}

TEST(Rendezvous, OptionErrors) {
  InitOptions o;
  o.rank = 0;
  EXPECT_THROW(make_process_group(o), ConfigError);
  o.world_size = 1;
  o.backend = "mpi";
  try {
    make_process_group(o);
    FAIL();
  } catch (const ConfigError& e) {
    expect_contains(e.what(), {"unknown backend 'mpi'", "gloo"});
  }
#if !DDP_WITH_NCCL
  o.backend = "nccl";
  try {
    make_process_group(o);
    FAIL();
  } catch (const ConfigError& e) {
    expect_contains(e.what(), {"nccl", "CPU-only", "gloo"});
  }
#else
  if (!torch::cuda::is_available()) {  // a CUDA build without a GPU: the rank has no device
    o.backend = "nccl";
    try {
      make_process_group(o);
      FAIL();
    } catch (const ConfigError& e) {
      expect_contains(e.what(), {"[rank 0] the nccl backend needs a GPU, but 0 CUDA devices "
                                 "are visible",
                                 "gloo"});
    }
  }
#endif
  o.backend = "gloo";
  o.rank = 2;
  o.world_size = 2;
  EXPECT_THROW(make_process_group(o), ConfigError);
}

TEST(Rendezvous, TimeoutsComeFromTheEnvironmentWhenNotSet) {
  setenv("DDP_COLLECTIVE_TIMEOUT", "7.5", 1);
  InitOptions o;
  o.rank = 0;
  o.world_size = 1;
  EXPECT_EQ(make_process_group(o)->timeout(), 7500ms);
  o.timeout = 3s;  // explicit options win
  EXPECT_EQ(make_process_group(o)->timeout(), 3000ms);
  unsetenv("DDP_COLLECTIVE_TIMEOUT");
  o.timeout.reset();
  EXPECT_EQ(make_process_group(o)->timeout(), kDefaultCollectiveTimeout);
}

}  // namespace
}  // namespace ddp
