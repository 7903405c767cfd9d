// The job's rounds in etcd (Note [etcd backend] in etcd.h): the KeyValue over etcd's v3 API, and
// the lease that carries this node's sign of life.
#include "etcd.h"

#include <algorithm>
#include <fstream>
#include <thread>

#include <fmt/format.h>

#include "base/thread_annotations.h"  // Mutex, CondVar, GUARDED_BY
#include "etcd_client.h"
#include "values.h"  // parse_endpoint, split, bad_value

namespace ddp::launcher {
namespace {

using Clock = store::Clock;
using Deadline = Clock::time_point;
using nlohmann::json;
using std::chrono::milliseconds;
using namespace std::chrono_literals;

std::string quoted(const std::string& key) { return fmt::format("\"{}\"", key); }

// A range request for one key.
json range_of(const std::string& key) { return {{"key", base64_encode(key)}}; }

// The key's value and its revisions, from a range answer (or a transaction's response_range).
struct Found {
  bool present = false;
  std::string value;
  int64_t mod_revision = 0;
  int64_t version = 0;   // how many times it was written since it was created
  int64_t revision = 0;  // the store's revision when it was read
};

Found found_in(const json& answer, const std::string& key) {
  Found f;
  if (answer.contains("header")) f.revision = json_int(answer["header"], "revision");
  if (!answer.contains("kvs") || answer["kvs"].empty()) return f;
  const json& kv = answer["kvs"][0];
  f.present = true;
  f.value = base64_decode(kv.value("value", ""), quoted(key).c_str());
  f.mod_revision = json_int(kv, "mod_revision");
  f.version = json_int(kv, "version");
  return f;
}

// Keeps a lease alive from a thread of its own, every third of its ttl, with a client of its
// own (the rounds' calls never wait behind it). It says when the lease is gone (expired while
// etcd could not be reached); the next beat grants a new one.
class LeaseKeeper {
 public:
  LeaseKeeper(const EtcdOptions& options, int64_t id)
      : client_(options), ttl_(options.lease_ttl), id_(id), thread_([this] { run(); }) {}
  ~LeaseKeeper() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
      wake_.signal_all();
    }
    thread_.join();
    if (gone()) return;
    try {  // a clean exit: the node's sign of life vanishes now, not after the ttl
      client_.call("/v3/lease/revoke", {{"ID", std::to_string(id_)}}, "revoke(lease)",
                   Clock::now() + milliseconds(1000));
    } catch (const Error&) {
    }
  }
  int64_t id() const { return id_; }
  bool gone() const EXCLUDES(mu_) {
    MutexLock lock(&mu_);
    return gone_;
  }

 private:
  void run() EXCLUDES(mu_) {
    const auto period = std::chrono::duration_cast<milliseconds>(ttl_) / 3;
    while (true) {
      {
        MutexLock lock(&mu_);
        if (!stop_) wake_.wait_for(period);
        if (stop_) return;
      }
      bool alive = true;
      try {
        const json a = client_.call("/v3/lease/keepalive", {{"ID", std::to_string(id_)}},
                                    "keepalive(lease)", Clock::now() + period);
        alive = json_int(a.contains("result") ? a["result"] : a, "TTL") > 0;
      } catch (const EtcdLeaseGone&) {
        alive = false;
      } catch (const Error&) {
        // Not answered in time: asked again next period; past the ttl etcd says it is gone.
      }
      if (!alive) {
        MutexLock lock(&mu_);
        gone_ = true;
      }
    }
  }

  EtcdClient client_;
  const std::chrono::seconds ttl_;
  const int64_t id_;
  mutable Mutex mu_;
  CondVar wake_{&mu_};
  bool stop_ GUARDED_BY(mu_) = false;
  bool gone_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: started once the rest is ready
};

class Etcd final : public KeyValue {
 public:
  explicit Etcd(const EtcdOptions& options) : options_(options), client_(options) {}

  void set(const std::string& key, std::string_view value, Deadline deadline) override {
    put(key, value, 0, fmt::format("set({})", quoted(key)), deadline);
  }

  std::string get(const std::string& key, milliseconds wait, Deadline deadline) override {
    const std::string what = fmt::format("get({})", quoted(key));
    const auto until = std::min(deadline, Clock::now() + wait);
    while (true) {
      const Found f = found_in(ask("/v3/kv/range", range_of(key), what, deadline), key);
      if (f.present) return f.value;
      if (Clock::now() >= until) {
        throw RendezvousError(fmt::format(
            "{} timed out after {:.1f} s waiting for {} in {}: whoever should write it has not "
            "(it failed, exited, or is slower than the timeout)",
            options_.who, wait.count() / 1000.0, quoted(key), client_.describe()));
      }
      // Wait for it to be written after the revision read, then read it (linearizably) again.
      const auto watched = Clock::now();
      const bool written = client_.watch(
          {{"key", base64_encode(key)}, {"start_revision", std::to_string(f.revision + 1)}},
          [](const json& events) { return !events.empty(); }, until);
      // A watch that failed at once (its member went away) is not a busy loop.
      if (!written && Clock::now() - watched < 50ms) std::this_thread::sleep_for(50ms);
    }
  }

  int64_t add(const std::string& key, int64_t delta, Deadline deadline) override {
    const std::string what = fmt::format("add({}, {})", quoted(key), delta);
    while (true) {
      const Found f = found_in(ask("/v3/kv/range", range_of(key), what, deadline), key);
      const int64_t now = f.present ? number(f.value, key) : 0;
      if (delta == 0) return now;
      const std::string next = std::to_string(now + delta);
      // Written only over the revision read: another node's add in between makes this one read
      // and try again.
      const json compare = f.present ? json{{"key", base64_encode(key)},
                                            {"target", "MOD"},
                                            {"result", "EQUAL"},
                                            {"mod_revision", std::to_string(f.mod_revision)}}
                                     : json{{"key", base64_encode(key)},
                                            {"target", "CREATE"},
                                            {"result", "EQUAL"},
                                            {"create_revision", "0"}};
      const json txn = {{"compare", json::array({compare})},
                        {"success", json::array({{{"request_put",
                                                   {{"key", base64_encode(key)},
                                                    {"value", base64_encode(next)}}}}})}};
      if (ask("/v3/kv/txn", txn, what, deadline).value("succeeded", false)) {
        return now + delta;
      }
    }
  }

  std::string compare_set(const std::string& key, std::string_view expected,
                          std::string_view desired, Deadline deadline) override {
    const std::string what = fmt::format("compareSet({})", quoted(key));
    const json compare = expected.empty() ? json{{"key", base64_encode(key)},
                                                 {"target", "CREATE"},
                                                 {"result", "EQUAL"},
                                                 {"create_revision", "0"}}
                                          : json{{"key", base64_encode(key)},
                                                 {"target", "VALUE"},
                                                 {"result", "EQUAL"},
                                                 {"value", base64_encode(expected)}};
    const json txn = {{"compare", json::array({compare})},
                      {"success", json::array({{{"request_put",
                                                 {{"key", base64_encode(key)},
                                                  {"value", base64_encode(desired)}}}}})},
                      {"failure", json::array({{{"request_range", range_of(key)}}})}};
    const json a = ask("/v3/kv/txn", txn, what, deadline);
    if (a.value("succeeded", false)) return std::string(desired);
    // The value it holds instead; c10d's rule: `expected` itself for an absent key.
    if (a.contains("responses") && !a["responses"].empty()) {
      const json& r = a["responses"][0];
      const Found f = found_in(r.value("response_range", json::object()), key);
      if (f.present) return f.value;
    }
    // Empty `expected` fails only over a present key, which the range read just now; absent
    // meanwhile (deleted): the caller asks again.
    return std::string(expected);
  }

  bool check(const std::string& key, Deadline deadline) override {
    json r = range_of(key);
    r["count_only"] = true;
    const json a = ask("/v3/kv/range", r, fmt::format("check({})", quoted(key)), deadline);
    return json_int(a, "count") > 0;
  }

  // Each beat writes the key under this node's lease: its version counts the beats.
  void beat(const std::string& key, Deadline deadline) override {
    const std::string what = fmt::format("beat({})", quoted(key));
    for (int attempt = 0;; ++attempt) {
      if (!lease_ || lease_->gone()) grant(deadline);
      try {
        put(key, "1", lease_->id(), what, deadline);
        return;
      } catch (const EtcdLeaseGone&) {
        if (attempt > 0) throw;
        lease_.reset();  // expired before its keeper heard: a new one
      }
    }
  }

  int64_t count_beats(const std::string& key, Deadline deadline) override {
    const Found f = found_in(ask("/v3/kv/range", range_of(key),
                                 fmt::format("beats({})", quoted(key)), deadline),
                             key);
    return f.present ? f.version : -1;  // gone with its node's lease
  }

  void wait_for_change(const std::string& prefix, const std::string& quiet,
                       milliseconds timeout) override {
    std::string end = prefix;  // every key under `prefix`: [prefix, prefix with its last byte + 1)
    end.back() = static_cast<char>(end.back() + 1);
    client_.watch(
        {{"key", base64_encode(prefix)},
         {"range_end", base64_encode(end)},
         {"start_revision", std::to_string(revision_ + 1)}},
        [&](const json& events) {
          for (const json& e : events) {
            const std::string key =
                base64_decode(e.value("kv", json::object()).value("key", ""), "a key");
            // A sign of life that vanished (its lease expired) is news; one more
            // beat is not.
            if (e.value("type", "PUT") == "DELETE" || key.rfind(quiet, 0) != 0) {
              return true;
            }
          }
          return false;
        },
        Clock::now() + timeout);
  }

  std::string describe() const override { return client_.describe(); }
  std::string local_address() const override { return client_.local_address(); }

 private:
  // Every call of the rounds, remembering the newest revision read (wait_for_change).
  json ask(std::string_view path, const json& body, const std::string& what, Deadline deadline) {
    json a = client_.call(path, body, what, deadline);
    if (a.contains("header")) revision_ = std::max(revision_, json_int(a["header"], "revision"));
    return a;
  }

  void put(const std::string& key, std::string_view value, int64_t lease, const std::string& what,
           Deadline deadline) {
    json body = {{"key", base64_encode(key)}, {"value", base64_encode(value)}};
    if (lease != 0) body["lease"] = std::to_string(lease);
    ask("/v3/kv/put", body, what, deadline);
  }

  void grant(Deadline deadline) {
    lease_.reset();
    const json a = ask("/v3/lease/grant", {{"TTL", std::to_string(options_.lease_ttl.count())}},
                       "grant(lease)", deadline);
    const int64_t id = json_int(a, "ID");
    if (id == 0) {
      throw RendezvousError(fmt::format("{}: etcd granted no lease: {}", options_.who, a.dump()));
    }
    lease_ = std::make_unique<LeaseKeeper>(options_, id);
  }

  int64_t number(const std::string& text, const std::string& key) const {
    try {
      size_t used = 0;
      const int64_t v = std::stoll(text, &used);
      if (used == text.size()) return v;
    } catch (const std::exception&) {
    }
    throw Error(
        fmt::format("{}: etcd holds '{}' under {}, not a number: another program wrote to "
                    "this job's keys",
                    options_.who, text, quoted(key)));
  }

  const EtcdOptions options_;
  EtcdClient client_;
  std::unique_ptr<LeaseKeeper> lease_;  // granted at the first beat
  int64_t revision_ = 0;                // the newest revision any answer carried
};

std::string read_password(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  if (!in || !std::getline(in, line)) {
    throw UsageError(fmt::format(
        "--rdzv-conf password_file={}: cannot read it; give a file holding the etcd user's "
        "password on its first line",
        path));
  }
  return line;
}

}  // namespace

EtcdOptions etcd_options(const std::string& endpoints,
                         const std::map<std::string, std::string>& conf) {
  EtcdOptions o;
  auto get = [&](const char* k) {
    auto it = conf.find(k);
    return it == conf.end() ? std::string() : it->second;
  };
  const std::string protocol = get("protocol");
  if (!protocol.empty() && protocol != "http" && protocol != "https") {
    bad_value("--rdzv-conf protocol", protocol, "expected http or https");
  }
  o.https = protocol == "https";
  for (std::string e : split(endpoints, ',')) {
    for (const char* scheme : {"http://", "https://"}) {
      if (e.rfind(scheme, 0) == 0) {
        o.https = o.https || std::string(scheme) == "https://";
        e = e.substr(std::string(scheme).size());
      }
    }
    if (!e.empty() && e.back() == '/') e.pop_back();
    Endpoint parsed = parse_endpoint("--rdzv-endpoint", e);
    const bool has_port =
        e.find("]:") != std::string::npos || (e.front() != '[' && e.find(':') != std::string::npos);
    if (!has_port) parsed.port = kEtcdDefaultPort;
    o.endpoints.push_back(parsed.host.find(':') != std::string::npos
                              ? fmt::format("[{}]:{}", parsed.host, parsed.port)
                              : fmt::format("{}:{}", parsed.host, parsed.port));
  }
  if (o.endpoints.empty()) {
    bad_value("--rdzv-endpoint", endpoints,
              "expected the etcd cluster's client endpoints, HOST[:PORT] comma-separated");
  }
  for (const char* file : {"cacert", "cert", "key"}) {
    const std::string path = get(file);
    if (path.empty()) continue;
    if (!std::ifstream(path)) {
      bad_value(fmt::format("--rdzv-conf {}", file), path, "cannot read this file");
    }
    (std::string(file) == "cacert" ? o.cacert
     : std::string(file) == "cert" ? o.cert
                                   : o.key) = path;
  }
  const std::string user = get("user");
  if (const size_t colon = user.find(':'); colon != std::string::npos) {
    o.user = user.substr(0, colon);
    o.password = user.substr(colon + 1);
  } else {
    o.user = user;
  }
  if (const std::string file = get("password_file"); !file.empty())
    o.password = read_password(file);
  if (!o.user.empty() && o.password.empty() && user.find(':') == std::string::npos) {
    bad_value("--rdzv-conf user", user, "expected NAME:PASSWORD, or NAME with password_file=PATH");
  }
  return o;
}

std::unique_ptr<KeyValue> etcd_key_value(const EtcdOptions& options) {
  return std::make_unique<Etcd>(options);
}

}  // namespace ddp::launcher
