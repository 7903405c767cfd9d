// ddprun's small value parsers (see values.h).
#include "values.h"

#include <fmt/format.h>

#include "base/parse.h"  // the number and switch readers the library's env contract uses

namespace ddp::launcher {

[[noreturn]] void bad_value(const std::string& source, const std::string& value,
                            const std::string& why) {
  throw UsageError(fmt::format("{}='{}': {}", source, value, why));
}

int parse_int(const std::string& source, const std::string& value, long long lo, long long hi,
              const std::string& expected) {
  auto v = parse::integer(value);
  if (!v || *v < lo || *v > hi) bad_value(source, value, "expected " + expected);
  return static_cast<int>(*v);
}

// Seconds as a decimal number; `allow_zero` for the grace period.
Seconds parse_seconds(const std::string& source, const std::string& value, bool allow_zero) {
  auto s = parse::seconds(value, allow_zero);
  if (!s) {
    bad_value(source, value,
              allow_zero ? "expected a number of seconds >= 0 (at most 1e9), e.g. 10 or 0.5"
                         : "expected a number of seconds > 0 (at most 1e9), e.g. 30 or 0.5");
  }
  return Seconds(*s);
}

bool parse_bool(const std::string& source, const std::string& value) {
  auto b = parse::boolean(value);
  if (!b) bad_value(source, value, "expected 1/0 or true/false");
  return *b;
}

std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> parts;
  std::string::size_type start = 0;
  while (true) {
    auto pos = text.find(sep, start);
    parts.push_back(text.substr(start, pos - start));
    if (pos == std::string::npos) return parts;
    start = pos + 1;
  }
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// --nnodes: N or MIN:MAX.
NodeRange parse_nnodes(const std::string& source, const std::string& value) {
  auto colon = value.find(':');
  if (colon == std::string::npos) {
    const int n = parse_int(source, value, 1, 1 << 20, "a number of nodes >= 1");
    return {n, n};
  }
  auto lo = parse::integer(value.substr(0, colon));
  auto hi = parse::integer(value.substr(colon + 1));
  if (!lo || !hi || *lo < 1 || *hi < 1 || *lo > (1 << 20) || *hi > (1 << 20)) {
    bad_value(source, value, "expected N or MIN:MAX with numbers >= 1");
  }
  if (*lo > *hi) {
    bad_value(source, value,
              fmt::format("MIN ({}) is above MAX ({}); expected MIN:MAX with MIN <= MAX", *lo, *hi));
  }
  return {static_cast<int>(*lo), static_cast<int>(*hi)};
}

// --rdzv-conf k=v,k2=v2
std::map<std::string, std::string> parse_rdzv_conf(const std::string& source,
                                                   const std::string& value) {
  std::map<std::string, std::string> conf;
  if (value.empty()) return conf;
  for (const std::string& item : split(value, ',')) {
    auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      bad_value(source, value, fmt::format("'{}' is not key=value; expected k=v,k2=v2", item));
    }
    conf[item.substr(0, eq)] = item.substr(eq + 1);
  }
  return conf;
}

// --local-ranks-filter 0,1
std::set<int> parse_rank_list(const std::string& source, const std::string& value, int nproc) {
  std::set<int> ranks;
  for (const std::string& item : split(value, ',')) {
    auto r = parse::integer(item);
    if (!r || *r < 0) {
      bad_value(source, value, "expected a comma-separated list of local ranks, e.g. 0,1");
    }
    if (*r >= nproc) {
      bad_value(source, value,
                fmt::format("there is no local rank {} with --nproc-per-node {}", *r, nproc));
    }
    ranks.insert(static_cast<int>(*r));
  }
  return ranks;
}

StdSpec parse_std_spec(const std::string& flag, const std::string& value) {
  const std::string expected =
      "expected 0-3 (1=stdout, 2=stderr, 3=both) for every rank, or LOCAL_RANK:0-3 pairs such "
      "as 0:1,1:2";
  StdSpec spec;
  if (value.find(':') == std::string::npos) {
    spec.all = static_cast<Std>(parse_int(flag, value, 0, 3, expected));
    return spec;
  }
  for (const std::string& item : split(value, ',')) {
    auto colon = item.find(':');
    if (colon == std::string::npos) bad_value(flag, value, expected);
    auto rank = parse::integer(item.substr(0, colon));
    auto streams = parse::integer(item.substr(colon + 1));
    if (!rank || *rank < 0 || *rank > (1 << 16) || !streams || *streams < 0 || *streams > 3) {
      bad_value(flag, value, expected);
    }
    spec.by_local_rank[static_cast<int>(*rank)] = static_cast<Std>(*streams);
  }
  return spec;
}

Endpoint parse_endpoint(const std::string& flag, const std::string& value) {
  Endpoint e;
  std::string port_text;
  bool has_port = false;
  if (!value.empty() && value.front() == '[') {  // [v6addr] or [v6addr]:port
    auto close = value.find(']');
    if (close == std::string::npos) bad_value(flag, value, "missing ']' after an IPv6 address");
    e.host = value.substr(1, close - 1);
    if (close + 1 < value.size()) {
      if (value[close + 1] != ':') bad_value(flag, value, "expected [ADDRESS]:PORT");
      port_text = value.substr(close + 2);
      has_port = true;
    }
  } else if (auto colon = value.rfind(':'); colon != std::string::npos) {
    if (value.find(':') != colon) {
      bad_value(flag, value, "an IPv6 address needs brackets: [ADDRESS]:PORT");
    }
    e.host = value.substr(0, colon);
    port_text = value.substr(colon + 1);
    has_port = true;
  } else {
    e.host = value;
  }
  if (e.host.empty()) bad_value(flag, value, "missing host; expected HOST[:PORT]");
  if (has_port) {
    auto port = parse::integer(port_text);
    if (!port || *port < 0 || *port > 65535) {
      bad_value(flag, value,
                fmt::format("'{}' is not a port number; expected HOST[:PORT] with PORT in [0, "
                            "65535]",
                            port_text));
    }
    e.port = static_cast<int>(*port);
  }
  return e;
}

}  // namespace ddp::launcher
