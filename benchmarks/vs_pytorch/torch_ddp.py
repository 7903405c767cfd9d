#!/usr/bin/python3
"""PyTorch's own DDP (or FSDP) on the comparison workload: the other side of benchmarks/vs_pytorch.

    /usr/bin/python3 benchmarks/vs_pytorch/torch_ddp.py --nproc 2 --model classic-cnn --csv t.csv
    python3 benchmarks/vs_pytorch/torch_ddp.py --nproc 2 --model mlp-1024 --fsdp zero3  # 2.x

Does exactly what `ddp-bench train` does (tools/ddp_bench/train.h), in torch.nn with
torch.nn.parallel.DistributedDataParallel over Gloo: Fashion-MNIST read from Debian's IDX .gz
files, normalised with the same mean and std; a DistributedSampler (shuffle, seed, drop_last)
cut into whole batches of global/world samples, gathered by indexing one tensor (what
ddp::TensorDataset does); cross-entropy on logits; SGD with momentum; warm-up steps, a barrier,
then timed steps; samples/s = steps x global batch / the slowest rank's wall time. The row
appended to --csv has ddp-bench's columns; comm_ms is empty (PyTorch does not expose when its
reducer finished, so backward_ms includes the exposed communication).

--fsdp zero2|zero3 trains through PyTorch's FSDP instead of DDP, as `ddp-bench train --fsdp`:
a unit per Linear and Conv2d layer (ours: zero3's ddp::Sharded layers, zero2's unit per child
module; the same layers in these two models), then the root; zero3 = FULL_SHARD (each unit
gathered for its forward and again for its backward), zero2 = SHARD_GRAD_OP (gathered for the
forward, kept through the backward). --fsdp-api picks which FSDP:
  fsdp1 (default): torch.distributed.fsdp.FullyShardedDataParallel with
    ShardingStrategy.FULL_SHARD / SHARD_GRAD_OP, a lambda_auto_wrap_policy on Linear/Conv2d,
    device_id the training device (torch.device("cpu") on the CPU: with None, 2.6 raises "FSDP
    needs a non-CPU accelerator device"), every other option its default (flat parameters per
    unit, as ours; backward_prefetch BACKWARD_PRE);
  fully_shard: FSDP2, fully_shard(layer) for each layer then fully_shard(model), with
    reshard_after_forward True (zero3) / False (zero2). PyTorch 2.6 does not run it on the CPU:
    the first forward fails in foreach_all_gather with "AttributeError: 'Stream' object has no
    attribute 'record_event'" (torch.cpu.Stream); hence fsdp1 by default.
Either way the optimizer steps the FSDP module's (sharded) parameters and comm_ms stays empty.
The "# pytorch" line ends with the last step's loss (mean over ranks), to check that a
configuration trains like another on the same seed.

--device cuda trains on cuda:LOCAL_RANK with DDP over NCCL (as `ddp-bench train --device cuda`):
batches pinned and copied non_blocking, each phase ended by torch.cuda.synchronize() so that it
is charged its own kernels.

With --nproc N (and no RANK in the environment) it starts N copies of itself with torchrun's
variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and OMP_NUM_THREADS; it also
runs as a worker under `python3 -m torch.distributed.run` (Debian's 1.13 needs
`--redirects 1 --tee 1` on Python 3.11).
"""
import argparse
import gzip
import os
import socket
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

DATA_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
MEAN, STD = 0.2860, 0.3530                      # ddp::kFashionMnistMean / kFashionMnistStd
CSV_HEADER = ("label,model,backend,world_size,threads_per_rank,global_batch,steps,"
              "samples_per_s,step_ms,data_ms,forward_ms,backward_ms,comm_ms,optimizer_ms\n")


class ClassicCnn(nn.Module):
    """PyTorch's examples/mnist network, returning logits (as tools/common/models.cpp)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3)
        self.conv2 = nn.Conv2d(32, 64, 3)
        self.drop1 = nn.Dropout(0.25)
        self.fc1 = nn.Linear(9216, 128)
        self.drop2 = nn.Dropout(0.5)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = self.drop1(F.max_pool2d(x, 2)).flatten(1)
        return self.fc2(self.drop2(F.relu(self.fc1(x))))


class Mlp1024(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(784, 1024)
        self.fc2 = nn.Linear(1024, 1024)
        self.fc3 = nn.Linear(1024, 10)

    def forward(self, x):
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


MODELS = {"classic-cnn": ClassicCnn, "mlp-1024": Mlp1024}


def read_idx(path, header_bytes):
    with gzip.open(path, "rb") as f:
        # torch alone (a pip PyTorch may come without numpy); bytearray: a writable buffer.
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8, offset=header_bytes)


def load_train(data_dir):
    """float32 images [60000, 1, 28, 28] normalised as ddp::FashionMnist does; int64 labels."""
    images = read_idx(os.path.join(data_dir, "train-images-idx3-ubyte.gz"), 16)
    labels = read_idx(os.path.join(data_dir, "train-labels-idx1-ubyte.gz"), 8)
    x = images.to(torch.float32).view(-1, 1, 28, 28).div_(255.0)
    x = x.sub_(MEAN).div_(STD)
    return x, labels.to(torch.int64)


class Batches:
    """Whole batches forever, a new sampler epoch (reshuffled) after each pass."""

    def __init__(self, data, labels, batch, rank, world, seed):
        self.data, self.labels, self.batch = data, labels, batch
        self.sampler = torch.utils.data.DistributedSampler(
            range(len(labels)), num_replicas=world, rank=rank, shuffle=True, seed=seed,
            drop_last=True)
        self.epoch, self.batches = 0, iter(())

    def _pass(self):
        self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        indices = torch.tensor(list(self.sampler), dtype=torch.int64)
        whole = len(indices) // self.batch
        return iter(indices[: whole * self.batch].split(self.batch))

    def next(self, device):
        idx = next(self.batches, None)
        if idx is None:
            self.batches = self._pass()
            idx = next(self.batches)
        x, y = self.data.index_select(0, idx), self.labels.index_select(0, idx)
        if device.type == "cuda":  # what ddp::DataLoader does for a CUDA device
            x = x.pin_memory().to(device, non_blocking=True)
            y = y.pin_memory().to(device, non_blocking=True)
        return x, y


def wrap_fsdp(net, args, device):
    """net as PyTorch's FSDP (--fsdp, --fsdp-api); returns (model, description)."""
    is_layer = lambda m: isinstance(m, (nn.Linear, nn.Conv2d))  # ours: the Sharded layers
    if args.fsdp_api == "fully_shard":
        try:
            from torch.distributed.fsdp import fully_shard  # 2.6 and later
        except ImportError:
            from torch.distributed._composable.fsdp import fully_shard  # 2.4, 2.5
        reshard = args.fsdp == "zero3"
        for m in net.modules():
            if is_layer(m):
                fully_shard(m, reshard_after_forward=reshard)
        fully_shard(net, reshard_after_forward=reshard)
        return net, f"FSDP2 fully_shard(reshard_after_forward={reshard}) per layer"
    import functools
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
    strategy = (ShardingStrategy.FULL_SHARD if args.fsdp == "zero3"
                else ShardingStrategy.SHARD_GRAD_OP)
    model = FullyShardedDataParallel(
        net, sharding_strategy=strategy,
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=is_layer),
        device_id=device)  # on the CPU too: None makes 2.6 look for an accelerator and fail
    return model, f"FSDP1 FullyShardedDataParallel({strategy.name}) per layer"


def worker(args):
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("torch_ddp.py: --device cuda: no CUDA device is available")
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device, backend = torch.device("cuda", local), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dist.init_process_group(backend, rank=rank, world_size=world)
    if args.batch_size % world:
        sys.exit(f"--batch-size {args.batch_size} must be a multiple of the world size {world}")
    data, labels = load_train(args.data_dir)
    torch.manual_seed(args.seed)
    net = MODELS[args.model]().to(device)
    # --no-ddp: every rank trains its own replica, no gradient exchange (PyTorch's compute alone,
    # as `ddp-bench train --no-ddp`; benchmarks/perf_model.py takes it as PyTorch's compute).
    kind = "no DDP" if args.no_ddp else "DDP"
    if args.fsdp:
        model, kind = wrap_fsdp(net, args, device)
    else:
        model = net if args.no_ddp else nn.parallel.DistributedDataParallel(
            net, device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=args.gradient_as_bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    batches = Batches(data, labels, args.batch_size // world, rank, world, args.seed)

    sums = [0.0] * 4  # data, forward, backward (with exposed communication), optimizer
    timed_start = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync()
            dist.barrier()
            timed_start = time.perf_counter()
        t0 = time.perf_counter()
        x, y = batches.next(device)
        sync()
        t1 = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        last_loss = loss.detach()
        sync()
        t2 = time.perf_counter()
        loss.backward()
        sync()
        t3 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        sync()
        t4 = time.perf_counter()
        if step >= args.warmup:
            for i, dt in enumerate((t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                sums[i] += dt
    # On the training device: NCCL reduces CUDA tensors only.
    wall = torch.tensor([time.perf_counter() - timed_start], dtype=torch.float64, device=device)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    means = torch.tensor(sums, dtype=torch.float64, device=device)
    dist.all_reduce(means)
    ms = (means / world / args.steps * 1e3).tolist()
    last_loss = last_loss.to(torch.float64).reshape(1)
    dist.all_reduce(last_loss)
    loss_mean = last_loss.item() / world
    w = wall.item()
    if rank == 0:
        row = dict(samples_per_s=args.steps * args.batch_size / w, step_ms=w / args.steps * 1e3)
        print(f"# pytorch {torch.__version__} {kind} ({backend}) on {device}: {args.model}, global batch "
              f"{args.batch_size}, {world} ranks x {args.threads} thread(s): "
              f"{row['samples_per_s']:.1f} samples/s, {row['step_ms']:.2f} ms/step "
              f"(data {ms[0]:.2f}, forward {ms[1]:.2f}, backward+comm {ms[2]:.2f}, "
              f"optimizer {ms[3]:.2f}); last step's loss {loss_mean:.4f}", flush=True)
        if args.csv:
            fresh = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
            with open(args.csv, "a") as f:
                if fresh:
                    f.write(CSV_HEADER)
                f.write(f"{args.label},{args.model},{backend},{world},{args.threads},"
                        f"{args.batch_size},{args.steps},{row['samples_per_s']:.2f},"
                        f"{row['step_ms']:.4f},{ms[0]:.4f},{ms[1]:.4f},{ms[2]:.4f},,"
                        f"{ms[3]:.4f}\n")
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(args):
    """N copies of this script as ranks 0..N-1 of one group on 127.0.0.1."""
    port = str(free_port())
    procs = []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank),
                   WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                   OMP_NUM_THREADS=str(args.threads))
        procs.append(subprocess.Popen([sys.executable] + sys.argv, env=env))
    codes = [p.wait() for p in procs]
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad:
        sys.exit(f"torch_ddp.py: ranks failed (rank, exit code): {bad}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="classic-cnn")
    p.add_argument("--batch-size", type=int, default=128, help="global batch")
    p.add_argument("--steps", type=int, default=100, help="timed steps")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps before them")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start (without RANK set)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=DATA_DIR)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu (DDP over Gloo) or cuda (cuda:LOCAL_RANK, DDP over NCCL)")
    p.add_argument("--label", default="pytorch")
    p.add_argument("--no-ddp", action="store_true",
                   help="each rank trains alone: no DDP, no gradient exchange")
    p.add_argument("--gradient-as-bucket-view", action="store_true",
                   help="DDP's gradient_as_bucket_view (PyTorch's default: off)")
    p.add_argument("--fsdp", choices=["zero2", "zero3"], default="",
                   help="PyTorch's FSDP instead of DDP, a unit per Linear/Conv2d layer: zero3 = "
                        "FULL_SHARD, zero2 = SHARD_GRAD_OP (as ddp-bench train --fsdp)")
    p.add_argument("--fsdp-api", choices=["fsdp1", "fully_shard"], default="fsdp1",
                   help="with --fsdp: FSDP1's FullyShardedDataParallel (default), or FSDP2's "
                        "fully_shard (PyTorch 2.6 fails to run it on the CPU)")
    p.add_argument("--csv", default="", help="append the result row (rank 0)")
    args = p.parse_args()
    if args.fsdp and (args.no_ddp or args.gradient_as_bucket_view):
        p.error("--fsdp takes neither --no-ddp nor --gradient-as-bucket-view")
    if "RANK" in os.environ:
        worker(args)
    else:
        spawn(args)


if __name__ == "__main__":
    main()
