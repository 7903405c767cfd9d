// ft_train: per-step fault tolerance (ddp::ft::Manager, Note [Per-step fault tolerance] in
// ddp/fault_tolerance.h) under ddprun --ft. Kill a worker while it trains: the others lose the
// step in flight, re-form without it and go on in their own processes; ddprun starts it again,
// and at the next step boundary it receives their state (model, optimizer, step) and trains on
// with them. Synthetic data: step s's global batch is the same on every replica, split evenly
// over the replicas of the step's quorum, so any sequence of failures trains exactly what one
// process trains on the whole batches.
//
//   $ ddprun --ft --standalone --nproc-per-node 3 --max-restarts 3 build/examples/ft_train --steps 200
//   [rank 0]: ft_train: quorum 0: 3 replica(s), from step 0
//   ...
//   (kill -9 one worker)
//   [rank 1]: ft_train: step 57 not committed: [rank 1] all_reduce #172 ... rank 2 died ...
//   [rank 0]: ft_train: quorum 1: 2 replica(s), from step 57
//   [rank 2]: ft_train: quorum 2: 3 replica(s), from step 61 (healed)
//   ...
//   [rank 0]: ft_train: done: 200 steps committed, 1 dropped
//
// Options: --steps N, --global-batch G (divisible by every replica count the job reaches),
// --min-replicas N, --out DIR (each replica writes its final parameters to DIR/final.<id>.pt
// and a line per committed step to DIR/steps.<id>.txt: "<step> <quorum> <replicas> <its rank>
// <unix ms>"), --step-ms MS (sleep after each step: a slower run to kill in), --join-timeout S
// (how long a replica waits for its next quorum, or for the coordination store: default 60).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <torch/torch.h>

#include "ddp/ddp.h"

namespace {

struct Options {
  int64_t steps = 200;
  int64_t global_batch = 60;
  int min_replicas = 1;
  std::string out;
  int step_ms = 0;
  int join_timeout_s = 60;
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) throw ddp::ConfigError(flag + " needs a value");
    const std::string v = argv[++i];
    if (flag == "--steps") {
      o.steps = std::stoll(v);
    } else if (flag == "--global-batch") {
      o.global_batch = std::stoll(v);
    } else if (flag == "--min-replicas") {
      o.min_replicas = std::stoi(v);
    } else if (flag == "--out") {
      o.out = v;
    } else if (flag == "--step-ms") {
      o.step_ms = std::stoi(v);
    } else if (flag == "--join-timeout") {
      o.join_timeout_s = std::stoi(v);
    } else {
      throw ddp::ConfigError("unknown option " + flag);
    }
  }
  return o;
}

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(16, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 1));
    auto g = at::detail::createCPUGenerator(1);  // every replica starts from the same weights
    torch::NoGradGuard no_grad;
    for (auto& p : parameters()) p.copy_(at::randn(p.sizes(), g) * 0.2);
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::tanh(fc1->forward(x))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

// Step s's global batch: rows seeded by the step, labels from a fixed teacher.
std::pair<at::Tensor, at::Tensor> batch(int64_t step, int64_t rows) {
  auto g = at::detail::createCPUGenerator(1000 + step);
  at::Tensor x = at::randn({rows, 16}, g);
  at::Tensor y = at::sin(x.sum(1, true));
  return {x, y};
}

int64_t unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    Net net;
    torch::optim::SGD opt(net.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    ddp::TrainingState state;
    state.add("model", net);
    state.add("optimizer", opt);
    ddp::ft::ManagerOptions mo;
    mo.replica_id = "pid" + std::to_string(::getpid());
    mo.min_replicas = o.min_replicas;
    mo.join_timeout = std::chrono::seconds(o.join_timeout_s);
    ddp::ft::Manager manager(state, mo);
    std::ofstream steps;
    if (!o.out.empty()) {
      std::filesystem::create_directories(o.out);
      steps.open(o.out + "/steps." + mo.replica_id + ".txt");
    }
    int64_t dropped = 0, quorum = -1;
    while (manager.current_step() < o.steps) {
      const int64_t before = manager.current_step();
      manager.start_quorum();
      if (manager.job_finished()) {  // the others finished while this replica was away
        std::printf("ft_train: the job finished without this replica (at step %ld)\n",
                    static_cast<long>(before));
        return 0;
      }
      if (manager.quorum_id() != quorum) {
        quorum = manager.quorum_id();
        std::printf("ft_train: quorum %ld: %d replica(s), from step %ld%s\n",
                    static_cast<long>(quorum), manager.num_participants(),
                    static_cast<long>(manager.current_step()),
                    manager.current_step() != before ? " (healed)" : "");
        std::fflush(stdout);
      }
      const int64_t s = manager.current_step();
      const int n = manager.num_participants();
      if (o.global_batch % n != 0) {
        throw ddp::ConfigError("--global-batch " + std::to_string(o.global_batch) +
                               " is not divisible by " + std::to_string(n) + " replicas");
      }
      auto [x, y] = batch(s, o.global_batch);
      const int64_t per = o.global_batch / n;
      opt.zero_grad();
      torch::mse_loss(net.forward(x.narrow(0, manager.rank() * per, per)),
                      y.narrow(0, manager.rank() * per, per))
          .backward();
      for (auto& p : net.parameters()) manager.allreduce(p.mutable_grad());
      if (manager.should_commit()) {
        opt.step();
        if (steps.is_open()) {
          steps << s << ' ' << quorum << ' ' << n << ' ' << manager.rank() << ' ' << unix_ms()
                << '\n'
                << std::flush;
        }
      } else {
        ++dropped;
        std::printf("ft_train: step %ld not committed: %s\n", static_cast<long>(s),
                    manager.errored().substr(0, 300).c_str());
        std::fflush(stdout);
      }
      if (o.step_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(o.step_ms));
    }
    manager.finish();
    if (!o.out.empty()) {
      std::vector<at::Tensor> params;
      for (auto& p : net.parameters()) params.push_back(p.detach().clone());
      torch::save(params, o.out + "/final." + mo.replica_id + ".pt");
    }
    std::printf("ft_train: done: %ld steps committed, %ld dropped\n",
                static_cast<long>(manager.current_step()), static_cast<long>(dropped));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ft_train: %s\n", e.what());
    return 1;
  }
}
