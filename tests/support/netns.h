// Test support: several "hosts" on one machine, as Linux network namespaces joined by veth links
// to a bridge in a switch namespace. Each host has an address that exists only inside the
// namespaces (10.199.S.k+1/24); programs started on a host also get their own UTS namespace and
// hostname, so ddp-cpp sees different hosts. Needs root (ip netns, unshare) and iproute2.
//
//   Hosts hosts(2);                                  // ddpt<pid>h0, ddpt<pid>h1
//   auto job = hosts.start(0, {ddprun, ...});        // a Subprocess inside host 0
//   hosts.set_link(1, false);                        // unplug host 1
//   hosts.shape(1, "20mbit");                        // or slow its link down
//   Hosts four(4, 2);                                // h0, h1 on one bridge, h2, h3 on another
//   four.set_split(true);                            // the link between them down: 2 | 2
//
// Destruction kills whatever still runs in the namespaces and deletes them. Namespaces left by a
// test process that died are deleted by the next Hosts (their owner pid is gone).
#pragma once

#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "support/subprocess.h"

namespace ddp::testing {

class Hosts {
 public:
  static bool available(std::string* why) {
    if (::geteuid() != 0) {
      *why = "needs root (ip netns, unshare)";
      return false;
    }
    if (::access("/usr/sbin/ip", X_OK) != 0 && ::access("/sbin/ip", X_OK) != 0 &&
        ::access("/usr/bin/ip", X_OK) != 0) {
      *why = "needs iproute2 (ip)";
      return false;
    }
    return true;
  }

  // `second_from`: hosts k >= second_from hang on a second bridge, joined to the first by one
  // veth link (set_split cuts it); by default every host is on the first.
  explicit Hosts(int n, int second_from = -1)
      : n_(n), second_from_(second_from < 0 ? n : second_from),
        tag_(fmt::format("ddpt{}", ::getpid())) {
    remove_stale();
    try {
      create();
    } catch (...) {
      remove(tag_);  // the destructor does not run for a constructor that throws
      throw;
    }
  }

  // Whether network namespaces work here at all (a chroot without its own mount of / does
  // not allow `ip netns exec`): one is made and used, then deleted.
  static bool usable(std::string* why) {
    const std::string probe = fmt::format("ddpt{}probe", ::getpid());
    Result r = run_command({.argv = {"/bin/sh", "-c",
                                     fmt::format("ip netns add {0} && ip netns exec {0} true && "
                                                 "ip -n {0} link set lo up",
                                                 probe)},
                            .timeout_s = 30});
    remove(probe);
    if (!r.exited(0)) *why = "network namespaces do not work here: " + r.err;
    return r.exited(0);
  }

 private:
  void create() {
    const int subnet = 1 + ::getpid() % 250;
    sh(fmt::format("ip netns add {}sw", tag_));
    sh(fmt::format("ip -n {0}sw link add br0 type bridge && ip -n {0}sw link set br0 up", tag_));
    if (second_from_ < n_) {
      // br1, and the link between the bridges: lnk0 on br0, lnk1 on br1.
      sh(fmt::format(
          "ip -n {0}sw link add br1 type bridge && ip -n {0}sw link set br1 up && "
          "ip -n {0}sw link add lnk0 type veth peer name lnk1 && "
          "ip -n {0}sw link set lnk0 master br0 && ip -n {0}sw link set lnk1 master br1 && "
          "ip -n {0}sw link set lnk0 up && ip -n {0}sw link set lnk1 up",
          tag_));
    }
    for (int k = 0; k < n_; ++k) {
      const std::string ns = host(k);
      addresses_.push_back(fmt::format("10.199.{}.{}", subnet, k + 1));
      sh(fmt::format("ip netns add {}", ns));
      // veth pair: v<k> inside the host, p<k> on the bridge (names <= 15 characters).
      sh(fmt::format("ip link add {0}v{1} type veth peer name {0}p{1}", tag_, k));
      sh(fmt::format("ip link set {0}v{1} netns {2} && ip link set {0}p{1} netns {0}sw", tag_, k,
                     ns));
      sh(fmt::format("ip -n {0}sw link set {0}p{1} master br{2} && ip -n {0}sw link set {0}p{1} up",
                     tag_, k, k < second_from_ ? 0 : 1));
      sh(
          fmt::format("ip -n {0} addr add {1}/24 dev {2}v{3} && ip -n {0} link set {2}v{3} up && "
                      "ip -n {0} link set lo up",
                      ns, addresses_.back(), tag_, k));
    }
  }

 public:
  ~Hosts() {
    for (int k = 0; k < n_; ++k) {
      std::system(fmt::format("ip netns pids {} 2>/dev/null | xargs -r kill -9", host(k)).c_str());
    }
    remove(tag_);
  }

  Hosts(const Hosts&) = delete;
  Hosts& operator=(const Hosts&) = delete;

  std::string host(int k) const { return fmt::format("{}h{}", tag_, k); }
  const std::string& address(int k) const { return addresses_.at(k); }

  // Starts argv inside host k, with hostname "<tag>h<k>" in its own UTS namespace.
  Subprocess start(int k, std::vector<std::string> argv,
                   std::map<std::string, std::string> env = {}, double timeout_s = 120) const {
    std::vector<std::string> full = {ip(),
                                     "netns",
                                     "exec",
                                     host(k),
                                     "/usr/bin/unshare",
                                     "--uts",
                                     "/bin/sh",
                                     "-c",
                                     "hostname \"$0\" && exec \"$@\"",
                                     host(k)};
    full.insert(full.end(), argv.begin(), argv.end());
    return Subprocess::start({.argv = full, .env = std::move(env), .timeout_s = timeout_s});
  }

  // Host k's link up or down (down: its packets go nowhere, as an unplugged cable).
  void set_link(int k, bool up) const {
    sh(fmt::format("ip -n {} link set {}v{} {}", host(k), tag_, k, up ? "up" : "down"));
  }

  // The link between the two bridges down (`split`: hosts [0, second_from) and [second_from, n)
  // cannot reach each other, each side whole) or up again.
  void set_split(bool split) const {
    if (second_from_ >= n_) throw std::logic_error("Hosts: no second bridge to split from");
    sh(fmt::format("ip -n {}sw link set lnk0 {}", tag_, split ? "down" : "up"));
  }

  // Limits host k's outgoing traffic to `rate` (tc's token bucket filter, e.g. "20mbit").
  void shape(int k, const std::string& rate) const {
    sh(fmt::format("tc -n {} qdisc add dev {}v{} root tbf rate {} burst 64kb latency 400ms",
                   host(k), tag_, k, rate));
  }

  // The processes running inside host k.
  std::vector<int> pids(int k) const {
    Result r = run_command({.argv = {ip(), "netns", "pids", host(k)}, .timeout_s = 10});
    std::vector<int> out;
    std::istringstream in(r.out);
    for (int pid; in >> pid;) out.push_back(pid);
    return out;
  }
  int processes(int k) const { return static_cast<int>(pids(k).size()); }

 private:
  static std::string ip() {
    for (const char* p : {"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip"}) {
      if (::access(p, X_OK) == 0) return p;
    }
    return "ip";
  }

  static void sh(const std::string& command) {
    Result r = run_command({.argv = {"/bin/sh", "-c", command}, .timeout_s = 30});
    if (!r.exited(0)) throw std::runtime_error("Hosts: `" + command + "` failed: " + r.err);
  }

  // Deletes every namespace of `tag` (its hosts and its switch).
  static void remove(const std::string& tag) {
    std::system(fmt::format("for ns in $(ip netns list | cut -d' ' -f1 | grep '^{}'); do "
                            "ip netns pids $ns | xargs -r kill -9; ip netns del $ns; done",
                            tag)
                    .c_str());
  }

  // Namespaces of earlier test processes that are gone (a crash skipped their destructor).
  static void remove_stale() {
    Result r = run_command({.argv = {ip(), "netns", "list"}, .timeout_s = 10});
    size_t at = 0;
    while ((at = r.out.find("ddpt", at)) != std::string::npos) {
      size_t end = at + 4;
      while (end < r.out.size() && std::isdigit(static_cast<unsigned char>(r.out[end]))) ++end;
      const std::string digits = r.out.substr(at + 4, end - at - 4);
      if (!digits.empty() && ::kill(std::stoi(digits), 0) != 0) remove("ddpt" + digits);
      at = end;
    }
  }

  int n_;
  int second_from_;  // the first host on the second bridge (n_: none)
  std::string tag_;
  std::vector<std::string> addresses_;
};

}  // namespace ddp::testing
