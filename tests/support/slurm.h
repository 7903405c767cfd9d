// A real one-node Slurm cluster for one test suite: Debian's munged, slurmctld and slurmd
// (packages munge and slurm-wlm), started in the foreground from a temporary folder, on free
// ports and loopback, with a munge key and socket of their own, so that neither a system Slurm
// nor another test run is touched. The destructor cancels every job and stops the daemons:
// nothing is left running. Root only (slurmd runs jobs as their users, munged as munge).
#pragma once

#include <unistd.h>  // geteuid, sysconf

#include <chrono>
#include <csignal>
#include <filesystem>
#include <functional>
#include <fstream>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "base/net.h"             // pick_free_port
#include "support/subprocess.h"  // Subprocess, Command, run_command
#include "support/temp_dir.h"    // make_temp_dir

namespace ddp::testing {

class SlurmCluster {
 public:
  // Why this machine cannot run one (a GTEST_SKIP reason), or nullopt.
  static std::optional<std::string> unavailable() {
    if (::geteuid() != 0) return "a Slurm cluster needs root (slurmd, munged as munge)";
    for (const char* tool : {"/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged",
                             "/usr/sbin/mungekey", "/usr/bin/srun", "/usr/bin/setpriv"}) {
      if (!std::filesystem::exists(tool)) {
        return fmt::format("{} is missing: apt-get install slurm-wlm munge "
                           "(scripts/install-deps.sh)",
                           tool);
      }
    }
    return std::nullopt;
  }

  SlurmCluster() : dir_(make_temp_dir("ddp_slurm")) {
    namespace fs = std::filesystem;
    fs::permissions(dir_, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                              fs::perms::others_read | fs::perms::others_exec);
    const fs::path munge = dir_ / "munge";
    fs::create_directories(munge / "run");
    fs::create_directories(dir_ / "state");
    fs::create_directories(dir_ / "spool");
    must(run_command({.argv = {"/usr/bin/chown", "-R", "munge:munge", munge.string()}}), "chown");
    const std::vector<std::string> as_munge = {"/usr/bin/setpriv", "--reuid=munge",
                                               "--regid=munge", "--init-groups"};
    must(run(as_munge, {"/usr/sbin/mungekey", "-c", "-k", (munge / "munge.key").string()}),
         "mungekey");
    socket_ = (munge / "run" / "munge.sock").string();
    std::vector<std::string> munged = as_munge;
    for (const std::string& a :
         {std::string("/usr/sbin/munged"), std::string("--foreground"), "--socket=" + socket_,
          "--key-file=" + (munge / "munge.key").string(),
          "--pid-file=" + (munge / "munged.pid").string(),
          "--log-file=" + (munge / "munged.log").string(),
          "--seed-file=" + (munge / "munged.seed").string()}) {
      munged.push_back(a);
    }
    daemons_.push_back(Subprocess::start({.argv = munged, .timeout_s = 3600}));
    wait_for([&] { return fs::exists(socket_); }, "munged's socket");

    host_ = short_host_name();
    const long cpus = ::sysconf(_SC_NPROCESSORS_ONLN);
    std::ofstream(conf()) << fmt::format(
        "ClusterName=ddptest\n"
        "SlurmctldHost={host}(127.0.0.1)\n"
        "SlurmctldPort={ctld}\nSlurmdPort={d}\n"
        "SlurmUser=root\nSlurmdUser=root\n"
        "AuthType=auth/munge\nCredType=cred/munge\nAuthInfo=socket={socket}\n"
        "StateSaveLocation={dir}/state\nSlurmdSpoolDir={dir}/spool\n"
        "SlurmctldPidFile={dir}/ctld.pid\nSlurmdPidFile={dir}/d.pid\n"
        "SlurmctldLogFile={dir}/ctld.log\nSlurmdLogFile={dir}/d.log\n"
        "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
        "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\n"
        "MpiDefault=none\nSwitchType=switch/none\nReturnToService=2\nJobRequeue=1\n"
        "KillWait=30\n"
        "NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN\n"
        "PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP "
        "OverSubscribe=FORCE:4\n",
        fmt::arg("host", host_), fmt::arg("ctld", net::pick_free_port()), fmt::arg("d", net::pick_free_port()),
        fmt::arg("socket", socket_), fmt::arg("dir", dir_.string()), fmt::arg("cpus", cpus));
    daemons_.push_back(Subprocess::start(
        {.argv = {"/usr/sbin/slurmctld", "-D", "-f", conf()}, .env = env(), .timeout_s = 3600}));
    daemons_.push_back(Subprocess::start(
        {.argv = {"/usr/sbin/slurmd", "-D", "-f", conf()}, .env = env(), .timeout_s = 3600}));
    wait_for([&] {
      Result r = run({"/usr/bin/sinfo", "-h", "-o", "%T"});
      return r.exited(0) && r.out.starts_with("idle");
    }, "the node to be idle (sinfo)");
  }

  SlurmCluster(const SlurmCluster&) = delete;
  SlurmCluster& operator=(const SlurmCluster&) = delete;

  ~SlurmCluster() {
    run({"/usr/bin/scancel", "--full", "--partition=test"});
    wait_for([&] {
      Result r = run({"/usr/bin/squeue", "-h"});
      return !r.exited(0) || r.out.empty();
    }, "", 40);
    for (auto it = daemons_.rbegin(); it != daemons_.rend(); ++it) {  // slurmd first, munged last
      it->signal(SIGTERM);
      if (!wait_for([&] { return exited(it->pid()); }, "", 10)) it->signal(SIGKILL);
      it->wait();
    }
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::filesystem::path dir() const { return dir_; }
  std::string conf() const { return (dir_ / "slurm.conf").string(); }
  // The environment of a client command (srun, sbatch, scontrol): our cluster's configuration.
  std::map<std::string, std::string> env() const { return {{"SLURM_CONF", conf()}}; }

  // A client command against this cluster, run to completion. `argv[0]` a path.
  Result run(std::vector<std::string> argv, double timeout_s = 60) const {
    return run_command(client(std::move(argv), timeout_s));
  }
  Result run(std::vector<std::string> prefix, const std::vector<std::string>& argv) const {
    prefix.insert(prefix.end(), argv.begin(), argv.end());
    return run_command({.argv = prefix, .timeout_s = 60});
  }
  // The same, for a command the test watches while it runs (srun of a training).
  Command client(std::vector<std::string> argv, double timeout_s) const {
    // Outer Slurm variables (the test itself running in a job) must not leak into ours.
    std::vector<std::string> unset;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv = *e;
      if (kv.starts_with("SLURM_") || kv.starts_with("SBATCH_") || kv.starts_with("SRUN_")) {
        unset.push_back(kv.substr(0, kv.find('=')));
      }
    }
    return {.argv = std::move(argv), .env = env(), .unset_env = unset, .timeout_s = timeout_s};
  }

  // "JobState=RUNNING" -> "RUNNING" for `job`, "" when scontrol does not know it.
  std::string job_state(const std::string& job) const {
    Result r = run({"/usr/bin/scontrol", "show", "job", job});
    const size_t at = r.out.find("JobState=");
    if (!r.exited(0) || at == std::string::npos) return "";
    const size_t from = at + std::string("JobState=").size();
    return r.out.substr(from, r.out.find_first_of(" \n", from) - from);
  }

  // The daemons' logs, for an assertion's message.
  std::string logs() const {
    std::string out;
    for (const char* f : {"ctld.log", "d.log"}) {
      std::ifstream in(dir_ / f);
      std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      out += fmt::format("--- {} (last 3000 bytes) ---\n{}\n", f,
                         text.size() > 3000 ? text.substr(text.size() - 3000) : text);
    }
    return out;
  }

 private:
  static std::string short_host_name() {
    char name[256] = {};
    ::gethostname(name, sizeof name - 1);
    std::string s = name;
    return s.substr(0, s.find('.'));
  }

  // Whether the child `pid` has exited (a zombie, until Subprocess::wait reaps it).
  static bool exited(pid_t pid) {
    std::ifstream stat(fmt::format("/proc/{}/stat", pid));
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t paren = text.rfind(')');
    return paren == std::string::npos || text.compare(paren + 1, 3, " Z ") == 0;
  }

  void must(const Result& r, const char* what) const {
    if (!r.exited(0)) throw std::runtime_error(fmt::format("{}: {}", what, r.describe()));
  }

  // Polls `ok` up to `timeout_s`; throws naming `what` (unless empty) when it never holds.
  bool wait_for(const std::function<bool()>& ok, const std::string& what,
                double timeout_s = 30) const {
    if (wait_until(ok, timeout_s)) return true;
    if (what.empty()) return false;
    throw std::runtime_error(
        fmt::format("the test's Slurm cluster: no {} within {} s\n{}", what, timeout_s, logs()));
  }

  std::filesystem::path dir_;
  std::string socket_;
  std::string host_;
  std::vector<Subprocess> daemons_;
};

}  // namespace ddp::testing
