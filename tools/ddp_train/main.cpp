// ddp-train: the main job. Trains a model on Fashion-MNIST across processes.
//
//   $ ddprun --standalone --nproc-per-node 2 build/tools/ddp_train/ddp-train
//   [rank 0]: ddp-train: cnn on Fashion-MNIST (60000 train / 10000 test images), 2 ranks ...
//   [rank 0]: epoch 1/3 [====================] 469/469  loss 0.2901  ...
//   [rank 0]: epoch 1/3: test loss 0.3020, test accuracy 89.05% (8905/10000), ...
//   ...
//   [rank 0]: done: test accuracy 91.xx% ...; model in runs/ddp-train/version_0/model_state.pt
//
// Only this function turns errors into exit codes: 0 done (or nothing left to do), 1 failed,
// 2 bad command line or configuration, 75 preempted (kExitPreempted, trainer.h). Every error is
// printed once, without a rank prefix of its own (Note [One rank prefix], messages.h), and
// recorded for the launcher.
#include <cstdio>
#include <exception>
#include <string>

#include "config.h"
#include "ddp/ddp.h"
#include "ddp/runtime.h"  // ensure_fast_blas, retain_freed_memory
#include "messages.h"
#include "trainer.h"

namespace {

int rank_for_messages() {
  if (ddp::is_initialized()) return ddp::get_rank();
  try {
    return ddp::parse_dist_env(ddp::current_environment()).rank;
  } catch (...) {
    return 0;
  }
}

// Prints `what` once (Note [One rank prefix]) and records it for the launcher; returns `code`.
int fail(const std::exception& e, const std::string& what, int code) {
  const std::string text = ddp::train::error_text(what, rank_for_messages());
  std::fprintf(stderr, "ddp-train: %s\n", text.c_str());
  ddp::record_error(text, ddp::relayed_from(e));  // a relayed error names the rank it came from
  return code;
}

// An allocation failure: what holds the memory, and the flag that shards it.
std::string out_of_memory_text(const std::exception& e, const ddp::train::TrainConfig& config) {
  return ddp::out_of_memory_text(e) +
         (config.fsdp.empty()
              ? "; --fsdp zero3 shards the model, its gradients and the optimizer's state"
          : config.checkpoint_format == "full"
              ? "; --fsdp " + config.fsdp +
                    " shards them already, but --checkpoint-format full gathers the model "
                    "whole and every rank's optimizer shards on rank 0: --checkpoint-format "
                    "sharded, more ranks, or more memory"
              : "; --fsdp " + config.fsdp + " shards them already: more ranks, or more memory");
}

}  // namespace

int main(int argc, char** argv) {
  ddp::train::TrainConfig config;
  try {
    // The command line before the BLAS check: --help and a bad flag answer without its
    // re-execution (a start costs LibTorch's loading, about a CPU-second). Parsing touches
    // neither the BLAS nor threads.
    if (!ddp::train::parse_args(argc, argv, config)) return 0;  // --help
    ddp::ensure_fast_blas(argc, argv);
    ddp::retain_freed_memory();  // activations come back every step: no page faults for them
    return ddp::train::run(config);
  } catch (const ddp::ConfigError& e) {
    return fail(e, e.what(), 2);
  } catch (const std::exception& e) {
    return fail(e, ddp::is_out_of_memory(e) ? out_of_memory_text(e, config) : e.what(), 1);
  }
}
