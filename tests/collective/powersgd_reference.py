"""PyTorch's own powerSGD_hook on known gradients: the reference test_powersgd.cpp compares with.

    /usr/bin/python3 powersgd_reference.py OUT --shapes 64x32,64,... --steps 6 --rank 1 ...

Runs PyTorch's DistributedDataParallel over Gloo at world size 2 (two forked processes) on a
module whose parameters have the given shapes, with the PowerSGD hook and the given options.
At step s, rank r's loss is sum_i (p_i * G_i).sum() (built in parameter order), so p_i's local
gradient is G_i, drawn from torch.Generator().manual_seed(1000 + 100 * s + r). After each
backward the averaged .grad of every parameter is recorded. OUT receives, in float32 (native
byte order), for each step, each rank, each parameter: G, then the averaged gradient.
A test-only cross-check (Debian's python3-torch); nothing of ddp-cpp runs it in production.
"""
import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

WORLD = 2


def parse_shapes(text):
    return [tuple(int(d) for d in s.split("x")) if s else () for s in text.split(",")]


class Params(torch.nn.Module):
    def __init__(self, shapes):
        super().__init__()
        for i, shape in enumerate(shapes):
            self.register_parameter(f"p{i}", torch.nn.Parameter(torch.zeros(shape)))

    def forward(self, grads):
        loss = None
        for i, g in enumerate(grads):
            term = (getattr(self, f"p{i}") * g).sum()
            loss = term if loss is None else loss + term
        return loss


def gradients(shapes, step, rank):
    gen = torch.Generator().manual_seed(1000 + 100 * step + rank)
    return [torch.randn(shape, generator=gen) for shape in shapes]


class _Done:
    """What all_reduce(async_op=True) returns, already completed."""

    def __init__(self, tensor):
        self._future = torch.futures.Future()
        self._future.set_result([tensor])

    def get_future(self):
        return self._future


def blocking_all_reduce():
    """Makes the hook's all_reduce calls blocking: each bucket is done before the next starts.

    powerSGD_hook issues a bucket's P and Q all-reduces from its future's callbacks, which run
    on Gloo's threads whenever the previous collective completes (and block them while waiting):
    with several buckets the ranks issue them in different orders and Gloo pairs the wrong
    messages (1.13 aborts with "op.preamble.length <= op.nbytes"), and even with one bucket a
    run now and then hangs. A completed future runs its callbacks at once on the calling
    thread, so the hook's arithmetic, PyTorch's own and unchanged, runs in one fixed order.
    """
    real = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        real(tensor, op=op, group=group)
        return _Done(tensor) if async_op else None

    dist.all_reduce = all_reduce


def worker(rank, args, init_file, parts):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD)
    dist._DEFAULT_FIRST_BUCKET_BYTES = args.first_bucket_bytes
    shapes = parse_shapes(args.shapes)
    model = torch.nn.parallel.DistributedDataParallel(
        Params(shapes), bucket_cap_mb=args.bucket_bytes / (1024 * 1024))
    state = powersgd.PowerSGDState(
        process_group=None, matrix_approximation_rank=args.rank,
        start_powerSGD_iter=args.start, min_compression_rate=args.min_rate,
        use_error_feedback=bool(args.error_feedback), warm_start=bool(args.warm_start),
        orthogonalization_epsilon=args.epsilon, random_seed=args.seed,
        batch_tensors_with_same_shape=bool(args.batch))
    blocking_all_reduce()
    model.register_comm_hook(state, powersgd.powerSGD_hook)
    with open(parts[rank], "wb") as out:
        for step in range(args.steps):
            grads = gradients(shapes, step, rank)
            model.zero_grad(set_to_none=True)
            model(grads).backward()
            for g, p in zip(grads, model.module.parameters()):
                out.write(g.contiguous().numpy().tobytes())
                out.write(p.grad.contiguous().numpy().tobytes())
    # Out without tearing down: PyTorch 1.13's ProcessGroupGloo destructor joins its worker
    # threads while holding the GIL, and a worker freeing a tensor that a Python object owns
    # waits for the GIL: a deadlock at exit now and then (3 runs in 12 under load). Everything
    # is written and every collective done once both ranks pass the barrier.
    dist.barrier()
    os._exit(0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", required=True)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rank", type=int, default=1)
    ap.add_argument("--start", type=int, default=2)
    ap.add_argument("--min-rate", type=float, default=2)
    ap.add_argument("--error-feedback", type=int, default=1)
    ap.add_argument("--warm-start", type=int, default=1)
    ap.add_argument("--epsilon", type=float, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=0)
    ap.add_argument("--bucket-bytes", type=int, default=25 << 20)
    ap.add_argument("--first-bucket-bytes", type=int, default=1 << 20)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        parts = [os.path.join(tmp, f"rank{r}.bin") for r in range(WORLD)]
        mp.start_processes(worker, args=(args, os.path.join(tmp, "init"), parts), nprocs=WORLD,
                           start_method="fork")
        blobs = [open(p, "rb").read() for p in parts]
    # Interleave per step: step s of rank 0, then of rank 1.
    shapes = parse_shapes(args.shapes)
    per_step = 2 * 4 * sum(int(torch.Size(s).numel()) for s in shapes)
    with open(args.out, "wb") as out:
        for step in range(args.steps):
            for blob in blobs:
                out.write(blob[step * per_step:(step + 1) * per_step])
    return 0


if __name__ == "__main__":
    sys.exit(main())
