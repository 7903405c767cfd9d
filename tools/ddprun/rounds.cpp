// Restart rounds (see Note [Restart rounds] in rounds.h): what every kind of rounds shares, and
// a single node's.
#include "rounds.h"

#include <fmt/format.h>

#include "agent_store.h"     // host_agent_store: --ft
#include "base/net.h"        // pick_free_port
#include "base/random_id.h"  // random_hex: a single node's lineage
#include "output.h"          // note
#include "store/protocol.h"  // job_key

namespace ddp::launcher {
namespace {

// A single node restarts alone: its rounds are its own attempts.
class LocalRounds final : public Rounds {
 public:
  LocalRounds(std::unique_ptr<store::Server> store, std::string addr)
      : store_(std::move(store)), addr_(std::move(addr)) {}
  bool agent_store() const override { return store_ != nullptr; }
  std::optional<Membership> join(int next, const std::function<bool()>&) override {
    Membership m{.round = next, .node_rank = 0, .nnodes = 1, .restarts = next, .lineage = lineage_};
    if (store_) {
      m.store_addr = addr_;
      m.store_port = store_->port();
    }
    return m;
  }
  std::optional<std::string> failure_elsewhere(int) override { return std::nullopt; }
  std::optional<std::string> report_failure(int, const std::string&, bool) override {
    return std::nullopt;
  }
  bool final_failure(int) override { return false; }
  void leave(int, bool, const std::function<bool()>&) override {}

 private:
  const std::string lineage_ = random_hex(8);  // this ddprun's: a job of one node
  std::unique_ptr<store::Server> store_;       // --ft: the workers' store
  std::string addr_;                           // where it listens
};

}  // namespace

std::unique_ptr<Rounds> make_local_rounds(const LaunchConfig& config, const EnvMap& base_env,
                                          const std::string& run_id, const std::string& secret) {
  std::unique_ptr<store::Server> store;
  if (config.ft) {
    LaunchConfig here = config;
    if (config.pick_free_port) here.master_port = net::pick_free_port();
    store = host_agent_store(here, base_env, store::job_key(secret, run_id), secret,
                             "this ddprun (--ft)");
  }
  return std::make_unique<LocalRounds>(std::move(store), config.master_addr);
}

std::optional<std::string> StorePoll::operator()(
    const std::function<std::optional<std::string>(store::Clock::time_point)>& ask,
    const std::function<void()>& on_error) {
  const auto now = store::Clock::now();
  if (now < next_) return std::nullopt;
  next_ = now + kPollInterval;
  try {
    return ask(now + kCallTime);
  } catch (const Error& e) {
    if (on_error) on_error();
    if (!noted_) {
      note(fmt::format("could not ask the agent store whether the other nodes are well ({}); "
                       "the workers go on (they fail by themselves if their peers are gone)",
                       e.what()));
    }
    noted_ = true;
    next_ = now + kPollBackoff;
    return std::nullopt;
  }
}

}  // namespace ddp::launcher
