// Collectives composed from a transport's primitives (Note [Composed collectives]).
#include "process_group/composed.h"

#include <ATen/ATen.h>

namespace ddp::composed {

Started followed_by(Started started, std::function<void()> after) {
  started.then = [first = std::move(started.then), after = std::move(after)]() mutable {
    if (first) first();
    after();
  };
  return started;
}

Started reduce(Transport& t, const CollectiveDesc& call, at::Tensor& tensor) {
  return t.all_reduce(call, tensor);
}

Started gather(Transport& t, const CollectiveDesc& call, int rank, int size,
               std::vector<at::Tensor>& outputs, const at::Tensor& input) {
  if (rank == call.root) return t.all_gather(call, outputs, input);
  std::vector<at::Tensor> scratch;
  for (int r = 0; r < size; ++r) scratch.push_back(at::empty_like(input));
  return t.all_gather(call, scratch, input);
}

Started scatter(Transport& t, const CollectiveDesc& call, int rank, int size, at::Tensor& output,
                const std::vector<at::Tensor>& inputs) {
  const int64_t part = output.numel();
  at::Tensor all = rank == call.root ? at::stack(inputs).reshape({-1}).contiguous()
                                     : at::empty({size * part}, output.options());
  CollectiveDesc whole = call;
  whole.count = call.count * static_cast<uint64_t>(size);
  return followed_by(t.broadcast(whole, all), [output, all, rank, part]() mutable {
    output.copy_(all.narrow(0, rank * part, part).view(output.sizes()));
  });
}

Started all_to_all(Transport& t, const CollectiveDesc& call, int rank, int size, at::Tensor& output,
                   const at::Tensor& input) {
  const int64_t chunk = input.numel() / size;
  std::vector<at::Tensor> inputs;
  for (int r = 0; r < size; ++r) inputs.push_back(at::empty_like(input));
  CollectiveDesc whole = call;
  whole.count = call.count * static_cast<uint64_t>(size);
  return followed_by(t.all_gather(whole, inputs, input), [output, inputs, rank, chunk]() mutable {
    for (size_t j = 0; j < inputs.size(); ++j) {
      output.narrow(0, static_cast<int64_t>(j) * chunk, chunk)
          .copy_(inputs[j].narrow(0, rank * chunk, chunk));
    }
  });
}

}  // namespace ddp::composed
