// ddprun's small value parsers: flag and PET_* values to numbers, lists, durations, endpoints
// and --redirects specs. Every error is a UsageError naming where the value came from
// (`source`: "--nnodes" or "PET_NNODES"), the value and what was expected. Used by args.cpp
// and flags.cpp; the types they produce are launch_config.h's, so this depends on neither.
#pragma once

#include <map>
#include <set>
#include <string>
#include <vector>

#include "launch_config.h"  // UsageError, Seconds, StdSpec, kDefaultRdzvPort

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

// "--redirects 0:1,1:2" and friends; `flag` names the flag in errors. Throws UsageError.
StdSpec parse_std_spec(const std::string& flag, const std::string& value);

// host[:port] or [v6addr][:port]; port defaults to kDefaultRdzvPort. Throws UsageError.
struct Endpoint {
  std::string host;
  int port = kDefaultRdzvPort;
};
Endpoint parse_endpoint(const std::string& flag, const std::string& value);

}  // namespace ddp::launcher
