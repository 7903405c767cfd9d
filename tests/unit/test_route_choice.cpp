// Note [Choosing the all_reduce route] (src/process_group/route_choice.h): from the measured
// times to the size from which flat Gloo takes an all_reduce.
#include <gtest/gtest.h>

#include "process_group/route_choice.h"
#include "process_group/transport/transport.h"

namespace ddp {
namespace {

constexpr uint64_t KiB = 1024, MiB = 1024 * 1024;

std::vector<RouteSample> samples(std::vector<std::pair<double, double>> ms) {
  const uint64_t sizes[] = {256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB};
  std::vector<RouteSample> out;
  for (size_t i = 0; i < ms.size(); ++i) out.push_back({sizes[i], ms[i].first, ms[i].second});
  return out;
}

TEST(RouteChoice, FlatFromTheSizeAfterWhichItWinsEverywhere) {
  // The emulated 10 Gbit/s link (4 ranks on 2 cores): the hierarchy wins small, loses large.
  EXPECT_EQ(flat_route_from(samples({{0.4, 0.6}, {1.8, 1.9}, {6.5, 4.6}, {27, 18}})), 2 * MiB);
  // The 1 Gbit/s link: the hierarchy sends each host's data once; it wins everywhere.
  EXPECT_EQ(flat_route_from(samples({{2.1, 3.0}, {8.5, 10.1}, {34, 45}})), RouteTuning::kNever);
  // Flat everywhere: from the smallest size measured (below it nothing says flat is faster).
  EXPECT_EQ(flat_route_from(samples({{3, 2}, {9, 6}, {30, 20}, {120, 80}})), 256 * KiB);
  // A win at one size that larger ones do not confirm is noise: only the run to the end counts.
  EXPECT_EQ(flat_route_from(samples({{1, 1.2}, {4, 3}, {12, 14}, {50, 40}})), 8 * MiB);
  // Measurement stopped early (a slow link): the largest size measured decides above it.
  EXPECT_EQ(flat_route_from(samples({{1, 1.2}, {40, 30}})), 512 * KiB);
  EXPECT_EQ(flat_route_from({}), RouteTuning::kNever);
}

TEST(RouteChoice, FlatMustWinByTheMargin) {
  // 3% faster is within the noise: the hierarchy (less traffic between hosts) keeps it.
  EXPECT_EQ(flat_route_from(samples({{1, 2}, {4, 4.5}, {10, 9.7}, {40, 38.8}})),
            RouteTuning::kNever);
  EXPECT_EQ(flat_route_from(samples({{1, 2}, {4, 4.5}, {10, 9.7}, {40, 37.9}})), 8 * MiB);
}

TEST(RouteChoice, TheNoteNamesEverySizeAndTheChoice) {
  const auto s = samples({{0.4, 0.6}, {1.8, 1.9}, {6.5, 4.6}, {27, 18}});
  EXPECT_EQ(describe_routes(s, flat_route_from(s)),
            "all_reduce milliseconds, hierarchy/flat gloo: 256 KiB 0.40/0.60, 1 MiB 1.80/1.90, "
            "4 MiB 6.50/4.60, 16 MiB 27.00/18.00; all_reduces of 2 MiB and more over flat gloo");
  EXPECT_EQ(describe_routes(samples({{1, 2}}), RouteTuning::kNever),
            "all_reduce milliseconds, hierarchy/flat gloo: 256 KiB 1.00/2.00; every all_reduce "
            "through the hierarchy");
}

}  // namespace
}  // namespace ddp
