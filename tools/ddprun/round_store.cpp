// The round store (see Note [Round store keys] in round_store.h).
#include "round_store.h"

#include <charconv>
#include <sstream>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "ddp/error.h"

namespace ddp::launcher {
namespace {

// A member entry is written right after its node counts itself in: a read waits this much past
// the server's own wait for it, so that a slow entry and a silent server are told apart.
constexpr std::chrono::milliseconds kEntrySlack{100};

}  // namespace

std::string RoundEntry::format() const {
  return fmt::format("{} {} {} {} {} {}", id, host, addr, last_round, last_rank,
                     last_members.empty() ? "-" : fmt::format("{}", fmt::join(last_members, ",")));
}

RoundEntry RoundEntry::parse(const std::string& text, int arrival) {
  RoundEntry e;
  e.arrival = arrival;
  std::istringstream in(text);
  std::string members;
  if (!(in >> e.id >> e.host >> e.addr >> e.last_round >> e.last_rank)) {
    return RoundEntry{.id = "?", .host = "?", .addr = "-", .arrival = arrival};
  }
  // Without the last round's nodes (a ddprun of another version): none, which Note [Never two
  // groups] takes for a conflict when that round is the newest.
  if (in >> members && members != "-") {
    std::istringstream list(members);
    for (std::string id; std::getline(list, id, ',');) e.last_members.push_back(id);
  }
  return e;
}

int parse_count(const std::string& text, const char* what) {
  int value = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc() || end != text.data() + text.size() || value < 0) {
    throw Error(
        fmt::format("the agent store's {} is '{}', not a number: another program wrote "
                    "to this job's keys",
                    what, text));
  }
  return value;
}

RoundStore::RoundStore(const std::string& run_id, const store::ClientOptions& options)
    : RoundStore(run_id, agent_store_key_value(options)) {}

RoundStore::RoundStore(const std::string& run_id, std::unique_ptr<KeyValue> kv)
    : prefix_(fmt::format("ddprun/{}/", run_id)), kv_(std::move(kv)) {}

void RoundStore::connect(const store::ClientOptions& options) {
  kv_ = agent_store_key_value(options);
  entries_.clear();  // another store's: its round R is not this one's (a store moved back home)
}

std::string RoundStore::job_key(std::string_view what) const {
  return fmt::format("{}{}", prefix_, what);
}

std::string RoundStore::key(int round, std::string_view what) const {
  return fmt::format("{}{}/{}", prefix_, round, what);
}

std::optional<std::string> RoundStore::get_if_set(const std::string& k, Deadline deadline) {
  if (!kv_->check(k, deadline)) return std::nullopt;
  return kv_->get(k, std::chrono::milliseconds(0), deadline);
}

// --- the job

int RoundStore::raise_round(int next, Deadline deadline) {
  const std::string k = job_key("round");
  int round = parse_count(kv_->compare_set(k, "", "0", deadline), "round");
  while (round < next) {
    round = parse_count(kv_->compare_set(k, std::to_string(round), std::to_string(next), deadline),
                        "round");
  }
  return round;
}

std::optional<int> RoundStore::round(Deadline deadline) {
  std::optional<std::string> text = get_if_set(job_key("round"), deadline);
  if (!text) return std::nullopt;
  return parse_count(*text, "round");
}

namespace {

std::string format_round(const KnownRound& k) {
  return fmt::format("{} {}", k.round, fmt::join(k.members, ","));
}

KnownRound parse_round(const std::string& text) {
  KnownRound k;
  std::istringstream in(text);
  std::string round, members;
  in >> round >> members;
  k.round = parse_count(round, "last round");
  std::istringstream list(members);
  for (std::string id; std::getline(list, id, ',');) k.members.push_back(id);
  return k;
}

}  // namespace

void RoundStore::record_round(const KnownRound& known, Deadline deadline) {
  const std::string k = job_key("last_round");
  const std::string mine = format_round(known);
  std::string now = kv_->compare_set(k, "", mine, deadline);
  while (now != mine) {
    const KnownRound there = parse_round(now);
    if (there.round >= known.round) return;
    now = kv_->compare_set(k, now, mine, deadline);
  }
}

KnownRound RoundStore::last_round(Deadline deadline) {
  std::optional<std::string> text = get_if_set(job_key("last_round"), deadline);
  return text ? parse_round(*text) : KnownRound{};
}

std::string RoundStore::claim_shape(const std::string& shape, Deadline deadline) {
  return kv_->compare_set(job_key("shape"), "", shape, deadline);
}

std::string RoundStore::claim_lineage(const std::string& lineage, Deadline deadline) {
  return kv_->compare_set(job_key("lineage"), "", lineage, deadline);
}

void RoundStore::beat(const std::string& id, Deadline deadline) {
  kv_->beat(job_key("alive/" + id), deadline);
}

int64_t RoundStore::beats(const std::string& id, Deadline deadline) {
  return kv_->count_beats(job_key("alive/" + id), deadline);
}

int RoundStore::failures(Deadline deadline) {
  std::optional<std::string> text = get_if_set(job_key("failures"), deadline);
  return text ? parse_count(*text, "failure count") : 0;
}

int RoundStore::count_failure(Deadline deadline) {
  return static_cast<int>(kv_->add(job_key("failures"), 1, deadline));
}

void RoundStore::carry_failures(int count, Deadline deadline) {
  const std::string k = job_key("failures");
  std::string now = kv_->compare_set(k, "", std::to_string(count), deadline);
  while (parse_count(now, "failure count") < count) {
    now = kv_->compare_set(k, now, std::to_string(count), deadline);
  }
}

// --- entering and closing a round

int64_t RoundStore::claim_rank(int round, int rank, Deadline deadline) {
  return kv_->add(key(round, fmt::format("node/{}", rank)), 1, deadline);
}

bool RoundStore::rank_claimed(int round, int rank, Deadline deadline) {
  return kv_->check(key(round, fmt::format("node/{}", rank)), deadline);
}

int RoundStore::count_in(int round, Deadline deadline) {
  return static_cast<int>(kv_->add(key(round, "count"), 1, deadline)) - 1;
}

int RoundStore::arrivals(int round, Deadline deadline) {
  return static_cast<int>(kv_->add(key(round, "count"), 0, deadline));
}

void RoundStore::write_entry(int round, int index, const RoundEntry& entry, Deadline deadline) {
  kv_->set(key(round, fmt::format("member/{}", index)), entry.format(), deadline);
}

std::vector<RoundEntry> RoundStore::entries(int round, int n, std::chrono::milliseconds wait) {
  std::vector<RoundEntry> out;
  for (int i = 0; i < n; ++i) {
    if (auto it = entries_.find({round, i}); it != entries_.end()) {
      out.push_back(it->second);
      continue;
    }
    std::string text;
    try {
      text = kv_->get(key(round, fmt::format("member/{}", i)), wait,
                      Clock::now() + wait + kEntrySlack);
    } catch (const RendezvousError&) {
      text.clear();  // it died in between: an unknown node
    }
    RoundEntry e = RoundEntry::parse(text, i);
    if (e.id != "?") entries_.emplace(std::make_pair(round, i), e);
    out.push_back(std::move(e));
  }
  return out;
}

std::optional<int> RoundStore::closed(int round, Deadline deadline) {
  std::optional<std::string> text = get_if_set(key(round, "closed"), deadline);
  if (!text) return std::nullopt;
  return parse_count(*text, "closed count");
}

int RoundStore::close(int round, int admitted, Deadline deadline) {
  return parse_count(kv_->compare_set(key(round, "closed"), "", std::to_string(admitted), deadline),
                     "closed count");
}

// --- how a round ends

std::optional<std::string> RoundStore::failure(int round, Deadline deadline) {
  return get_if_set(key(round, "failed"), deadline);
}

bool RoundStore::failed(int round, Deadline deadline) {
  return kv_->check(key(round, "failed"), deadline);
}

std::optional<std::string> RoundStore::write_first_failure(int round, const std::string& line,
                                                           bool final, Deadline deadline) {
  const std::string failed = key(round, "failed");
  if (final && !kv_->check(failed, deadline)) {
    kv_->compare_set(key(round, "final"), "", line, deadline);
  }
  std::string first = kv_->compare_set(failed, "", line, deadline);
  if (first != line) return first;
  return std::nullopt;
}

std::optional<std::string> RoundStore::final_failure(int round, Deadline deadline) {
  return get_if_set(key(round, "final"), deadline);
}

bool RoundStore::failure_is_final(int round, Deadline deadline) {
  try {
    return kv_->check(key(round, "final"), deadline);
  } catch (const Error&) {
    return false;
  }
}

std::optional<std::string> RoundStore::finished(int round, Deadline deadline) {
  return get_if_set(key(round, "finished"), deadline);
}

void RoundStore::finish(int round, const std::string& who, Deadline deadline) {
  kv_->compare_set(key(round, "finished"), "", who, deadline);
}

void RoundStore::end(int round, Deadline deadline) { kv_->add(key(round, "ended"), 1, deadline); }

int RoundStore::ended(int round, Deadline deadline) {
  return static_cast<int>(kv_->add(key(round, "ended"), 0, deadline));
}

std::optional<std::string> RoundStore::regroup(int round, Deadline deadline) {
  return get_if_set(key(round, "regroup"), deadline);
}

std::string RoundStore::write_regroup(int round, const std::string& why, Deadline deadline) {
  return kv_->compare_set(key(round, "regroup"), "", why, deadline);
}

bool RoundStore::said_over(int round, Deadline deadline) {
  for (const char* what : {"failed", "regroup", "finished"}) {
    if (kv_->check(key(round, what), deadline)) return true;
  }
  return false;
}

void RoundStore::saw_regroup(int round, Deadline deadline) {
  kv_->add(key(round, "regroup_seen"), 1, deadline);
}

int RoundStore::regroup_readers(int round, Deadline deadline) {
  return static_cast<int>(kv_->add(key(round, "regroup_seen"), 0, deadline));
}

void RoundStore::leave(int round, const std::string& id, Deadline deadline) {
  kv_->set(key(round, "left/" + id), "1", deadline);
}

bool RoundStore::left(int round, const std::string& id, Deadline deadline) {
  return kv_->check(key(round, "left/" + id), deadline);
}

void RoundStore::send_store_home(int round, Deadline deadline) {
  kv_->compare_set(key(round, "store_home"), "", "1", deadline);
}

bool RoundStore::store_goes_home(int round, Deadline deadline) {
  return kv_->check(key(round, "store_home"), deadline);
}

void RoundStore::send_store_away(int round, Deadline deadline) {
  kv_->compare_set(key(round, "store_away"), "", "1", deadline);
}

bool RoundStore::store_goes_away(int round, Deadline deadline) {
  return kv_->check(key(round, "store_away"), deadline);
}

// --- etcd: the workers' store

void RoundStore::set_workers_store(int round, const std::string& address, int port,
                                   Deadline deadline) {
  kv_->set(key(round, "workers_store"), fmt::format("{} {}", address, port), deadline);
}

std::pair<std::string, int> RoundStore::workers_store(int round, std::chrono::milliseconds wait) {
  const std::string text =
      kv_->get(key(round, "workers_store"), wait, Clock::now() + wait + kEntrySlack);
  std::istringstream in(text);
  std::string address, port;
  if (!(in >> address >> port)) {
    throw Error(
        fmt::format("the round store's workers' store of round {} is '{}', not "
                    "'<address> <port>': another program wrote to this job's keys",
                    round, text));
  }
  return {address, parse_count(port, "workers' store port")};
}

}  // namespace ddp::launcher
