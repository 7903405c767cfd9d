// A client of etcd's v3 JSON gateway (Note [etcd backend] in etcd.h): one request at a time over
// libcurl, each bounded by its deadline, going from member to member until one answers.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "base/thread_annotations.h"  // Mutex, GUARDED_BY
#include "store/client.h"             // store::Clock

namespace ddp::launcher {

struct EtcdOptions;  // etcd_options.h

// etcd answered, but its lease is gone (expired, or revoked): the caller grants a new one.
class EtcdLeaseGone : public RendezvousError {
 public:
  using RendezvousError::RendezvousError;
};

std::string base64_encode(std::string_view bytes);
// Throws RendezvousError naming `what` when `text` is not base64.
std::string base64_decode(std::string_view text, const char* what);
// The gateway writes 64-bit numbers as JSON strings ("revision": "5"); absent: `absent`.
int64_t json_int(const nlohmann::json& j, const char* field, int64_t absent = 0);

class EtcdClient {
 public:
  using Deadline = store::Clock::time_point;

  explicit EtcdClient(const EtcdOptions& options);
  ~EtcdClient();
  EtcdClient(const EtcdClient&) = delete;
  EtcdClient& operator=(const EtcdClient&) = delete;

  // POSTs `body` to `path` ("/v3/kv/range") and returns etcd's answer. The member that answered
  // last is asked first; on no answer (refused, timed out, unavailable: no leader, cut off from
  // the majority) the next, each with a share of what is left of the deadline. Throws
  // store::UnreachableError naming every member tried and what it answered, store::RefusedError
  // when asking again cannot help (refused credentials or certificates, not etcd),
  // EtcdLeaseGone, or RendezvousError for any other error etcd answers. `what` names the call
  // in errors ("get(\"ddprun/job/round\")").
  nlohmann::json call(std::string_view path, const nlohmann::json& body, const std::string& what,
                      Deadline deadline) EXCLUDES(mu_);

  // Watches from `create_request` (key, range_end, start_revision) until `on_events` returns
  // true for a batch of events, or until `until`. True when it did; false when `until` came
  // first or the member did not answer (the caller reads again either way).
  bool watch(const nlohmann::json& create_request,
             const std::function<bool(const nlohmann::json& events)>& on_events, Deadline until)
      EXCLUDES(mu_);

  // The address this host reached etcd from on the last call ("-" before any).
  std::string local_address() const EXCLUDES(mu_);
  // "etcd at h1:2379,h2:2379", for messages.
  std::string describe() const;

 private:
  struct Answer;
  Answer post(size_t member, std::string_view path, const std::string& body,
              std::chrono::milliseconds timeout,
              const std::function<bool(std::string_view chunk)>& on_chunk) REQUIRES(mu_);
  void authenticate(size_t member, Deadline deadline) REQUIRES(mu_);
  std::string url(size_t member, std::string_view path) const;

  // Constant after construction.
  const std::vector<std::string> endpoints_;
  const std::string scheme_;  // "http" or "https"
  const std::string cacert_, cert_, key_, user_, password_, who_;

  mutable Mutex mu_;
  void* curl_ GUARDED_BY(mu_) = nullptr;  // CURL*, one connection kept
  size_t current_ GUARDED_BY(mu_) = 0;    // the member that answered last
  std::string token_ GUARDED_BY(mu_);     // auth token ("": none yet)
  std::string local_address_ GUARDED_BY(mu_) = "-";
};

}  // namespace ddp::launcher
