// A test worker: trains one of the equivalence models with DDP as a real process and saves
// rank 0's parameters. Every step's global batch has --chunks x 4 rows (seeded by the step, the
// same on every rank); rank r of W trains on chunks [r*C/W, (r+1)*C/W). Run under ddprun with
// W = C it is DDP across processes; run alone (W = 1) it is the one-process reference on the
// whole batch. The test compares the two. DDP_TEST_DEVICE=cuda trains on cuda:0 (every rank:
// the gpu tests share one GPU between two processes over Gloo or shm) with device_ids {0}.
//
//   ddp_equivalence_worker mlp|cnn|branchy|many OUT.pt --chunks C [--steps 20]
//     mlp      3-layer MLP
//     cnn      CNN with SyncBatchNorm (so BatchNorm statistics are over the whole batch)
//     branchy  a branch some chunks skip (find_unused_parameters) and a layer never used
//     many     26 small layers in buckets of ~300 bytes (many buckets)
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <torch/csrc/jit/serialization/pickle.h>
#include <torch/torch.h>

#include "ddp/ddp.h"
#include "support/models.h"

namespace {

using namespace ddp::testing;
constexpr int64_t kRowsPerChunk = 4;

// Chunk k of step s uses the branch unless (s + k) % 3 == 0.
std::vector<bool> branch_use(int step, int64_t first_chunk, int64_t chunks) {
  std::vector<bool> use;
  for (int64_t k = first_chunk; k < first_chunk + chunks; ++k) use.push_back((step + k) % 3 != 0);
  return use;
}

template <typename Net, typename Forward>
void train(Net net, ddp::DDPOptions options, int64_t total_chunks, int steps,
           std::vector<int64_t> sample_shape, const Forward& forward, const std::string& out) {
  const int rank = ddp::get_rank(), world = ddp::get_world_size();
  const int64_t mine = total_chunks / world, first = rank * mine;
  const char* device_name = std::getenv("DDP_TEST_DEVICE");
  const bool cuda = device_name != nullptr && std::string(device_name) == "cuda";
  const c10::Device device = cuda ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
  if (cuda) {
    net->to(device);
    options.device_ids = {0};
  }
  ddp::DistributedDataParallel model(net, options);
  torch::optim::SGD opt(model.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  for (int s = 0; s < steps; ++s) {
    auto gen = at::detail::createCPUGenerator(1000 + s);
    std::vector<int64_t> shape{total_chunks * kRowsPerChunk};
    shape.insert(shape.end(), sample_shape.begin(), sample_shape.end());
    auto x = at::randn(shape, gen).narrow(0, first * kRowsPerChunk, mine * kRowsPerChunk);
    auto y = at::randint(0, 10, {total_chunks * kRowsPerChunk}, gen)
                 .narrow(0, first * kRowsPerChunk, mine * kRowsPerChunk);
    x = x.to(device);
    y = y.to(device);
    opt.zero_grad();
    torch::cross_entropy_loss(forward(model, x, s, first, mine), y).backward();
    opt.step();
  }
  if (rank == 0) {
    c10::Dict<std::string, at::Tensor> state;
    for (const auto& item : net->named_parameters()) state.insert(item.key(), item.value().cpu());
    for (const auto& item : net->named_buffers()) state.insert(item.key(), item.value().cpu());
    auto bytes = torch::pickle_save(c10::IValue(state));
    std::ofstream(out, std::ios::binary)
        .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 5 || std::string(argv[3]) != "--chunks") {
      std::fprintf(stderr, "usage: %s KIND OUT --chunks C [--steps N]\n", argv[0]);
      return 2;
    }
    const std::string kind = argv[1], out = argv[2];
    const int64_t chunks = std::stoll(argv[4]);
    const int steps = argc > 6 ? std::stoi(argv[6]) : 20;
    ddp::init_process_group();
    if (chunks % ddp::get_world_size() != 0) throw ddp::ConfigError("chunks % world != 0");
    torch::manual_seed(ddp::get_rank());  // replicas differ until DDP copies rank 0's
    auto plain = [](auto& model, const at::Tensor& x, int, int64_t, int64_t) { return model(x); };
    if (kind == "mlp") {
      train(Mlp().ptr(), {}, chunks, steps, {20}, plain, out);
    } else if (kind == "cnn") {
      train(Cnn(/*sync_bn=*/true).ptr(), {}, chunks, steps, {1, 12, 12}, plain, out);
    } else if (kind == "branchy") {
      train(
          Branchy().ptr(), {.find_unused_parameters = true}, chunks, steps, {20},
          [](auto& model, const at::Tensor& x, int s, int64_t first, int64_t mine) {
            return model(x, branch_use(s, first, mine));
          },
          out);
    } else if (kind == "many") {
      train(ManySmall().ptr(), {.bucket_cap_mb = 0.0003, .first_bucket_mb = 0.0001}, chunks, steps,
            {20}, plain, out);
    } else {
      throw ddp::ConfigError("unknown kind " + kind);
    }
    ddp::barrier();
    ddp::destroy_process_group();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_equivalence_worker: %s\n", e.what());
    ddp::record_error(e);
    return 1;
  }
}
