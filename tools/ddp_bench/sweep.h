// ddp-bench's pure arithmetic: sizes, sweeps, bandwidths, medians, lists. No tensors, no
// communication: tested alone (tests/unit/test_bench_parts.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::bench {

// "8", "64K", "4M", "256M", "1G" (also "KiB"/"KB"/"B" spellings): binary multiples, as
// nccl-tests reads -b/-e. Throws ddp::ConfigError naming `flag` for anything else.
int64_t parse_bytes(const std::string& flag, const std::string& text);
// 8 -> "8 B", 65536 -> "64 KiB", 268435456 -> "256 MiB"; exact multiples only, else bytes.
std::string format_bytes(int64_t bytes);

// min, 2 min, 4 min, ... up to and including max (nccl-tests' -f 2). Throws ConfigError unless
// 0 < min <= max.
std::vector<int64_t> doubling_sizes(int64_t min_bytes, int64_t max_bytes);

// "a,b,,c" -> {"a", "b", "c"}: empty items dropped, spaces trimmed.
std::vector<std::string> split_list(const std::string& text);

// The collectives ddp-bench measures, by their ProcessGroup names.
inline const std::vector<std::string>& all_ops() {
  static const std::vector<std::string> ops = {"all_reduce", "broadcast", "all_gather",
                                               "reduce_scatter"};
  return ops;
}

// nccl-tests' bus bandwidth factor (doc/PERFORMANCE.md): busbw = algbw * factor, the rate each
// rank's link must sustain, comparable across world sizes and with the hardware's peak.
//   all_reduce 2(n-1)/n; all_gather, reduce_scatter (n-1)/n; broadcast 1.
// Throws ConfigError for an unknown op.
double bus_factor(const std::string& op, int world_size);

// Elements of `elem_bytes` each that a `bytes`-sized test of `op` moves, as nccl-tests sizes
// them: `bytes` is the whole buffer (all_gather: the output, reduce_scatter: the input), so
// all_gather/reduce_scatter round the element count down to a multiple of the world size.
// 0 when the size is too small for one element per rank.
int64_t elements_for(const std::string& op, int64_t bytes, int64_t elem_bytes, int world_size);

// Median of `values` (the upper one of the two middles for an even count). 0 for none.
double median(std::vector<double> values);

// The buffer ring (Note [Buffer ring] in collectives.cpp): how many slots of `slot_bytes` make
// at least `ring_bytes`, at least 1.
int64_t ring_slots(int64_t slot_bytes, int64_t ring_bytes);

}  // namespace ddp::bench
