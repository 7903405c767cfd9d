// Note [Choosing the all_reduce route] (route_choice.h).
#include "process_group/route_choice.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "ddp/process_group.h"
#include "process_group/transport/transport.h"

namespace ddp {
namespace {

constexpr uint64_t kSizes[] = {uint64_t{256} << 10, uint64_t{1} << 20, uint64_t{4} << 20,
                               uint64_t{16} << 20};
constexpr int kTimedRounds = 3;

std::string size_text(uint64_t bytes) {
  if (bytes >= (uint64_t{1} << 20) && bytes % (uint64_t{1} << 20) == 0) {
    return fmt::format("{} MiB", bytes >> 20);
  }
  if (bytes >= (uint64_t{1} << 10) && bytes % (uint64_t{1} << 10) == 0) {
    return fmt::format("{} KiB", bytes >> 10);
  }
  return fmt::format("{} B", bytes);
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Milliseconds of one blocking all_reduce of `t` on this rank.
double time_all_reduce(ProcessGroup& pg, at::Tensor& t) {
  const auto start = std::chrono::steady_clock::now();
  pg.all_reduce(t).wait();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

uint64_t flat_route_from(const std::vector<RouteSample>& samples) {
  // The first index from which flat wins at every measured size.
  size_t first = samples.size();
  while (first > 0 && samples[first - 1].flat_ms < (1 - kRouteMargin) *
                                                       samples[first - 1].hierarchy_ms) {
    --first;
  }
  if (first == samples.size()) return RouteTuning::kNever;
  if (first == 0) return samples[0].bytes;
  const double mid = std::sqrt(static_cast<double>(samples[first - 1].bytes) *
                               static_cast<double>(samples[first].bytes));
  return static_cast<uint64_t>(mid);
}

std::string describe_routes(const std::vector<RouteSample>& samples, uint64_t from) {
  std::string out = "all_reduce milliseconds, hierarchy/flat gloo:";
  for (size_t i = 0; i < samples.size(); ++i) {
    const RouteSample& s = samples[i];
    out += fmt::format("{} {} {:.2f}/{:.2f}", i == 0 ? "" : ",", size_text(s.bytes),
                       s.hierarchy_ms, s.flat_ms);
  }
  out += from == RouteTuning::kNever
             ? "; every all_reduce through the hierarchy"
             : fmt::format("; all_reduces of {} and more over flat gloo", size_text(from));
  return out;
}

std::vector<RouteSample> measure_routes(ProcessGroup& pg, RouteTuning& routes) {
  struct Unforce {  // however the measurement ends
    RouteTuning& r;
    ~Unforce() { r.force_route(std::nullopt); }
  } unforce{routes};
  std::vector<RouteSample> samples;
  for (const uint64_t bytes : kSizes) {
    at::Tensor t = at::zeros({static_cast<int64_t>(bytes / sizeof(float))}, at::kFloat);
    std::vector<double> hierarchy, flat;
    for (int round = 0; round <= kTimedRounds; ++round) {
      for (int k = 0; k < 2; ++k) {
        const bool take_flat = (round + k) % 2 == 1;  // the order alternates between rounds
        routes.force_route(take_flat);
        const double ms = time_all_reduce(pg, t);
        if (round > 0) (take_flat ? flat : hierarchy).push_back(ms);
      }
    }
    // The slowest rank's medians: every rank decides from the same numbers.
    routes.force_route(false);
    at::Tensor agreed = at::tensor({median(hierarchy), median(flat)}, at::kDouble);
    pg.all_reduce(agreed, ReduceOp::kMax).wait();
    samples.push_back({bytes, agreed[0].item<double>(), agreed[1].item<double>()});
    if (std::max(samples.back().hierarchy_ms, samples.back().flat_ms) > kRouteSizeLimitMs) break;
  }
  return samples;
}

}  // namespace ddp
