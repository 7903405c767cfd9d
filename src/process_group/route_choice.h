// Which way a hierarchical group all-reduces, by size, chosen by measuring both ways.
//
// Note [Choosing the all_reduce route]
// The hierarchy (shm inside each host, Gloo rails between hosts: Note [Hierarchical
// collectives]) sends each host's data over the network once instead of a flat ring's 1.5 or
// more times, so it wins wherever the links limit. Where they do not, its shared-memory phases
// are extra work for the cores: on the emulated network (benchmarks/emulated_network.sh, 4
// ranks on 2 cores) at 10 Gbit/s its all-reduce of 4-16 MiB cost 1.2-1.9x flat Gloo's, and the
// MLP trained at 0.94x on one day (0.99-1.03x on others), while at 1 Gbit/s it cost 0.7-0.9x.
// Backend "tuned" measures instead of assuming: when it forms the hierarchy, all_reduces of
// float32 zeros at 256 KiB, 1, 4 and 16 MiB, through the hierarchy and over flat Gloo (both are
// formed anyway: flat Gloo carries DDP_DEBUG=detail's checks), one untimed round then three
// timed, the two routes alternating; each rank's median, then the slowest rank's (an all-reduce
// of the medians, MAX), so that every rank decides from the same numbers. It stops growing once
// an all-reduce takes more than kRouteSizeLimitMs (bounded start-up on slow links: about 0.6 s
// at 1 Gbit/s). Flat Gloo then takes every all_reduce from the smallest measured size at which
// it was faster by kRouteMargin and stayed so at every larger one (from the midpoint, in log
// scale, between that size and the one before): the sizes of DDP's buckets, where a ring's
// bandwidth is what counts; the small ones stay on the hierarchy, whose fewer hops win there.
// Flat Gloo takes float32 and float64 only (what was measured, and what it sums natively on
// every LibTorch); other dtypes, and every other collective, keep the hierarchy.
// Why not the default ("auto" takes the hierarchy for every all_reduce): the two routes sum in
// different orders, and a timed choice can differ between two runs of one job (near the
// crossover it did, from run to run), so the weights could differ in their last bits between
// runs, and a job resumed from a checkpoint would not end bit for bit as the uninterrupted one:
// the exact resume that checkpoints promise (test_multinode's killed host caught it). As with
// cuDNN's benchmark mode, speed from a timed choice is the user's to ask for.
// The measurement's collectives are the group's first (numbered, flight-recorded: a user's first
// collective follows them); backend "shm+gloo" asks for the hierarchy without measuring;
// DDP_DEBUG=info prints the table and the choice on rank 0.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp {

class ProcessGroup;
class RouteTuning;

// One measured size: the slowest rank's median milliseconds of each route.
struct RouteSample {
  uint64_t bytes = 0;
  double hierarchy_ms = 0;
  double flat_ms = 0;
};

inline constexpr double kRouteMargin = 0.05;     // flat must be this much faster to be taken
inline constexpr double kRouteSizeLimitMs = 30;  // no larger size once a route took longer

// From which size flat Gloo takes an all_reduce (RouteTuning::kNever: never), given `samples` in
// ascending size. Pure.
uint64_t flat_route_from(const std::vector<RouteSample>& samples);

// "256 KiB 0.41/0.52 ms, 1 MiB ..., so flat gloo from 2 MiB" (hierarchy/flat): for notes.
std::string describe_routes(const std::vector<RouteSample>& samples, uint64_t from);

// Measures both routes of `pg`'s transport (`routes`: its tuning hook) as the Note says and
// returns the samples; leaves the routes unforced. Collective: every rank calls it.
std::vector<RouteSample> measure_routes(ProcessGroup& pg, RouteTuning& routes);

}  // namespace ddp
