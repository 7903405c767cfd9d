// etcd's v3 JSON gateway over libcurl (etcd_client.h).
#include "etcd_client.h"

#include <curl/curl.h>
#include <openssl/evp.h>  // EVP_EncodeBlock, EVP_DecodeBlock

#include <algorithm>
#include <mutex>  // std::call_once

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "etcd_options.h"

namespace ddp::launcher {
namespace {

using Clock = store::Clock;
using std::chrono::milliseconds;

// The least a member is given to answer when the deadline is shared among several.
constexpr milliseconds kLeastPerMember{300};
// gRPC's status codes, as the gateway reports them in "code".
constexpr int kCancelled = 1;
constexpr int kDeadlineExceeded = 4;
constexpr int kNotFound = 5;
constexpr int kPermissionDenied = 7;
constexpr int kUnavailable = 14;
constexpr int kUnauthenticated = 16;

void init_curl_once() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

milliseconds left(Clock::time_point deadline) {
  return std::max(milliseconds(0),
                  std::chrono::duration_cast<milliseconds>(deadline - Clock::now()));
}

// Certificates and protocols that cannot work however often they are tried.
bool final_curl_error(CURLcode code) {
  switch (code) {
    case CURLE_PEER_FAILED_VERIFICATION:
    case CURLE_SSL_CACERT_BADFILE:
    case CURLE_SSL_CERTPROBLEM:
    case CURLE_SSL_CIPHER:
    case CURLE_SSL_ISSUER_ERROR:
    case CURLE_WEIRD_SERVER_REPLY:
    case CURLE_UNSUPPORTED_PROTOCOL:
    case CURLE_HTTP2: return true;
    default: return false;
  }
}

size_t on_bytes(char* data, size_t size, size_t count, void* user) {
  auto* sink = static_cast<std::function<bool(std::string_view)>*>(user);
  const size_t n = size * count;
  return (*sink)(std::string_view(data, n)) ? n : 0;  // 0: stop the transfer
}

}  // namespace

std::string base64_encode(std::string_view bytes) {
  std::string out(4 * ((bytes.size() + 2) / 3), '\0');
  const int n = EVP_EncodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(bytes.data()),
                                static_cast<int>(bytes.size()));
  out.resize(static_cast<size_t>(n));
  return out;
}

std::string base64_decode(std::string_view text, const char* what) {
  if (text.size() % 4 != 0) {
    throw RendezvousError(fmt::format("etcd answered {} that is not base64", what));
  }
  std::string out(3 * text.size() / 4, '\0');
  const int n = EVP_DecodeBlock(reinterpret_cast<unsigned char*>(out.data()),
                                reinterpret_cast<const unsigned char*>(text.data()),
                                static_cast<int>(text.size()));
  if (n < 0) throw RendezvousError(fmt::format("etcd answered {} that is not base64", what));
  size_t padding = 0;
  while (padding < 2 && padding < text.size() && text[text.size() - 1 - padding] == '=') {
    ++padding;
  }
  out.resize(static_cast<size_t>(n) - padding);
  return out;
}

int64_t json_int(const nlohmann::json& j, const char* field, int64_t absent) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absent;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_string()) {
    try {
      return std::stoll(it->get<std::string>());
    } catch (const std::exception&) {
    }
  }
  throw RendezvousError(fmt::format("etcd answered {} = {}, not a number", field, it->dump()));
}

struct EtcdClient::Answer {
  CURLcode code = CURLE_OK;
  std::string curl_error;
  long http = 0;
  std::string body;
};

EtcdClient::EtcdClient(const EtcdOptions& o)
    : endpoints_(o.endpoints), scheme_(o.https ? "https" : "http"), cacert_(o.cacert),
      cert_(o.cert), key_(o.key), user_(o.user), password_(o.password), who_(o.who) {
  init_curl_once();
  MutexLock lock(&mu_);
  curl_ = curl_easy_init();
  if (curl_ == nullptr) throw Error(fmt::format("{}: cannot start an HTTP client (libcurl)", who_));
}

EtcdClient::~EtcdClient() {
  MutexLock lock(&mu_);
  curl_easy_cleanup(static_cast<CURL*>(curl_));
}

std::string EtcdClient::url(size_t member, std::string_view path) const {
  return fmt::format("{}://{}{}", scheme_, endpoints_[member], path);
}

std::string EtcdClient::describe() const {
  return fmt::format("etcd at {}", fmt::join(endpoints_, ","));
}

std::string EtcdClient::local_address() const {
  MutexLock lock(&mu_);
  return local_address_;
}

EtcdClient::Answer EtcdClient::post(size_t member, std::string_view path, const std::string& body,
                                    milliseconds timeout,
                                    const std::function<bool(std::string_view)>& on_chunk) {
  CURL* c = static_cast<CURL*>(curl_);
  curl_easy_reset(c);
  Answer a;
  std::function<bool(std::string_view)> sink = [&](std::string_view chunk) {
    if (on_chunk) return on_chunk(chunk);
    a.body.append(chunk);
    return a.body.size() <= (64u << 20);  // a sane answer is far smaller
  };
  char error[CURL_ERROR_SIZE] = {};
  curl_slist* headers = curl_slist_append(nullptr, "Content-Type: application/json");
  if (!token_.empty()) {
    headers = curl_slist_append(headers, fmt::format("Authorization: {}", token_).c_str());
  }
  const std::string address = url(member, path);
  curl_easy_setopt(c, CURLOPT_URL, address.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDS, body.c_str());
  curl_easy_setopt(c, CURLOPT_POSTFIELDSIZE, static_cast<long>(body.size()));
  curl_easy_setopt(c, CURLOPT_HTTPHEADER, headers);
  curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);  // threads: no SIGALRM for name lookups
  curl_easy_setopt(c, CURLOPT_NOPROXY, "*");  // etcd is asked directly, never via a proxy
  curl_easy_setopt(c, CURLOPT_TIMEOUT_MS, std::max<long>(1, timeout.count()));
  curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT_MS, std::max<long>(1, timeout.count()));
  curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_bytes);
  curl_easy_setopt(c, CURLOPT_WRITEDATA, &sink);
  curl_easy_setopt(c, CURLOPT_ERRORBUFFER, error);
  if (!cacert_.empty()) curl_easy_setopt(c, CURLOPT_CAINFO, cacert_.c_str());
  if (!cert_.empty()) curl_easy_setopt(c, CURLOPT_SSLCERT, cert_.c_str());
  if (!key_.empty()) curl_easy_setopt(c, CURLOPT_SSLKEY, key_.c_str());
  a.code = curl_easy_perform(c);
  curl_slist_free_all(headers);
  curl_easy_getinfo(c, CURLINFO_RESPONSE_CODE, &a.http);
  if (char* ip = nullptr;
      curl_easy_getinfo(c, CURLINFO_LOCAL_IP, &ip) == CURLE_OK && ip != nullptr && *ip != '\0') {
    local_address_ = ip;
  }
  if (a.code != CURLE_OK) a.curl_error = error[0] != '\0' ? error : curl_easy_strerror(a.code);
  return a;
}

void EtcdClient::authenticate(size_t member, Deadline deadline) {
  token_.clear();
  const nlohmann::json body = {{"name", user_}, {"password", password_}};
  Answer a = post(member, "/v3/auth/authenticate", body.dump(), left(deadline), {});
  nlohmann::json j = nlohmann::json::parse(a.body, nullptr, false);
  if (a.code == CURLE_OK && !j.is_discarded() && j.contains("token")) {
    token_ = j["token"].get<std::string>();
    return;
  }
  const std::string why = a.code != CURLE_OK ? a.curl_error
                          : j.is_discarded() ? fmt::format("HTTP {}", a.http)
                                             : j.value("message", j.dump());
  if (a.code != CURLE_OK) {
    throw store::UnreachableError(
        fmt::format("{}: etcd at {} did not answer the authentication of user '{}': {}", who_,
                    endpoints_[member], user_, why),
        why);
  }
  throw store::RefusedError(fmt::format(
      "{}: etcd at {} refused user '{}': {}. Check user=NAME:PASSWORD (or password_file) in "
      "--rdzv-conf.",
      who_, endpoints_[member], user_, why));
}

nlohmann::json EtcdClient::call(std::string_view path, const nlohmann::json& body,
                                const std::string& what, Deadline deadline) {
  MutexLock lock(&mu_);
  const std::string text = body.dump();
  const auto started = Clock::now();
  std::vector<std::string> tried;
  const int n = static_cast<int>(endpoints_.size());
  bool reauthenticated = false;
  for (int attempt = 0; attempt < n; ++attempt) {
    const milliseconds remaining = left(deadline);
    if (remaining.count() == 0) break;
    const size_t member = (current_ + static_cast<size_t>(attempt)) % endpoints_.size();
    const milliseconds share =
        attempt + 1 == n
            ? remaining
            : std::min(remaining, std::max(kLeastPerMember, remaining / (n - attempt)));
    const auto until = Clock::now() + share;
    std::string why;
    try {
      if (!user_.empty() && token_.empty()) authenticate(member, until);
      Answer a = post(member, path, text, left(until), {});
      if (a.code != CURLE_OK) {
        if (final_curl_error(a.code)) {
          throw store::RefusedError(
              fmt::format("{}: {} to etcd at {} failed: {} (check --rdzv-endpoint and, for TLS, "
                          "protocol, cacert, cert and key in --rdzv-conf)",
                          who_, what, endpoints_[member], a.curl_error));
        }
        tried.push_back(fmt::format("{}: {}", endpoints_[member], a.curl_error));
        continue;
      }
      nlohmann::json j = nlohmann::json::parse(a.body, nullptr, false);
      if (j.is_discarded() || !j.is_object()) {
        throw store::RefusedError(fmt::format(
            "{}: {}: {} answered HTTP {} but not etcd's JSON ('{}'): is --rdzv-endpoint an etcd "
            "member's client URL?",
            who_, what, endpoints_[member], a.http, a.body.substr(0, 80)));
      }
      const int code = static_cast<int>(json_int(j, "code"));
      if (code == 0 && a.http == 200) {
        current_ = member;
        return j;
      }
      const std::string message = j.value("message", j.value("error", a.body.substr(0, 200)));
      if (code == kUnauthenticated && !user_.empty() &&
          message.find("invalid auth token") != std::string::npos) {
        token_.clear();  // expired: authenticate anew, once, and ask this member again
        tried.push_back(fmt::format("{}: {}", endpoints_[member], message));
        if (!reauthenticated) {
          reauthenticated = true;
          --attempt;
        }
        continue;
      }
      if (code == kUnauthenticated || code == kPermissionDenied) {
        throw store::RefusedError(fmt::format(
            "{}: etcd at {} refused {}: {}. Check user=NAME:PASSWORD in --rdzv-conf and the "
            "user's role (read and write on the job's keys, 'ddprun/').",
            who_, endpoints_[member], what, message));
      }
      if (code == kNotFound && message.find("lease not found") != std::string::npos) {
        throw EtcdLeaseGone(fmt::format("{}: {}: {}", who_, what, message));
      }
      if (code == kUnavailable || code == kDeadlineExceeded || code == kCancelled) {
        tried.push_back(fmt::format("{}: {}", endpoints_[member], message));
        continue;
      }
      throw RendezvousError(fmt::format("{}: etcd at {} answered {} with an error: {} (code {})",
                                        who_, endpoints_[member], what, message, code));
    } catch (const store::UnreachableError& e) {  // from authenticate
      tried.push_back(fmt::format("{}: {}", endpoints_[member], e.cause));
    }
  }
  const double waited = std::chrono::duration<double>(Clock::now() - started).count();
  throw store::UnreachableError(fmt::format("{}: no etcd member answered {} in {:.1f} s: {}", who_,
                                            what, waited,
                                            tried.empty()
                                                ? std::string("no time was left to ask")
                                                : fmt::format("{}", fmt::join(tried, "; "))),
                                tried.empty() ? "no time left" : tried.back());
}

bool EtcdClient::watch(const nlohmann::json& create_request,
                       const std::function<bool(const nlohmann::json& events)>& on_events,
                       Deadline until) {
  MutexLock lock(&mu_);
  const milliseconds wait = left(until);
  if (wait.count() == 0) return false;
  const std::string body = nlohmann::json{{"create_request", create_request}}.dump();
  std::string pending;
  bool seen = false;
  auto on_chunk = [&](std::string_view chunk) {
    pending.append(chunk);
    size_t end;
    while ((end = pending.find('\n')) != std::string::npos) {
      nlohmann::json j = nlohmann::json::parse(pending.substr(0, end), nullptr, false);
      pending.erase(0, end + 1);
      if (j.is_discarded()) continue;
      const nlohmann::json& result = j.contains("result") ? j["result"] : j;
      // A canceled watch (a compacted revision) is read again like an event.
      if (result.value("canceled", false)) return !(seen = true);
      if (result.contains("events") && on_events(result["events"])) return !(seen = true);
    }
    return pending.size() <= (16u << 20);
  };
  if (!user_.empty() && token_.empty()) {
    try {
      authenticate(current_, until);
    } catch (const store::UnreachableError&) {
      return false;
    }
  }
  post(current_, "/v3/watch", body, wait, on_chunk);
  return seen;  // else timed out, or the member did not answer: the caller reads again
}

}  // namespace ddp::launcher
