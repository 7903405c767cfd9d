// Links against the installed ddp::ddp and runs one collective on a 1-rank group.
#include <cstdio>

#include <torch/torch.h>

#include <ddp/ddp.h>

int main() {
  ddp::init_process_group();
  auto t = torch::ones({3});
  ddp::all_reduce(t);
  std::printf("consumer: ddp %s, world %d, sum %g\n", DDP_VERSION, ddp::get_world_size(),
              t.sum().item<float>());
  ddp::destroy_process_group();
  return t.sum().item<float>() == 3.0f ? 0 : 1;
}
