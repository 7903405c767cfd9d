// ddprun's small value parsers: flag and PET_* values to numbers, lists and durations. Every
// error is a UsageError naming where the value came from (`source`: "--nnodes" or
// "PET_NNODES"), the value and what was expected. Internal to ddprun (args.cpp, flags.cpp).
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "args.h"

namespace ddp::launcher {

[[noreturn]] void bad_value(const std::string& source, const std::string& value,
                            const std::string& why);
int parse_int(const std::string& source, const std::string& value, long long lo, long long hi,
              const std::string& expected);
// Seconds as a decimal number; `allow_zero` for the grace period.
Seconds parse_seconds(const std::string& source, const std::string& value, bool allow_zero);
bool parse_bool(const std::string& source, const std::string& value);
std::vector<std::string> split(const std::string& text, char sep);
bool ends_with(const std::string& s, const std::string& suffix);
// --nproc-per-node: N, or what the host has.
int parse_nproc(const std::string& source, const std::string& value, const HostInfo& host);
// --nnodes: N or MIN:MAX with MIN == MAX.
// --nnodes: N (min = max = N) or MIN:MAX (an elastic range, 1 <= MIN <= MAX).
struct NodeRange {
  int min = 1;
  int max = 1;
};
NodeRange parse_nnodes(const std::string& source, const std::string& value);
// --rdzv-conf k=v,k2=v2
std::map<std::string, std::string> parse_rdzv_conf(const std::string& source,
                                                   const std::string& value);
// --local-ranks-filter 0,1
std::set<int> parse_rank_list(const std::string& source, const std::string& value, int nproc);

}  // namespace ddp::launcher
