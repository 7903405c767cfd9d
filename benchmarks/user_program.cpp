// A training program written as the README teaches, timed: what a user's own program gets from
// ddp-cpp without asking (no ddp::retain_freed_memory, no thread settings; DDPOptions as the
// README's example sets them: gradient_as_bucket_view, unless --gradient-as-bucket-view 0).
// benchmarks/vs_pytorch/compare.py --ours user-program runs it against PyTorch's DDP as its
// users run it (no MALLOC_* variables on either side).
//
//   ddprun --standalone --nproc-per-node 2 build/benchmarks/user_program \
//       [--model classic-cnn|mlp-1024] [--batch-size GLOBAL] [--steps N] [--warmup N]
//       [--lr X] [--momentum X] [--seed N] [--data-dir DIR] [--label L] [--csv FILE]
//       [--gradient-as-bucket-view 0|1]
//
// Rank 0 prints "samples/s <x>" and, with --csv, appends a row with ddp-bench's columns
// (label, samples_per_s, step_ms; the phase columns empty: a user's loop is not instrumented).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <torch/torch.h>

#include <ddp/datasets.h>
#include <ddp/ddp.h>
#include <ddp/runtime.h>

#include "models.h"  // tools/common: the comparison models, as torch_ddp.py builds them

int main(int argc, char** argv) {
  ddp::ensure_fast_blas(argc, argv);
  ddp::init_process_group();
  std::string model_name = "classic-cnn", data_dir, label = "user-program", csv;
  int64_t global_batch = 128, steps = 100, warmup = 10, seed = 0;
  double lr = 0.01, momentum = 0.9;
  bool bucket_view = true;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 == argc) throw ddp::ConfigError("user_program: " + flag + " needs a value");
    const std::string value = argv[i + 1];
    if (flag == "--model") model_name = value;
    else if (flag == "--batch-size") global_batch = std::stoll(value);
    else if (flag == "--steps") steps = std::stoll(value);
    else if (flag == "--warmup") warmup = std::stoll(value);
    else if (flag == "--lr") lr = std::stod(value);
    else if (flag == "--momentum") momentum = std::stod(value);
    else if (flag == "--seed") seed = std::stoll(value);
    else if (flag == "--data-dir") data_dir = value;
    else if (flag == "--label") label = value;
    else if (flag == "--csv") csv = value;
    else if (flag == "--gradient-as-bucket-view") bucket_view = value != "0";
    else if (flag == "--device" && value == "cpu") continue;  // compare.py's, the only one here
    else throw ddp::ConfigError("user_program: unknown flag " + flag + " (see the file's head)");
  }
  torch::manual_seed(seed);
  ddp::DistributedDataParallel<ddp::tools::ModelImpl> model(
      ddp::tools::make_model(model_name), {.gradient_as_bucket_view = bucket_view});
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(lr).momentum(momentum));

  auto train = std::make_shared<ddp::FashionMnist>(
      ddp::Split::kTrain, ddp::FashionMnistOptions{.dir = data_dir});
  ddp::DistributedSampler sampler(train->size(), {.shuffle = true,
                                                  .seed = static_cast<uint64_t>(seed),
                                                  .drop_last = true});
  ddp::DataLoader loader(train, sampler,
                         {.batch_size = global_batch / ddp::get_world_size(), .drop_last = true});
  using Clock = std::chrono::steady_clock;
  Clock::time_point start;
  int64_t step = 0;
  for (int64_t epoch = 0; step < warmup + steps; ++epoch) {
    sampler.set_epoch(epoch);
    for (auto& batch : loader) {
      if (step == warmup) {
        ddp::barrier();  // the ranks start the timed steps together
        start = Clock::now();
      }
      if (step++ == warmup + steps) break;
      opt.zero_grad();
      torch::cross_entropy_loss(model(batch.data), batch.target).backward();
      opt.step();
    }
  }
  ddp::barrier();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (ddp::is_main_process()) {
    const double per_s = static_cast<double>(global_batch * steps) / seconds;
    std::printf("samples/s %.1f\n", per_s);
    if (!csv.empty()) {
      std::ifstream existing(csv);
      const bool fresh = existing.peek() == std::ifstream::traits_type::eof();
      std::ofstream out(csv, std::ios::app);
      if (fresh) out << "label,samples_per_s,step_ms\n";
      out << label << "," << per_s << "," << 1000.0 * seconds / static_cast<double>(steps) << "\n";
    }
  }
  ddp::destroy_process_group();
}
