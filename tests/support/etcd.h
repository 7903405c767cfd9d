// A real etcd cluster for one test: Debian's etcd-server (3.4), N members started in the
// foreground from a temporary folder, on 127.0.0.1 with free ports or on the hosts of a netns
// Hosts (support/netns.h), each member killed and started again at will. The destructor kills
// every member: nothing is left running. What the tests ask etcd themselves (health, auth setup)
// goes over a plain HTTP/1.1 socket here, not through the client under test.
#pragma once

#include <arpa/inet.h>  // inet_pton
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

#include "base/net.h"            // pick_free_port
#include "support/subprocess.h"  // Subprocess
#include "support/temp_dir.h"    // make_temp_dir

namespace ddp::testing {

struct HttpAnswer {
  int status = 0;    // 0: no answer
  std::string body;  // after the headers (the gateway answers with Content-Length or closes)
};

// POSTs `body` to http://address:port/path and reads the answer until the server closes or
// `timeout_s` passes.
inline HttpAnswer http_post(const std::string& address, int port, const std::string& path,
                            const std::string& body, double timeout_s = 2) {
  HttpAnswer a;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return a;
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  ::inet_pton(AF_INET, address.c_str(), &sa.sin_addr);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  auto wait_for = [&](short events) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        until - std::chrono::steady_clock::now());
    if (left.count() <= 0) return false;
    pollfd p{fd, events, 0};
    return ::poll(&p, 1, static_cast<int>(left.count())) == 1;
  };
  std::string raw;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 || errno == EINPROGRESS) {
    const std::string request = fmt::format(
        "POST {} HTTP/1.1\r\nHost: {}:{}\r\nContent-Type: application/json\r\nContent-Length: "
        "{}\r\nConnection: close\r\n\r\n{}",
        path, address, port, body.size(), body);
    size_t sent = 0;
    while (sent < request.size() && wait_for(POLLOUT)) {
      const ssize_t n = ::send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) break;
      sent += static_cast<size_t>(n);
    }
    char buf[4096];
    while (sent == request.size() && wait_for(POLLIN)) {
      const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n <= 0) break;
      raw.append(buf, static_cast<size_t>(n));
    }
  }
  ::close(fd);
  if (raw.rfind("HTTP/1.1 ", 0) != 0) return a;
  a.status = std::atoi(raw.c_str() + 9);
  const size_t head = raw.find("\r\n\r\n");
  a.body = head == std::string::npos ? "" : raw.substr(head + 4);
  return a;
}

class EtcdCluster {
 public:
  // Why this machine cannot run one (a GTEST_SKIP reason), or nullopt.
  static std::optional<std::string> unavailable() {
    if (!std::filesystem::exists("/usr/bin/etcd")) {
      return "/usr/bin/etcd is missing: apt-get install etcd-server (scripts/install-deps.sh)";
    }
    return std::nullopt;
  }

  struct Member {
    std::string address;
    int client_port = 2379;
    int peer_port = 2380;
  };
  // Starts member k's argv where it lives (a netns host, or here).
  using Starter = std::function<Subprocess(int k, const std::vector<std::string>& argv)>;
  // Whether member k answers a read (its cluster has a leader), asked from where it can be
  // reached; empty: over HTTP from this process.
  using Prober = std::function<bool(int k)>;

  // `n` members on 127.0.0.1, on free ports.
  explicit EtcdCluster(int n, std::vector<std::string> extra = {})
      : EtcdCluster(loopback(n), here(), {}, std::move(extra)) {}
  // Members at the given addresses, started by `start` (e.g. in netns hosts).
  EtcdCluster(std::vector<Member> members, Starter start, Prober probe = {},
              std::vector<std::string> extra = {})
      : members_(std::move(members)), start_(std::move(start)), probe_(std::move(probe)),
        extra_(std::move(extra)), dir_(make_temp_dir("ddp_etcd")), procs_(members_.size()) {
    for (size_t k = 0; k < members_.size(); ++k) launch(static_cast<int>(k));
  }
  ~EtcdCluster() {
    for (auto& p : procs_) p.reset();  // SIGKILL
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  EtcdCluster(const EtcdCluster&) = delete;
  EtcdCluster& operator=(const EtcdCluster&) = delete;

  int size() const { return static_cast<int>(members_.size()); }
  const Member& member(int k) const { return members_.at(k); }
  std::string endpoint(int k) const {
    return fmt::format("{}:{}", members_.at(k).address, members_.at(k).client_port);
  }
  // Every member's client endpoint, comma-separated: what --rdzv-endpoint takes.
  std::string endpoints() const {
    std::vector<std::string> all;
    for (int k = 0; k < size(); ++k) all.push_back(endpoint(k));
    return fmt::format("{}", fmt::join(all, ","));
  }

  // Until every member answers /health with a leader, or `timeout_s`; false then.
  bool wait_healthy(double timeout_s = 20) const {
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    for (int k = 0; k < size(); ++k) {
      while (!healthy(k)) {
        if (std::chrono::steady_clock::now() > until) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
    }
    return true;
  }
  bool healthy(int k) const {
    if (probe_) return probe_(k);
    // The gateway's /health is a GET; a range at the member proves a leader just as well.
    const HttpAnswer a = http_post(members_[k].address, members_[k].client_port, "/v3/kv/range",
                                   R"({"key":"aGVhbHRo"})", 1.0);
    return a.status == 200;
  }
  // A member's log so far (its stderr), for failure messages.
  std::string log(int k) const { return procs_.at(k) ? procs_[k]->err_so_far() : "(not running)"; }

  void kill(int k) { procs_.at(k).reset(); }
  // Sends `sig` to member k (SIGSTOP: it stops answering, as a hung or unreachable one).
  void signal(int k, int sig) const {
    if (procs_.at(k)) procs_[k]->signal(sig);
  }
  void restart(int k) { launch(k); }  // the same name and data folder: it rejoins

 private:
  static std::vector<Member> loopback(int n) {
    std::vector<Member> m;
    for (int k = 0; k < n; ++k) {
      m.push_back({"127.0.0.1", net::pick_free_port(), net::pick_free_port()});
    }
    return m;
  }
  // Here, dying with the test process (setpriv --pdeathsig): a test killed at its ctest deadline
  // leaves no etcd behind.
  static Starter here() {
    return [](int, const std::vector<std::string>& argv) {
      std::vector<std::string> full = {"/usr/bin/setpriv", "--pdeathsig", "KILL"};
      full.insert(full.end(), argv.begin(), argv.end());
      return Subprocess::start({.argv = full, .timeout_s = 600});
    };
  }

  void launch(int k) {
    std::vector<std::string> cluster;
    for (int i = 0; i < size(); ++i) {
      cluster.push_back(
          fmt::format("m{}=http://{}:{}", i, members_[i].address, members_[i].peer_port));
    }
    const Member& m = members_[k];
    const bool tls = std::ranges::any_of(extra_, [](const std::string& a) {
      return a.rfind("--cert-file", 0) == 0;
    });
    const std::string scheme = tls ? "https" : "http";
    std::vector<std::string> argv = {
        "/usr/bin/etcd",
        fmt::format("--name=m{}", k),
        fmt::format("--data-dir={}/m{}", dir_.string(), k),
        fmt::format("--listen-client-urls={}://{}:{}", scheme, m.address, m.client_port),
        fmt::format("--advertise-client-urls={}://{}:{}", scheme, m.address, m.client_port),
        fmt::format("--listen-peer-urls=http://{}:{}", m.address, m.peer_port),
        fmt::format("--initial-advertise-peer-urls=http://{}:{}", m.address, m.peer_port),
        fmt::format("--initial-cluster={}", fmt::join(cluster, ",")),
        fmt::format("--initial-cluster-token={}", dir_.filename().string()),
        "--initial-cluster-state=new",
        "--log-level=warn",
    };
    argv.insert(argv.end(), extra_.begin(), extra_.end());
    procs_[k].reset();
    procs_[k].emplace(start_(k, argv));
  }

  const std::vector<Member> members_;
  const Starter start_;
  const Prober probe_;
  const std::vector<std::string> extra_;
  const std::filesystem::path dir_;
  std::vector<std::optional<Subprocess>> procs_;
};

}  // namespace ddp::testing
